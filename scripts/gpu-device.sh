#!/usr/bin/env bash
# The device side of a GPU session, from .gpu-pack/ (scripts/gpu-pack.sh made
# it): no Rust, no .git; the CUDA driver, PyTorch and NVIDIA's pip wheels.
# A device-tool session has 15 minutes of device time in all (the machine's
# start, idle waits and every call counted) and 10 minutes a command, so the
# playbook is ONE call of the phase `first` (docs/gpu.md):
#   first   the most valuable figures first, inside one budget (BUDGET_S,
#           default 510 s; every step's limit is cut to what is left, and a
#           step that would start with under 20 s left is skipped, saying so):
#           gpu-bench GPT-2 124M and its Llama twin (MFU, tokens/s), the
#           pipeline runs whose bits must agree (pp 1 against pp 2, f32 and
#           bf16, GPT-2 and Llama), gpu-check whole, PyTorch eager, then
#           torch.compile, the tensor-parallel and GPipe runs, the blocking
#           re-runs of failed groups, as long as time is left.
# On a machine without those limits (scripts/gpu-check.sh) two phases:
#   check   gpu-check (every kernel against its CPU twin, whole steps, repeats),
#           re-running what failed with CUDA_LAUNCH_BLOCKING=1 and cuBLASLt's
#           log; then training through the actor runtime, pp = 1 against pp = 2
#           (1F1B, GPipe; f32, bf16) on one GPU, and tp = 2 (both ranks taking
#           turns on this GPU) against tp = 1 over the same 2 slices, and a
#           Llama at pp = 2 and tp = 2 likewise: the weights must match.
#   bench   gpu-bench (GPT-2 124M, bf16, T = 1024), then PyTorch on the same
#           micro-batch, eager and torch.compile; then gpu-bench of a Llama
#           of the same width and depth.
# Everything is written under /tmp/pw-gpu/PHASE (PW_GPU_WORK replaces /tmp/pw-gpu); $OUT (or the 2nd argument)
# receives three files: PHASE.tar.gz (all of it), PHASE-summary.json and
# PHASE-summary.txt, the table that is also printed last. A failing step is
# recorded in the summary and the phase goes on: what passed is never lost.
#
# usage: scripts/gpu-device.sh first|check|bench [outdir]
# env:   BUDGET_S (seconds for the whole phase: default 510 for first, none for
#        check and bench), BENCH_STEPS (default 20), GPU (ordinal, default 0), PIPEWRIGHT_BIN (a
#        binary other than .gpu-pack/pipewright), PIPEWRIGHT_COMMIT
set -uo pipefail
PHASE="${1:?usage: gpu-device.sh first|check|bench [outdir]}"
DEST="${2:-${OUT:?set OUT or pass an output directory}}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PACK="$ROOT/.gpu-pack"
[ -f "$ROOT/COMMIT" ] && PACK="$ROOT" # run from inside the pack itself
BIN="${PIPEWRIGHT_BIN:-$PACK/pipewright}"
GPU="${GPU:-0}"
STEPS="${BENCH_STEPS:-20}"
WORKROOT="${PW_GPU_WORK:-/tmp/pw-gpu}"
WORK="$WORKROOT/$PHASE"
STARTED=$(date +%s)
if [ "$PHASE" = first ]; then BUDGET="${BUDGET_S:-510}"; else BUDGET="${BUDGET_S:-}"; fi
rm -rf "$WORK" && mkdir -p "$WORK" "$DEST"
[ -x "$BIN" ] || { echo "gpu-device: no binary at $BIN: run scripts/gpu-pack.sh and carry .gpu-pack" >&2; exit 2; }
BIN="$(cd "$(dirname "$BIN")" && pwd)/$(basename "$BIN")"
COMMIT="${PIPEWRIGHT_COMMIT:-$(cat "$PACK/COMMIT" 2>/dev/null || git -C "$ROOT" rev-parse HEAD 2>/dev/null || echo unknown)}"
export PIPEWRIGHT_KERNEL_CACHE="$WORKROOT/kernel-cache"

