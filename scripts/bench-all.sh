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

echo "== tracing cost: the default model, 200 steps, with and without --trace"
for t in "" "--trace"; do
    $bin train --steps 200 --out "$out/trace-cost$t" --force $t --set train.eval_every=0 --set checkpoint.every=0 2>&1 \
        | grep -E "^done" | sed "s/^/  ${t:-no trace}: /"
done

echo "== replay recording cost: the default model, 200 steps, with and without --record, alternated"
for i in 1 2 3; do
    for r in "" "--record"; do
        $bin train --steps 200 --out "$out/record-cost$r" --force $r --set train.eval_every=0 --set checkpoint.every=0 2>&1 \
            | grep -E "^done" | sed "s/^/  ${r:-no record}: /"
    done
done

echo "== checkpoint pause, write and load, and the write's cost to training (bench-cpu model)"
scripts/bench-checkpoint.sh "$out/ckpt" "$bin"

echo "== the default run (embedded config)"
start=$SECONDS
$bin train --out "$out/default" --force 2>&1 | grep -E "^done" || true
echo "  wall $((SECONDS - start)) s (setup, training, evaluations and writing outputs)"
