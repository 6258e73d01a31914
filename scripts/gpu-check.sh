#!/usr/bin/env bash
# On a GPU machine with the CUDA driver but no Rust: checks every CUDA kernel
# against its CPU twin (f32 and bf16) and their bit-identical repeats, using
# only the release binary built elsewhere with
#     cargo build --release --features cuda
# NVRTC and cuBLASLt must be loadable: from a CUDA toolkit on the library
# path, or from pip's NVIDIA wheels, which this script finds.
#
# usage: scripts/gpu-check.sh [path/to/pipewright] [gpu ordinal]
set -euo pipefail
BIN="${1:-target/release/pipewright}"
DEVICE="${2:-0}"
[ -x "$BIN" ] || { echo "no executable at $BIN: build it with cargo build --release --features cuda" >&2; exit 1; }
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader

# NVRTC and cuBLASLt from pip's NVIDIA wheels (PyTorch brings both for CUDA 12;
# nvidia-cuda-nvrtc 13.0.x puts NVRTC under nvidia/cu13/lib), ahead of the path.
libs=$(python3 - <<'PY' 2>/dev/null || true
import glob, os, site
dirs = []
for base in site.getsitepackages() + [site.getusersitepackages()]:
    for d in sorted(glob.glob(os.path.join(base, "nvidia", "*", "lib"))):
        if glob.glob(os.path.join(d, "libnvrtc.so.*")) or glob.glob(os.path.join(d, "libcublasLt.so.*")):
            dirs.append(d)
print(":".join(dirs))
PY
)
[ -n "$libs" ] && export LD_LIBRARY_PATH="$libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
echo "LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}"

echo "== kernels against their CPU twins, GPU $DEVICE"
"$BIN" gpu-check --device "$DEVICE"
