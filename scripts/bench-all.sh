#!/usr/bin/env bash
# Every figure docs/benchmarks.md quotes, measured in one go on this machine:
# CPU throughput and kernel shares, pipeline sizes and message latency, the
# sim backend's bubble table, tracing and checkpoint costs, the default run.
# Usage: scripts/bench-all.sh [OUT_DIR]   (PyTorch side by side: scripts/bench_vs_torch.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-runs/bench-all}
mkdir -p "$out"
cargo build --release -q
bin=target/release/pipewright
echo "== commit $(git rev-parse --short HEAD), $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2)"

echo "== CPU bench (configs/bench-cpu.toml), pipeline sizes, message latency"
$bin bench --config configs/bench-cpu.toml --steps 20 --pp 1,2,4 --json 2>/dev/null | tee "$out/bench.txt"

echo "== sim backend: measured vs theoretical bubble and runtime overhead (1F1B, then GPipe)"
$bin bench --sim --schedule 1f1b --plot "$out/sim-1f1b.svg" 2>/dev/null | tee "$out/sim-1f1b.txt"
$bin bench --sim --schedule gpipe --plot "$out/sim-gpipe.svg" 2>/dev/null | tee "$out/sim-gpipe.txt"

echo "== tracing and replay recording cost: the default model, with and without the flag, alternated"
scripts/bench-overhead.sh "$out/overhead" "$bin"

echo "== checkpoint pause, write and load, and the write's cost to training (bench-cpu model)"
scripts/bench-checkpoint.sh "$out/ckpt" "$bin"

echo "== the default run (embedded config)"
start=$SECONDS
$bin train --out "$out/default" --force 2>&1 | grep -E "^done" || true
echo "  wall $((SECONDS - start)) s (setup, training, evaluations and writing outputs)"