# NVRTC, cuBLASLt and NCCL from pip's NVIDIA wheels (nvidia/*/lib, nvidia/cu13/lib),
# ahead of the path; the binary also looks for libnccl.so.2 there by itself.
libs=$(python3 - <<'PY' 2>/dev/null || true
import glob, os, site
dirs = []
for base in site.getsitepackages() + [site.getusersitepackages()]:
    for d in sorted(glob.glob(os.path.join(base, "nvidia", "*", "lib"))):
        if glob.glob(os.path.join(d, "lib*.so*")):
            dirs.append(d)
print(":".join(dirs))
PY
)
[ -n "$libs" ] && export LD_LIBRARY_PATH="$libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
{
    echo "commit $COMMIT"
    date -u +%Y-%m-%dT%H:%M:%SZ
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1
    python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)' 2>&1
    echo "LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}"
} >"$WORK/machine.txt"
cat "$WORK/machine.txt"

# Runs "$@" with a time limit, output to $WORK/$name.txt (and the terminal's tail).
# Under a budget the limit is cut to what is left of it, and a step that would
# start with under 20 s left is skipped (exit status 125, "skipped" in its file).
step() {
    local name="$1" limit="$2"
    shift 2
    if [ -n "$BUDGET" ]; then
        local left=$((STARTED + BUDGET - $(date +%s)))
        if [ "$left" -lt 20 ]; then
            echo "== $name: skipped, ${left}s of the ${BUDGET}s budget left" | tee "$WORK/$name.txt"
            echo 125 >"$WORK/$name.rc"
            return 125
        fi
        [ "$left" -lt "$limit" ] && limit="$left"
    fi
    echo "== $name (limit ${limit}s, at $(($(date +%s) - STARTED))s)"
    timeout --kill-after=10 "$limit" "$@" >"$WORK/$name.txt" 2>&1
    local rc=$?
    tail -n 40 "$WORK/$name.txt"
    [ "$rc" -eq 124 ] && echo "$name: stopped after ${limit}s" | tee -a "$WORK/$name.txt"
    echo "$rc" >"$WORK/$name.rc"
    return "$rc"
}

gpu_check() {
    step gpu-check 240 "$BIN" gpu-check --device "$GPU"
}

# Each group that failed (or was running when the binary stopped) again,
# with launches synchronous (an error names the launch that made it) and
# cuBLASLt's log of every call and heuristic.
gpu_check_blocking() {
    [ "$(cat "$WORK/gpu-check.rc" 2>/dev/null)" = 0 ] && return 0
    [ -f "$WORK/gpu-check.txt" ] || return 0
    local groups g
    groups=$( (grep '^FAIL' "$WORK/gpu-check.txt" | sed 's/^FAIL \[\([a-z_]*\)\].*/\1/'
               grep '^-- group ' "$WORK/gpu-check.txt" | tail -n 1 | cut -d' ' -f3) | sort -u)
    for g in $groups; do
        CUDA_LAUNCH_BLOCKING=1 CUBLASLT_LOG_LEVEL=5 CUBLASLT_LOG_FILE="$WORK/cublaslt-$g.log" \
            step "gpu-check-$g-blocking" 120 "$BIN" gpu-check --device "$GPU" --only "$g"
    done
}

# Training through the actor runtime on one GPU: a small model with head size 64,
# random tokens; pp = 1 unless a run says otherwise (the default config's is 2,
# which left the tp runs' one-entry device lists refused until the emulated GPU
# ran this). Each run appends "DTYPE KEY DIGEST" to pipeline.txt.
SMALL=(--set model.n_layer=4 --set model.n_embd=128 --set model.n_head=2 --set model.vocab_size=256
    --set model.block_size=64 --set train.micro_batch_size=4 --set train.eval_every=0 --set parallel.pp=1
    --set 'data.builtin="random"' --set parallel.microbatches=4 --set 'backend.kind="cuda"' --steps 10 --force)
LLAMA=(--set 'model.family="llama"' --set model.intermediate_size=192)
# layout DTYPE NAME KEY RANKS SETS...: one run on RANKS ranks of this GPU.
layout() {
    local dtype="$1" name="$2" key="$3" devs
    devs="[$(printf "$GPU,%.0s" $(seq "$4") | sed 's/,$//')]"
    shift 4
    step "$name" 120 "$BIN" train "${SMALL[@]}" --set "backend.dtype=\"$dtype\"" --set "backend.devices=$devs" \
        "$@" --out "$WORK/$name" >/dev/null
    [ "$(cat "$WORK/$name.rc")" = 125 ] && return # skipped: no digest, "not run" in the summary
    echo "$dtype $key $(digest_of "$WORK/$name")" >>"$WORK/pipeline.txt"
}

