#!/usr/bin/env bash
# Training throughput of pipewright vs PyTorch (eager, and torch.compile when it
# works) on the same model and work: configs/bench-cpu.toml (GPT-2) and
# configs/bench-cpu-llama.toml (the Llama of the same width and depth), which
# scripts/torch_bench.py mirrors. Runs them one after another on all cores;
# each Llama row is compared with pipewright's Llama, each GPT-2 row with its GPT-2.
#
#   scripts/bench_vs_torch.sh            # PYTHON=/work/venv-torch/bin/python by default
#   STEPS=20 PYTHON=python3 scripts/bench_vs_torch.sh
#
# Needs PyTorch; not part of CI. Exits non-zero if torch cannot be imported.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-/work/venv-torch/bin/python}
STEPS=${STEPS:-20}
if ! "$PYTHON" -c "import torch" 2>/dev/null; then
    echo "error: cannot import torch with $PYTHON; set PYTHON to an interpreter that has PyTorch" >&2
    exit 2
fi
cargo build --release --quiet
BIN=${CARGO_TARGET_DIR:-target}/release/pipewright

results=$(mktemp); trap 'rm -f "$results"' EXIT
echo "running pipewright bench ($STEPS steps)..." >&2
"$BIN" bench --config configs/bench-cpu.toml --steps "$STEPS" --pp 1 --json | tail -n 1 \
    | sed 's/^{/{"impl":"pipewright",/' >> "$results"
echo "running torch eager..." >&2
"$PYTHON" scripts/torch_bench.py --steps "$STEPS" | tail -n 1 >> "$results"
echo "running torch.compile..." >&2
if ! "$PYTHON" scripts/torch_bench.py --steps "$STEPS" --compile 2>/tmp/torch_compile.err | tail -n 1 >> "$results"; then
    echo "torch.compile failed (see /tmp/torch_compile.err); left out" >&2
fi
echo "running pipewright bench, Llama ($STEPS steps)..." >&2
"$BIN" bench --config configs/bench-cpu-llama.toml --steps "$STEPS" --pp 1 --json | tail -n 1 \
    | sed 's/^{/{"impl":"pipewright-llama",/' >> "$results"
echo "running torch eager, Llama..." >&2
"$PYTHON" scripts/torch_bench.py --steps "$STEPS" --llama | tail -n 1 >> "$results"

"$PYTHON" - "$results" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
ours = {"gpt2": rows[0], "llama": next(r for r in rows if r["impl"] == "pipewright-llama")}
family = lambda r: "llama" if r["impl"].endswith("llama") else "gpt2"
print(f"{'':22}{'params':>9}{'tokens/s':>10}{'ms/step':>10}{'GFLOP/s':>10}{'pipewright / this':>20}")
for r in rows:
    pw = ours[family(r)]
    print(f"{r['impl']:22}{r['params']:>9}{r['tokens_per_s']:>10.0f}{r['ms_per_step']:>10.1f}{r['gflops']:>10.2f}"
          f"{pw['tokens_per_s'] / r['tokens_per_s']:>19.2f}x")
    if r['params'] != pw['params'] or r['tokens_per_step'] != pw['tokens_per_step']:
        print(f"WARNING: different work: params {pw['params']} vs {r['params']}, tokens/step {pw['tokens_per_step']} vs {r['tokens_per_step']}")
g, l = ours["gpt2"], ours["llama"]
print(f"pipewright Llama / GPT-2 of the same width and depth: {l['tokens_per_s'] / g['tokens_per_s']:.2f}x tokens/s, "
      f"{l['gflops'] / g['gflops']:.2f}x GFLOP/s")
t = rows[1]
print(f"({g['threads']} threads; torch {t['torch']} on {t['threads']} threads; {g['steps']} timed steps)")
PY
