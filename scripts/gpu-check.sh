#!/usr/bin/env bash
# On a GPU machine with the CUDA driver and PyTorch but no Rust, from the
# release binary alone (built elsewhere with cargo build --release --features cuda):
#   1. pipewright gpu-check: every CUDA kernel against its CPU twin (f32, bf16),
#      whole training steps GPU against CPU, bit-identical repeats;
#   2. pipewright gpu-bench: GPT-2 124M, bf16, the largest micro-batch that fits;
#   3. scripts/torch_gpu_bench.py: the same model in PyTorch at the same micro-batch;
#   (between 1 and 2) training through the actor runtime on the GPU, pp = 1
#      against pp = 2 on one GPU (1F1B, GPipe; f32 and bf16): the weights must match;
# then a table of both. Every output and figure is also written under OUTDIR
# (default gpu-figures/<UTC time>), with the commit in summary.json.
# NVRTC and cuBLASLt must be loadable: from a CUDA toolkit on the library
# path, or from pip's NVIDIA wheels, which this script finds.
#
# usage: scripts/gpu-check.sh [path/to/pipewright] [gpu ordinal] [outdir]
# env:   BENCH_STEPS (default 20), PIPEWRIGHT_COMMIT (when not run in the git checkout)
set -euo pipefail
BIN="${1:-target/release/pipewright}"
DEVICE="${2:-0}"
OUTDIR="${3:-gpu-figures/$(date -u +%Y%m%dT%H%M%SZ)}"
STEPS="${BENCH_STEPS:-20}"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
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

mkdir -p "$OUTDIR"
COMMIT="${PIPEWRIGHT_COMMIT:-$(git -C "$HERE" rev-parse HEAD 2>/dev/null || echo unknown)}"
{
    echo "commit $COMMIT"
    date -u +%Y-%m-%dT%H:%M:%SZ
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || true
} >"$OUTDIR/machine.txt"

echo "== kernels against their CPU twins and whole training steps, GPU $DEVICE"
check_rc=0
"$BIN" gpu-check --device "$DEVICE" 2>&1 | tee "$OUTDIR/gpu-check.txt" || check_rc=$?

echo "== training through the actor runtime on GPU $DEVICE: pp = 1 against pp = 2 (1F1B and GPipe) on one GPU"
# A small model with head size 64 (what the attention kernel takes), random tokens.
SMALL=(--set model.n_layer=4 --set model.n_embd=128 --set model.n_head=2 --set model.vocab_size=256
       --set model.block_size=64 --set train.micro_batch_size=4 --set train.eval_every=0
       --set 'data.builtin="random"' --set parallel.microbatches=4 --set 'backend.kind="cuda"'
       --set "backend.devices=[$DEVICE]" --steps 10 --force)
pipeline_rc=0
for dtype in f32 bf16; do
    for layout in "1 1f1b" "2 1f1b" "2 gpipe"; do
        set -- $layout
        run="$OUTDIR/train-$dtype-pp$1-$2"
        devs="[$(printf "$DEVICE,%.0s" $(seq "$1") | sed 's/,$//')]"
        "$BIN" train "${SMALL[@]}" --set "backend.dtype=\"$dtype\"" --set "parallel.pp=$1" \
            --set "parallel.schedule=\"$2\"" --set "backend.devices=$devs" --out "$run" \
            >"$run.log" 2>&1 || { pipeline_rc=1; echo "train $dtype pp=$1 $2 FAILED (see $run.log)"; continue; }
        echo "$dtype pp=$1 $2: $(python3 -c 'import json,sys; s=json.load(open(sys.argv[1])); print(s["weights_digest"][:16], "loss", round(s["final_loss"], 4), "tok/s", round(s["tokens_per_s"]))' "$run/summary.json")"
    done
    d1=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["weights_digest"])' "$OUTDIR/train-$dtype-pp1-1f1b/summary.json" 2>/dev/null || echo none)
    for l in pp2-1f1b pp2-gpipe; do
        d2=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["weights_digest"])' "$OUTDIR/train-$dtype-$l/summary.json" 2>/dev/null || echo other)
        if [ "$d1" = "$d2" ]; then echo "$dtype $l: same weights as pp=1, bit for bit"; else echo "$dtype $l: weights DIFFER from pp=1"; pipeline_rc=1; fi
    done
