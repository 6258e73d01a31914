#!/usr/bin/env bash
# GPU data parallelism gives dp 1's bits: trains a small model on the CUDA
# backend at dp 1 (one GPU, 4 microbatches) and dp 2 (two GPUs, 2
# microbatches each: the same global batch) in one process (`train`) and in
# two (`launch --nodes 2`), in f32 and bf16, and exits non-zero unless every
# dp 2 run's summary.json `weights_digest` is its dtype's dp 1 digest.
# Both sum their gradients by the one fixed tree over the global microbatch
# index (optim::grad_tree), so any difference is a bug.
#
#   scripts/emulated-gpu.sh --gpus 2 scripts/emulated-gpu-dp.sh [OUT_DIR]
#
# With --gpus 4, also f32 at pp 2 × dp 2 (against dp 1) and tp 2 × dp 2
# (against tp 1 × dp 1 with the same parallel.tp_slices = 2, which sets the bits).
#
# ZeRO-1 is not checked: the config refuses parallel.zero on the cuda backend.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
target="${CARGO_TARGET_DIR:-$root/target}"
bin="$target/release/pipewright"

if [ "${PW_EMU_GPUS:-0}" -lt 2 ]; then
    echo "emulated-gpu-dp.sh: needs two emulated GPUs: run it as scripts/emulated-gpu.sh --gpus 2 $0" >&2
    exit 2
fi
echo "emulated-gpu-dp.sh: building pipewright with --features cuda" >&2
(cd "$root" && cargo build --release --quiet --features cuda --bin pipewright)

out="${1:-$(mktemp -d "${TMPDIR:-/tmp}/emulated-gpu-dp.XXXXXX")}"
mkdir -p "$out"

# run DTYPE DP PROCESSES [NAME SETS...]: one training run (pp 1 unless SETS
# say otherwise), its digest on stdout.
run() {
    local dtype="$1" dp="$2" procs="$3" devices="[0]"
    [ "$dp" = 2 ] && devices="[0,1]"
    local dir="$out/$dtype-dp$dp-p$procs" how=(train)
    [ "$procs" = 1 ] || how=(launch --nodes "$procs")
    shift 3
    if [ $# -gt 0 ]; then
        dir="$out/$1"
        devices="[0,1,2,3]"
        shift
    fi
    if ! "$bin" "${how[@]}" --set model.n_layer=2 --set model.n_embd=128 --set model.n_head=2 \
        --set model.vocab_size=256 --set model.block_size=64 --set train.micro_batch_size=4 \
        --set train.eval_every=0 --set 'data.builtin="random"' --set 'backend.kind="cuda"' \
        --set "backend.dtype=\"$dtype\"" --set parallel.pp=1 --set "parallel.dp=$dp" \
        --set "parallel.microbatches=$((4 / dp))" --set "backend.devices=$devices" "$@" \
        --steps 3 --out "$dir" --force >"$dir.log" 2>&1; then
        echo "emulated-gpu-dp.sh: $dtype dp $dp over $procs process(es) failed; its log, $dir.log, ends:" >&2
        tail -n 20 "$dir.log" >&2
        return 1
    fi
    sed -n 's/.*"weights_digest": *"\([0-9a-f]*\)".*/\1/p' "$dir/summary.json"
}

status=0
rows=()
for dtype in f32 bf16; do
    one="$(run "$dtype" 1 1)" || { status=1; continue; }
    two="$(run "$dtype" 2 1)" || { status=1; continue; }
    apart="$(run "$dtype" 2 2)" || { status=1; continue; }
    if [ -z "$one" ] || [ -z "$two" ] || [ -z "$apart" ]; then
        echo "emulated-gpu-dp.sh: $dtype: a summary.json under $out has no weights_digest" >&2
        status=1
        continue
    fi
    verdict=same
    [ "$one" = "$two" ] && [ "$one" = "$apart" ] || { verdict=DIFFERENT; status=1; }
    rows+=("$(printf '%-5s %-16s %-16s %-16s %s' "$dtype" "${one:0:16}" "${two:0:16}" "${apart:0:16}" "$verdict")")
done

printf '%-5s %-16s %-16s %-16s %s\n' dtype "dp 1" "dp 2" "dp 2, 2 procs" verdict
printf '%s\n' "${rows[@]}"

# pair NAME WANT GOT: one row of the four-GPU checks.
pair() {
    local verdict=same
    if [ -z "$2" ] || [ "$2" != "$3" ]; then
        verdict=DIFFERENT
        status=1
    fi
    printf '%-24s %-16s %-16s %s\n' "$1" "${2:0:16}" "${3:0:16}" "$verdict"
}
if [ "$PW_EMU_GPUS" -ge 4 ]; then
    printf '%-24s %-16s %-16s %s\n' "f32, 4 GPUs" "dp 1" "dp 2" verdict
    want="$(run f32 1 1 pp1-dp1 --set parallel.pp=1 --set 'backend.devices=[0]')" || status=1
    got="$(run f32 2 1 pp2-dp2 --set parallel.pp=2)" || status=1
    pair "pp 2 × dp 2" "$want" "$got"
    slices=(--set parallel.pp=1 --set parallel.tp_slices=2)
    want="$(run f32 1 1 tp1-dp1 "${slices[@]}" --set parallel.tp=1 --set 'backend.devices=[0]')" || status=1
    got="$(run f32 2 1 tp2-dp2 "${slices[@]}" --set parallel.tp=2)" || status=1
    pair "tp 2 × dp 2 (2 slices)" "$want" "$got"
else
    echo "pp 2 × dp 2 and tp 2 × dp 2: not checked (they need --gpus 4)"
fi
echo "zero-1: not checked (parallel.zero = 1 runs on the CPU backend only)"
echo "runs and logs: $out"
exit "$status"
