#!/usr/bin/env bash
# ZeRO 0–3 side by side at dp 4 on the CPU benchmark configs (GPT-2 and its
# Llama twin): each replica's peak training-state bytes (weights, gradients,
# the gradient tree's partial sums, AdamW moments, ZeRO-3's gathered chunk;
# summary.json's peak_state_bytes, counted by the compute) against the
# planner's figure for it (`plan --gpu cpu --json`: state_peak_bytes), and
# tokens/s against ZeRO 0 in the same run of this script.
#
#   scripts/zero-memory.sh [--nodes N] [steps] [extra --set flags...]
#
# --nodes N: each run is `launch --nodes N` (one replica a process at
# N = 4), and the table adds every process's peak resident memory: rank 0's
# from summary.json's peak_rss_bytes, the others' from the line each worker
# prints as it ends ("rank K: done (peak RSS X MiB)").
set -euo pipefail
cd "$(dirname "$0")/.."
nodes=1
if [ "${1:-}" = "--nodes" ]; then
  [[ "${2:-}" =~ ^[1-9][0-9]*$ ]] || { echo "zero-memory.sh: --nodes needs a number of processes" >&2; exit 2; }
  nodes=$2
  shift 2
fi
steps=${1:-3}
shift || true
cargo build --release --quiet
bin=target/release/pipewright
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
printf '%-18s %-5s %-14s %-14s %-9s %-10s %-8s' config zero "peak state MB" "planner MB" "off by" "tokens/s" "vs zero0"
[ "$nodes" -gt 1 ] && printf ' %s' "peak RSS MiB per process (rank 0, 1, ...)"
printf '\n'
for cfg in configs/bench-cpu.toml configs/bench-cpu-llama.toml; do
  base=""
  for zero in 0 1 2 3; do
    sets=(--set parallel.dp=4 --set parallel.microbatches=2 --set "parallel.zero=$zero" "$@")
    out="$work/$(basename "$cfg" .toml)-$zero"
    if [ "$nodes" -gt 1 ]; then
      run=(launch --nodes "$nodes")
    else
      run=(train)
    fi
    "$bin" "${run[@]}" --config "$cfg" --steps "$steps" "${sets[@]}" --out "$out" >"$work/log" 2>&1 \
      || { echo "${run[*]} failed: $cfg zero=$zero" >&2; tail -20 "$work/log" >&2; exit 1; }
    "$bin" plan --gpu cpu --nodes "$nodes" --config "$cfg" "${sets[@]}" --json >"$out/plan.json" 2>/dev/null \
      || { echo "plan failed: $cfg zero=$zero" >&2; exit 1; }
    read -r measured planned tps rss < <(python3 - "$out" "$work/log" "$nodes" <<'PY'
import json, re, sys
d, log, nodes = sys.argv[1], sys.argv[2], int(sys.argv[3])
s = json.load(open(f"{d}/summary.json"))
p = json.load(open(f"{d}/plan.json"))["cpu"]["ranks"]
rss = "-"
if nodes > 1:
    workers = {int(k): float(v) for k, v in re.findall(r"rank (\d+): done \(peak RSS ([0-9.]+) MiB\)", open(log).read())}
    if sorted(workers) != list(range(1, nodes)):
        sys.exit(f"expected a peak RSS line from ranks 1..{nodes - 1}, found {sorted(workers)}")
    per = [s["peak_rss_bytes"] / 2**20] + [workers[k] for k in range(1, nodes)]
    rss = ",".join(f"{x:.0f}" for x in per)
print(max(s["peak_state_bytes"]), max(r["state_peak_bytes"] for r in p), s["tokens_per_s"], rss)
PY
)
    base=${base:-$tps}
    python3 -c "
m, p, t, b = $measured, $planned, $tps, $base
rss = '$rss'
print(f'{\"$(basename "$cfg" .toml)\":<18} {$zero:<5} {m/1e6:<14.2f} {p/1e6:<14.2f} {(m-p)/p*100:+7.1f}%  {t:<10.0f} {t/b:<8.2f}' + ('' if rss == '-' else f' {rss}'))"
  done
done
