#!/usr/bin/env bash
# Training throughput of pipewright vs PyTorch (eager, and torch.compile when it
# works) on the same model and work: configs/bench-cpu.toml, which
# scripts/torch_bench.py mirrors. Runs them one after another on all cores.
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

"$PYTHON" - "$results" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
pw = rows[0]
print(f"{'':16}{'tokens/s':>10}{'ms/step':>10}{'GFLOP/s':>10}{'pipewright / this':>20}")
for r in rows:
    print(f"{r['impl']:16}{r['tokens_per_s']:>10.0f}{r['ms_per_step']:>10.1f}{r['gflops']:>10.2f}"
          f"{pw['tokens_per_s'] / r['tokens_per_s']:>19.2f}x")
t = rows[1]
if t['params'] != pw['params'] or t['tokens_per_step'] != pw['tokens_per_step']:
    print(f"WARNING: different work: params {pw['params']} vs {t['params']}, tokens/step {pw['tokens_per_step']} vs {t['tokens_per_step']}")
print(f"({pw['threads']} threads; torch {t['torch']} on {t['threads']} threads; {pw['steps']} timed steps)")
PY
