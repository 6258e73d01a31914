#!/usr/bin/env bash
# Every family against transformers' own class in float64 (scripts/hf_families.py),
# from the checkpoints people download: a tiny random model per family saved by
# save_pretrained sharded (several shards and an index) and in bf16.
#   1. `pipewright eval` on that folder against the class's loss in f64;
#   2. a few AdamW steps (`train --init` the folder) against PyTorch's AdamW
#      in f64, weights compared;
#   3. the run folder opens in transformers as the family's own class, and
#      `pipewright export --dtype bf16 --max-shard-size` of it opens there too.
# Prints a table; FAIL when a loss differs by more than 1e-5 relative, or a
# weight by more than 1e-4 and more than twice what PyTorch's own f32 run of
# the same steps differs from its f64 run (f32's floor: AdamW turns a
# gradient that is only rounding into a whole step of either sign, so the
# floor depends on the model, not on the trainer).
#
#   scripts/hf_families.sh [FAMILY...]   # PYTHON=/work/venv-torch/bin/python by default
#
# Needs PyTorch, safetensors and transformers; not part of CI.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-/work/venv-torch/bin/python}
N=${N:-8}
STEPS=${STEPS:-3}
EPS=${EPS:-1e-8}
WORK=${WORK:-/tmp/hf-families}
FAMILIES=("$@")
[ ${#FAMILIES[@]} -gt 0 ] || FAMILIES=(gpt2 llama llama3 qwen2 qwen3 mistral)
if ! "$PYTHON" -c "import torch, transformers, safetensors" 2>/dev/null; then
    echo "error: $PYTHON cannot import torch, transformers and safetensors" >&2
    exit 2
fi
cargo build --release --quiet
BIN=${CARGO_TARGET_DIR:-target}/release/pipewright
rm -rf "$WORK" && mkdir -p "$WORK"
cat src/*.rs src/*/*.rs > "$WORK/text.txt"
"$BIN" prepare "$WORK/text.txt" --tokenizer bytes --out "$WORK/data" > /dev/null
loss() { "$PYTHON" -c 'import json, sys; print(json.loads(sys.stdin.read().splitlines()[-1])["loss"])'; }
rows=()
status=0
for fam in "${FAMILIES[@]}"; do
    w="$WORK/$fam"
    mkdir -p "$w"
    "$PYTHON" scripts/hf_families.py make "$fam" "$w/hf" --bf16 --shard 40000 > "$w/make.log" 2>&1
    shards=$(ls "$w/hf"/model-*.safetensors 2>/dev/null | wc -l)
    ours=$("$BIN" eval --weights "$w/hf" --data "$WORK/data/val.bin" --windows "$N" --json 2> "$w/eval.log" | loss)
    theirs=$("$PYTHON" scripts/hf_families.py eval "$w/hf" "$WORK/data/val.bin" "$N" 2>/dev/null | tail -n 1)
    "$BIN" train --init "$w/hf" --steps "$STEPS" --set data.train="$WORK/data/train.bin" \
        --set data.sampler=sequential --set train.micro_batch_size=4 --set parallel.pp=1 \
        --set parallel.microbatches=1 --set optim.schedule=constant --set optim.warmup_steps=0 \
        --set optim.lr=1e-3 --set optim.min_lr=1e-3 --set optim.weight_decay=0.1 --set optim.grad_clip=1.0 \
        --set optim.eps="$EPS" --set train.eval_every=0 --set checkpoint.every=0 \
        --out "$w/run" > "$w/train.log" 2>&1
    "$PYTHON" scripts/hf_families.py train "$w/hf" "$WORK/data/train.bin" "$STEPS" 4 1e-3 0.1 1.0 "$EPS" \
        "$w/torch.safetensors" 2> "$w/torch.log"
    "$PYTHON" scripts/hf_families.py train "$w/hf" "$WORK/data/train.bin" "$STEPS" 4 1e-3 0.1 1.0 "$EPS" \
        "$w/torch32.safetensors" float32 2> "$w/torch32.log"
    read -r wdiff wname < <("$PYTHON" scripts/hf_families.py compare "$w/run/model.safetensors" "$w/torch.safetensors")
    read -r floor fname < <("$PYTHON" scripts/hf_families.py compare "$w/torch32.safetensors" "$w/torch.safetensors")
    class=$("$PYTHON" scripts/hf_families.py opens "$w/run" 2>/dev/null | tail -n 1)
    "$BIN" export "$w/run" --out "$w/export" --dtype bf16 --max-shard-size 20000 > "$w/export.log" 2>&1
    exported=$("$PYTHON" scripts/hf_families.py opens "$w/export" 2>/dev/null | tail -n 1)
    verdict=$("$PYTHON" - "$ours" "$theirs" "$wdiff" "$floor" <<'PY'
import sys
ours, theirs, w, floor = map(float, sys.argv[1:])
rel = abs(ours - theirs) / abs(theirs)
print(f"{rel:.2e} {'PASS' if rel <= 1e-5 and (w <= 1e-4 or w <= 2 * floor) else 'FAIL'}")
PY
)
    read -r rel ok <<< "$verdict"
    [ "$ok" = PASS ] || status=1
    rows+=("$(printf '| %-8s | %2s | %.9f | %.9f | %s | %s (%s) | %s (%s) | %s | %s | %s |' "$fam" "$shards" "$ours" "$theirs" \
        "$rel" "$wdiff" "$wname" "$floor" "$fname" "$class" "$exported" "$ok")")
done
echo
echo "| family | shards (bf16) | pipewright eval | transformers f64 | rel. diff | weights after $STEPS AdamW steps: max rel. diff (tensor) | PyTorch f32 vs f64, the same steps | run opens as | bf16 export opens as | |"
echo "|---|---|---|---|---|---|---|---|---|---|"
printf '%s\n' "${rows[@]}"
exit $status