# pp = 1 against pp = 2 (1F1B), GPT-2 and a Llama (SwiGLU, RoPE, untied head; two
# query heads sharing one key/value head), f32 and bf16: the bits that must agree.
pipeline_core() {
    local dtype n
    for dtype in f32 bf16; do
        for n in 1 2; do
            layout "$dtype" "train-$dtype-pp$n-1f1b" "pp$n-1f1b" "$n" --set "parallel.pp=$n" --set 'parallel.schedule="1f1b"'
            layout "$dtype" "train-llama-$dtype-pp$n" "llama-pp$n" "$n" "${LLAMA[@]}" --set model.n_kv_head=1 \
                --set "parallel.pp=$n"
        done
    done
}

# GPipe at pp = 2, and tensor parallelism with both ranks taking turns on this
# GPU: tp 2 against tp 1 over the same 2 slices (the Llama's rank holds whole
# key/value groups: one each).
pipeline_rest() {
    local dtype tp
    for dtype in f32 bf16; do
        layout "$dtype" "train-$dtype-pp2-gpipe" "pp2-gpipe" 2 --set parallel.pp=2 --set 'parallel.schedule="gpipe"'
        for tp in 1 2; do
            layout "$dtype" "train-$dtype-tp$tp" "tp$tp-s2" "$tp" --set parallel.tp="$tp" --set parallel.tp_slices=2
            layout "$dtype" "train-llama-$dtype-tp$tp" "llama-tp$tp-s2" "$tp" "${LLAMA[@]}" --set model.n_kv_head=2 \
                --set parallel.tp="$tp" --set parallel.tp_slices=2
        done
    done
}

digest_of() {
    python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["weights_digest"])' "$1/summary.json" 2>/dev/null \
        || echo FAILED
}

# GPT-2 124M in bf16 at T = 1024 (gpu-bench picks the micro-batch), and a Llama
# of its width and depth (12 query heads over 4 key/value heads, SwiGLU of 2048,
# Llama 2's 32000-token vocabulary, untied): what the family seam costs.
bench_pipewright() {
    step gpu-bench 200 "$BIN" gpu-bench --device "$GPU" --steps "$STEPS" --json
    step gpu-bench-llama 60 "$BIN" gpu-bench --device "$GPU" --steps 10 --warmup 2 --json --family llama \
        --layers 12 --embd 768 --heads 12 --kv-heads 4 --ffn 2048 --vocab 32000 --seq 1024
}

# PyTorch on gpu-bench's micro-batch: eager, or torch.compile (minutes of compiling).
bench_torch() {
    local mode="$1" limit="$2" mb mbarg=() extra=()
    mb=$(grep '^{' "$WORK/gpu-bench.txt" 2>/dev/null | tail -n 1 \
        | python3 -c 'import json,sys; print(json.load(sys.stdin)["micro_batch"])' 2>/dev/null)
    [ -n "$mb" ] && mbarg=(--micro-batch "$mb")
    [ "$mode" = eager ] && extra=(--no-compile)
    CUDA_VISIBLE_DEVICES="$GPU" step "torch-$mode" "$limit" python3 "$ROOT/scripts/torch_gpu_bench.py" "${mbarg[@]}" \
        --steps "$STEPS" "${extra[@]}" --json
}

: >"$WORK/pipeline.txt"
case "$PHASE" in
first)
    bench_pipewright
    pipeline_core
    gpu_check
    bench_torch eager 100
    bench_torch compile 220
    pipeline_rest
    gpu_check_blocking
    ;;
check)
    gpu_check
    gpu_check_blocking
    pipeline_core
    pipeline_rest
    ;;
bench)
    bench_pipewright
    bench_torch eager 100
    bench_torch compile 220
    ;;
*) echo "gpu-device: unknown phase $PHASE (first, check or bench)" >&2; exit 2 ;;
esac
cat "$WORK/pipeline.txt"

python3 "$ROOT/scripts/gpu_summary.py" "$PHASE" "$WORK" "$COMMIT" "$DEST/$PHASE-summary.json" "$DEST/$PHASE-summary.txt"
rc=$?
tar czf "$DEST/$PHASE.tar.gz" -C "$WORKROOT" "$PHASE"
echo "== $PHASE summary (commit $COMMIT)"
cat "$DEST/$PHASE-summary.txt"
exit "$rc"
