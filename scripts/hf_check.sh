#!/usr/bin/env bash
# End-to-end check of pipewright's model against Hugging Face's GPT-2: train a
# short run, tokenize some text, and compare `pipewright eval`'s mean loss with
# the loss transformers.GPT2LMHeadModel computes from the same weights and
# windows (scripts/hf_check.py), and the folder round trip both ways
# (scripts/hf_roundtrip.py). PASS when all agree to 1e-5 relative.
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
    --data "$WORK/data/val.bin" --windows "$N" --json | tail -n 1 \
    | "$PYTHON" -c 'import json, sys; print(json.load(sys.stdin)["loss"])')
hf=$("$PYTHON" scripts/hf_check.py "$WORK/run/model.safetensors" "$WORK/data/val.bin" "$N")

# Both ways through folders: from_pretrained(run dir) as it is, then
# save_pretrained and pipewright eval on HF's own folder with no --set.
rt=$("$PYTHON" scripts/hf_roundtrip.py "$WORK/run" "$WORK/hf" "$WORK/data/val.bin" "$N" | tail -n 1)
back=$("$BIN" eval --weights "$WORK/hf" --data "$WORK/data/val.bin" --windows "$N" --json | tail -n 1 \
    | "$PYTHON" -c 'import json, sys; print(json.load(sys.stdin)["loss"])')

"$PYTHON" - "$ours" "$hf" "$rt" "$back" <<'PY'
import sys
ours, hf, rt, back = map(float, sys.argv[1:])
rels = [abs(x - ours) / abs(ours) for x in (hf, rt, back)]
print(f"pipewright eval               : {ours:.9f}\nHF GPT2LMHead (weights only)  : {hf:.9f}")
print(f"HF from_pretrained(run dir)   : {rt:.9f}\npipewright eval on HF's folder: {back:.9f}")
print(f"largest relative diff         : {max(rels):.2e}")
print("PASS" if max(rels) <= 1e-5 else "FAIL")
sys.exit(0 if max(rels) <= 1e-5 else 1)
PY
