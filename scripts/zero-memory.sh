#!/usr/bin/env bash
# ZeRO 0–3 side by side at dp 4 on the CPU benchmark configs (GPT-2 and its
# Llama twin): each replica's peak training-state bytes (weights, gradients,
# the gradient tree's partial sums, AdamW moments, ZeRO-3's gathered chunk;
# summary.json's peak_state_bytes, counted by the compute) against the
# planner's figure for it (`plan --gpu cpu --json`: state_peak_bytes), and
# tokens/s against ZeRO 0 in the same run of this script.
#
#   scripts/zero-memory.sh [steps] [extra --set flags...]
set -euo pipefail
cd "$(dirname "$0")/.."
steps=${1:-3}
shift || true
cargo build --release --quiet
bin=target/release/pipewright
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
printf '%-18s %-5s %-14s %-14s %-9s %-10s %-8s\n' config zero "peak state MB" "planner MB" "off by" "tokens/s" "vs zero0"
for cfg in configs/bench-cpu.toml configs/bench-cpu-llama.toml; do
  base=""
  for zero in 0 1 2 3; do
    sets=(--set parallel.dp=4 --set parallel.microbatches=2 --set "parallel.zero=$zero" "$@")
    out="$work/$(basename "$cfg" .toml)-$zero"
    "$bin" train --config "$cfg" --steps "$steps" "${sets[@]}" --out "$out" >/dev/null 2>&1 \
      || { echo "train failed: $cfg zero=$zero" >&2; exit 1; }
    "$bin" plan --gpu cpu --config "$cfg" "${sets[@]}" --json >"$out/plan.json" 2>/dev/null \
      || { echo "plan failed: $cfg zero=$zero" >&2; exit 1; }
    read -r measured planned tps < <(python3 - "$out" <<'PY'
import json, sys
d = sys.argv[1]
s = json.load(open(f"{d}/summary.json"))
p = json.load(open(f"{d}/plan.json"))["cpu"]["ranks"]
print(max(s["peak_state_bytes"]), max(r["state_peak_bytes"] for r in p), s["tokens_per_s"])
PY
)
    base=${base:-$tps}
    python3 -c "
m, p, t, b = $measured, $planned, $tps, $base
print(f'{\"$(basename "$cfg" .toml)\":<18} {$zero:<5} {m/1e6:<14.2f} {p/1e6:<14.2f} {(m-p)/p*100:+7.1f}%  {t:<10.0f} {t/b:<8.2f}')"
  done
done
