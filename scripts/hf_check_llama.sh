#!/usr/bin/env bash
# pipewright's Llama family against transformers' LlamaForCausalLM and
# PyTorch's AdamW, end to end (scripts/hf_llama.py):
#   1. train configs/llama-tiny.toml briefly; LlamaForCausalLM.from_pretrained
#      opens the run folder as it is; its loss equals `pipewright eval`'s;
#      save_pretrained's folder evaluates the same in pipewright with no --set;
#   2. from that Hugging Face folder, a few AdamW steps (`train --init`) in
#      pipewright and in PyTorch end on the same weights.
# PASS when the losses agree to 1e-5 relative and the weights to 1e-4.
#
#   scripts/hf_check_llama.sh            # PYTHON=/work/venv-torch/bin/python by default
#
# Needs PyTorch, safetensors and transformers; not part of CI.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-/work/venv-torch/bin/python}
N=${N:-16}
STEPS=${STEPS:-4}
# AdamW's eps: near 1e-8, m/√v turns f32 rounding of a tiny gradient into a
# whole step of lr; a larger EPS shows how close the gradients themselves are.
EPS=${EPS:-1e-8}
WORK=${WORK:-/tmp/hfcheck-llama}
if ! "$PYTHON" -c "import torch, transformers, safetensors" 2>/dev/null; then
    echo "error: $PYTHON cannot import torch, transformers and safetensors" >&2
    exit 2
fi
cargo build --release --quiet
BIN=${CARGO_TARGET_DIR:-target}/release/pipewright

rm -rf "$WORK" && mkdir -p "$WORK"
"$BIN" train --config configs/llama-tiny.toml --steps 30 --set optim.warmup_steps=10 \
    --out "$WORK/run" > "$WORK/train.log" 2>&1
cat src/*.rs src/*/*.rs > "$WORK/text.txt"
"$BIN" prepare "$WORK/text.txt" --tokenizer bytes --out "$WORK/data" > /dev/null
loss() { "$PYTHON" -c 'import json, sys; print(json.loads(sys.stdin.read().splitlines()[-1])["loss"])'; }

ours=$("$BIN" eval --weights "$WORK/run" --data "$WORK/data/val.bin" --windows "$N" --json | loss)
hf=$("$PYTHON" scripts/hf_llama.py eval "$WORK/run" "$WORK/hf" "$WORK/data/val.bin" "$N" 2>/dev/null | tail -n 1)
back=$("$BIN" eval --weights "$WORK/hf" --data "$WORK/data/val.bin" --windows "$N" --json | loss)

# AdamW from Hugging Face's folder: one stage, one microbatch of 4 sequences
# a step, read in order, a constant rate, clipping at 1.
"$BIN" train --init "$WORK/hf" --steps "$STEPS" --set data.train="$WORK/data/train.bin" \
    --set data.sampler=sequential --set train.micro_batch_size=4 --set parallel.pp=1 \
    --set parallel.microbatches=1 --set optim.schedule=constant --set optim.warmup_steps=0 \
    --set optim.lr=1e-3 --set optim.min_lr=1e-3 --set optim.weight_decay=0.1 --set optim.grad_clip=1.0 \
    --set optim.eps="$EPS" \
    --set train.eval_every=0 --set checkpoint.every=0 --out "$WORK/steps" > "$WORK/steps.log" 2>&1
"$PYTHON" scripts/hf_llama.py train "$WORK/hf" "$WORK/data/train.bin" "$STEPS" 4 1e-3 0.1 1.0 \
    "$WORK/torch.safetensors" "$EPS" 2> "$WORK/torch.log"
"$PYTHON" scripts/hf_llama.py compare "$WORK/steps/model.safetensors" "$WORK/torch.safetensors" \
    > "$WORK/compare.txt"
read -r wdiff wname < "$WORK/compare.txt"

"$PYTHON" - "$ours" "$hf" "$back" "$wdiff" "$wname" <<'PY'
import sys
ours, hf, back, wdiff = map(float, sys.argv[1:5])
rels = [abs(x - ours) / abs(ours) for x in (hf, back)]
print(f"pipewright eval                      : {ours:.9f}")
print(f"LlamaForCausalLM.from_pretrained(run): {hf:.9f}")
print(f"pipewright eval on HF's folder       : {back:.9f}")
print(f"largest relative loss diff           : {max(rels):.2e}")
print(f"AdamW steps, largest weight diff     : {wdiff:.2e} ({sys.argv[5]})")
ok = max(rels) <= 1e-5 and wdiff <= 1e-4
print("PASS" if ok else "FAIL")
sys.exit(0 if ok else 1)
PY
