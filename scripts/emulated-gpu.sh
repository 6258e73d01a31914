#!/usr/bin/env bash
# Runs a command on emulated GPUs: pipewright-emu's stand-ins for libcuda,
# NVRTC, cuBLASLt and NCCL (emu/, one shared object) first on the library
# path, so the CUDA backend runs unmodified on the CPU. Nothing else ever
# loads them: a normal run finds the real libraries or none.
#
#   scripts/emulated-gpu.sh [--gpus N] [--check-order] CMD ARGS...
#
# CMD `pipewright` means this checkout's binary built with --features cuda
# (built here if needed); any other CMD runs as given (cargo test ...).
# --gpus N: N emulated GPUs (default 1), each with its own address range.
# --check-order: every launch runs twice with its threads scheduled in two
#   orders and must give the same bits (finds a missing barrier; slow).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"

gpus=1
check=""
while [ $# -gt 0 ]; do
    case "$1" in
        --gpus) [ $# -ge 2 ] || { echo "emulated-gpu.sh: --gpus needs a number" >&2; exit 2; }
                gpus="$2"; shift 2 ;;
        --gpus=*) gpus="${1#--gpus=}"; shift ;;
        --check-order) check="order"; shift ;;
        --) shift; break ;;
        -*) echo "emulated-gpu.sh: unknown option $1 (usage: emulated-gpu.sh [--gpus N] [--check-order] CMD ARGS...)" >&2; exit 2 ;;
        *) break ;;
    esac
done
if ! [[ "$gpus" =~ ^[1-9][0-9]?$ ]]; then
    echo "emulated-gpu.sh: --gpus $gpus: expected a number of GPUs from 1 to 99" >&2
    exit 2
fi
if [ $# -eq 0 ]; then
    echo "usage: scripts/emulated-gpu.sh [--gpus N] [--check-order] CMD ARGS..." >&2
    exit 2
fi

target="${CARGO_TARGET_DIR:-$root/target}"
libdir="$target/emu-gpu/lib"
echo "emulated-gpu.sh: building the stand-ins (cargo build --release -p pipewright-emu)" >&2
(cd "$root" && cargo build --release --quiet -p pipewright-emu)
so="$target/release/libpipewright_emu.so"
[ -f "$so" ] || { echo "emulated-gpu.sh: $so was not built" >&2; exit 1; }
mkdir -p "$libdir"
# Every name the backend's loaders try, one file behind them all: the loader
# maps it once, so the four libraries share one state.
for name in libcuda.so libcuda.so.1 libnvrtc.so libnvrtc.so.13 libnvrtc.so.12 \
            libcublasLt.so libcublasLt.so.13 libcublasLt.so.12 libnccl.so.2 libnccl.so; do
    ln -sfn "$so" "$libdir/$name"
done

if [ "$1" = "pipewright" ]; then
    shift
    echo "emulated-gpu.sh: building pipewright with --features cuda (cargo build --release --features cuda)" >&2
    (cd "$root" && cargo build --release --quiet --features cuda --bin pipewright)
    set -- "$target/release/pipewright" "$@"
fi

export LD_LIBRARY_PATH="$libdir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export PIPEWRIGHT_NCCL_DIR="$libdir"
export PW_EMU_GPUS="$gpus"
# One session id for every process this command starts: emulated GPU k is
# the same device in each of them (two NCCL ranks on it are refused, as on
# real hardware).
export PW_EMU_SESSION="${PW_EMU_SESSION:-emu-$$-$(date +%s%N)}"
[ -n "$check" ] && export PW_EMU_CHECK="$check"
# Emulated "CUBINs" are host shared objects: kept apart from real ones, and per
# emulator build and per instrumenting check mode (bounds, blocks, warp build
# kernels differently), since an image made by another is refused at load.
if [ -z "${PIPEWRIGHT_KERNEL_CACHE:-}" ]; then
    build_modes=$(printf '%s\n' ${PW_EMU_CHECK:+${PW_EMU_CHECK//,/ }} | { grep -xE "bounds|blocks|warp" || true; } | sort -u | paste -sd+ -)
    emu_id=$(sha256sum "$so" | cut -c1-12)
    export PIPEWRIGHT_KERNEL_CACHE="$target/emu-gpu/kernel-cache/$emu_id${build_modes:+-$build_modes}"
fi
echo "emulated-gpu.sh: $gpus emulated GPU(s), session $PW_EMU_SESSION" >&2
exec "$@"
