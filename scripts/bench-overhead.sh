#!/usr/bin/env bash
# What tracing (--trace) and digest-only replay recording (--record) cost in
# tokens/s, on the default model (pp = 2, 1F1B): PAIRS pairs of runs with and
# without the flag, the order flipped every pair so drifting load hits both
# sides alike. Prints a table per flag: tokens/s of each run, the pair's
# difference, the median difference, and the load average around each pair.
# Usage: scripts/bench-overhead.sh [OUT_DIR] [BINARY]   (PAIRS=5, STEPS=200)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-runs/bench-overhead}
bin=${2:-target/release/pipewright}
pairs=${PAIRS:-5}
steps=${STEPS:-200}
mkdir -p "$out"
tps() { python3 -c "import json,sys; print(round(json.load(open(sys.argv[1]))['tokens_per_s']))" "$1/summary.json"; }
run() { # run DIR [FLAG]
    $bin train --steps "$steps" --out "$1" --force ${2:-} --set train.eval_every=0 --set checkpoint.every=0 \
        >/dev/null 2>&1
    tps "$1"
}
echo "== commit $(git rev-parse --short HEAD), $(nproc) cores, $steps steps a run, $pairs pairs a flag"
for flag in --trace --record; do
    echo
    echo "| pair | without $flag, tokens/s | with $flag, tokens/s | with vs without | load (1 min) before / after |"
    echo "|---|---|---|---|---|"
    diffs=()
    for p in $(seq "$pairs"); do
        before=$(cut -d' ' -f1 /proc/loadavg)
        if [ $((p % 2)) = 1 ]; then
            a=$(run "$out/without$flag-$p"); b=$(run "$out/with$flag-$p" "$flag")
        else
            b=$(run "$out/with$flag-$p" "$flag"); a=$(run "$out/without$flag-$p")
        fi
        d=$(python3 -c "import sys; a, b = map(float, sys.argv[1:]); print(f'{100 * (b / a - 1):+.1f}%')" "$a" "$b")
        diffs+=("$d")
        echo "| $p | $a | $b | $d | $before / $(cut -d' ' -f1 /proc/loadavg) |"
    done
    python3 - "${diffs[@]}" <<'EOF'
import statistics, sys
v = [float(x.rstrip('%')) for x in sys.argv[1:]]
print(f"\nmedian difference {statistics.median(v):+.1f}%, spread {min(v):+.1f}% to {max(v):+.1f}%")
EOF
done
