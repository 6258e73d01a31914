#!/usr/bin/env bash
# End-to-end check of pipewright's model against Hugging Face's GPT-2: train a
# short run, tokenize some text, and compare `pipewright eval`'s mean loss with
# the loss transformers.GPT2LMHeadModel computes from the same weights and
# windows (scripts/hf_check.py). PASS when they agree to 1e-5 relative.
#
#   scripts/hf_check.sh                  # PYTHON=/work/venv-torch/bin/python by default
#
# Needs PyTorch, safetensors and transformers; not part of CI.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-/work/venv-torch/bin/python}
N=${N:-16}
WORK=${WORK:-/tmp/hfcheck}
if ! "$PYTHON" -c "import torch, transformers, safetensors" 2>/dev/null; then
    echo "error: $PYTHON cannot import torch, transformers and safetensors" >&2
    exit 2
fi
cargo build --release --quiet
BIN=${CARGO_TARGET_DIR:-target}/release/pipewright

rm -rf "$WORK" && mkdir -p "$WORK"
# The default config warms up for 100 steps, which --steps 30 rejects.
"$BIN" train --steps 30 --set optim.warmup_steps=10 --out "$WORK/run" > "$WORK/train.log" 2>&1
# Validation text: this repository's Rust sources, tokenized as bytes.
cat src/*.rs src/*/*.rs > "$WORK/text.txt"
"$BIN" prepare "$WORK/text.txt" --tokenizer bytes --out "$WORK/data" > /dev/null

ours=$("$BIN" eval --config "$WORK/run/config.toml" --weights "$WORK/run" \
    --data "$WORK/data/val.bin" --batches "$N" --json | tail -n 1 \
    | "$PYTHON" -c 'import json, sys; print(json.load(sys.stdin)["loss"])')
hf=$("$PYTHON" scripts/hf_check.py "$WORK/run/model.safetensors" "$WORK/data/val.bin" "$N")

"$PYTHON" - "$ours" "$hf" <<'PY'
import sys
ours, hf = map(float, sys.argv[1:])
rel = abs(ours - hf) / abs(hf)
print(f"pipewright eval: {ours:.9f}\nHF GPT2LMHead : {hf:.9f}\nrelative diff : {rel:.2e}")
print("PASS" if rel <= 1e-5 else "FAIL")
sys.exit(0 if rel <= 1e-5 else 1)
PY