done | tee "$OUTDIR/gpu-pipeline.txt"
grep -q "DIFFER\|FAILED" "$OUTDIR/gpu-pipeline.txt" && pipeline_rc=1

echo "== pipewright gpu-bench (GPT-2 124M, bf16)"
"$BIN" gpu-bench --device "$DEVICE" --steps "$STEPS" --json 2>&1 | tee "$OUTDIR/gpu-bench.txt"
grep "^{" "$OUTDIR/gpu-bench.txt" | tail -n 1 >"$OUTDIR/gpu-bench.json" || true
MB=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["micro_batch"])' "$OUTDIR/gpu-bench.json")

echo "== PyTorch, the same model, micro-batch $MB"
torch_rc=0
CUDA_VISIBLE_DEVICES="$DEVICE" python3 "$HERE/torch_gpu_bench.py" --micro-batch "$MB" --steps "$STEPS" --json 2>&1 \
    | tee "$OUTDIR/torch-bench.txt" || torch_rc=$?
grep "^{" "$OUTDIR/torch-bench.txt" | tail -n 1 >"$OUTDIR/torch-bench.json" || true

python3 - "$OUTDIR" "$COMMIT" "$check_rc" "$pipeline_rc" <<'PY'
import json, sys
out, commit, check_rc, pipeline_rc = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
pw = json.load(open(f"{out}/gpu-bench.json"))
try:
    pt = json.load(open(f"{out}/torch-bench.json"))
except (ValueError, OSError):
    pt = None
summary = {
    "commit": commit,
    "gpu_check_passed": check_rc == 0,
    "gpu_pipeline_bits_match": pipeline_rc == 0,
    "device": pw["device"],
    "micro_batch": pw["micro_batch"],
    "pipewright_tokens_per_s": pw["tokens_per_s"],
    "pipewright_mfu": pw["mfu"],
    "pipewright_mfu_vs_matmul": pw["mfu_vs_matmul"],
    "pipewright_ms_per_step": pw["ms_per_step"],
    "matmul_tflops": pw["matmul_flops"] / 1e12,
    "pytorch_tokens_per_s": pt and pt["tokens_per_s"],
    "pytorch_mfu": pt and pt["mfu"],
    "pytorch_ms_per_step": pt and pt["ms_per_step"],
    "ratio_tokens_per_s": pt and pw["tokens_per_s"] / pt["tokens_per_s"],
}
json.dump(summary, open(f"{out}/summary.json", "w"), indent=1)
f = lambda x, fmt, unit="": "n/a" if x is None else format(x, fmt) + unit
rows = [
    ("commit", commit[:12]),
    ("gpu-check", "passed" if check_rc == 0 else "FAILED"),
    ("GPU pipeline pp=2 = pp=1", "bit for bit" if pipeline_rc == 0 else "NO (see gpu-pipeline.txt)"),
    ("device", pw["device"]),
    ("micro-batch x T", f'{pw["micro_batch"]} x {pw["seq"]}'),
    ("pipewright tokens/s", f(pw["tokens_per_s"], ".0f")),
    ("pipewright MFU (989 TF)", f(100 * pw["mfu"], ".1f", "%")),
    ("pipewright MFU (measured mm)", f(100 * pw["mfu_vs_matmul"], ".1f", "%")),
    ("PyTorch tokens/s", f(pt and pt["tokens_per_s"], ".0f")),
    ("PyTorch MFU (989 TF)", f(pt and 100 * pt["mfu"], ".1f", "%")),
    ("pipewright / PyTorch", f(summary["ratio_tokens_per_s"], ".3f")),
    ("cuBLASLt bf16 matmul TFLOP/s", f(summary["matmul_tflops"], ".1f")),
]
table = "\n".join(f"{k:<30} {v}" for k, v in rows)
open(f"{out}/summary.txt", "w").write(table + "\n")
print("== summary (also in " + out + "/summary.txt and summary.json)")
print(table)
PY
[ "$check_rc" -eq 0 ] || { echo "gpu-check FAILED (see $OUTDIR/gpu-check.txt)" >&2; exit 1; }
[ "$torch_rc" -eq 0 ] || { echo "the PyTorch bench failed (see $OUTDIR/torch-bench.txt)" >&2; exit 1; }
[ "$pipeline_rc" -eq 0 ] || { echo "GPU pipeline runs failed or differ (see $OUTDIR/gpu-pipeline.txt)" >&2; exit 1; }
