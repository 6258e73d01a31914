#!/usr/bin/env bash
# Checkpoint costs on configs/bench-cpu.toml, as docs/benchmarks.md quotes them:
# the pause training takes while stages copy their state and the background
# write (medians over the 20 checkpoints of a run with checkpoint.every=1), the
# read-and-verify on resume (median of 5), and what the background write costs
# training on a small machine (train time with checkpoint.every=1 against none,
# alternated so drifting load hits both alike).
# Usage: scripts/bench-checkpoint.sh [OUT_DIR] [BINARY]   (ROUNDS=3 by default)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-runs/bench-checkpoint}
bin=${2:-target/release/pipewright}
rounds=${ROUNDS:-3}
mkdir -p "$out"
field() { python3 -c "import json,sys; v = json.load(open(sys.argv[1]))[sys.argv[2]]; print(round(v, 1) if isinstance(v, float) else v)" "$1" "$2"; }
echo "== commit $(git rev-parse --short HEAD), $(nproc) cores, load average $(cut -d' ' -f1-3 /proc/loadavg)"
for r in $(seq "$rounds"); do
    for every in 0 1; do
        run="$out/every$every-$r"
        $bin train --config configs/bench-cpu.toml --steps 20 --out "$run" --force \
            --set checkpoint.every=$every 2>/dev/null
        line="round $r, checkpoint.every=$every: train $(field "$run/summary.json" train_seconds) s"
        if [ "$every" = 1 ]; then
            line+=", $(field "$run/summary.json" checkpoints_written) checkpoints"
            line+=", pause median $(field "$run/summary.json" checkpoint_pause_ms_median) ms"
            line+=", write median $(field "$run/summary.json" checkpoint_write_ms_median) ms"
        fi
        echo "$line (load $(cut -d' ' -f1 /proc/loadavg))"
    done
done
echo "== load on resume (read and verify step 20 of the last run), 5 times"
for i in 1 2 3 4 5; do
    $bin train --config configs/bench-cpu.toml --steps 20 --resume "$out/every1-$rounds" 2>&1 \
        | grep -oE "read and verified in [0-9.]+ ms"
done
