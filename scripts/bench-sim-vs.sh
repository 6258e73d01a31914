#!/usr/bin/env bash
# The actor runtime's overhead on the sim backend (`bench --sim`: sleeping
# stages, real actors and messages) of two binaries side by side, the order
# flipped every round so drifting load hits both alike. Prints each run's
# overhead per cell, the medians, and the load average around each run.
# Usage: scripts/bench-sim-vs.sh OLD_BINARY NEW_BINARY [CELLS]
#        (CELLS default 8x32,32x32; ROUNDS=3; SCHEDULE=1f1b)
set -euo pipefail
old=$1 new=$2 cells=${3:-8x32,32x32}
rounds=${ROUNDS:-3}
schedule=${SCHEDULE:-1f1b}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
run() { # run BIN OUT_JSON
    local before
    before=$(cut -d' ' -f1 /proc/loadavg)
    (cd "$work" && "$1" bench --sim --schedule "$schedule" --cells "$cells" --json --plot "$work/p.svg" 2>/dev/null) \
        | tail -n 1 >"$2"
    echo "$before/$(cut -d' ' -f1 /proc/loadavg)" >"$2.load"
}
echo "== $(nproc) cores; $schedule; cells $cells; $rounds rounds; old: $old; new: $new"
for r in $(seq "$rounds"); do
    if [ $((r % 2)) = 1 ]; then
        run "$old" "$work/old-$r.json"; run "$new" "$work/new-$r.json"
    else
        run "$new" "$work/new-$r.json"; run "$old" "$work/old-$r.json"
    fi
done
python3 - "$work" "$rounds" <<'PY'
import json, statistics, sys
work, rounds = sys.argv[1], int(sys.argv[2])
def rows(side, r):
    return {(c["pp"], c["microbatches"]): c for c in json.load(open(f"{work}/{side}-{r}.json"))}
runs = {s: [rows(s, r) for r in range(1, rounds + 1)] for s in ("old", "new")}
loads = {s: [open(f"{work}/{s}-{r}.json.load").read().strip() for r in range(1, rounds + 1)] for s in ("old", "new")}
print("| pp | m | old overhead (runs) | old median | new overhead (runs) | new median | new − old |")
print("|---|---|---|---|---|---|---|")
for cell in sorted(runs["old"][0]):
    o = [x[cell]["overhead"] * 100 for x in runs["old"]]
    n = [x[cell]["overhead"] * 100 for x in runs["new"]]
    fmt = lambda v: ", ".join(f"{x:.2f}%" for x in v)
    mo, mn = statistics.median(o), statistics.median(n)
    print(f"| {cell[0]} | {cell[1]} | {fmt(o)} | {mo:.2f}% | {fmt(n)} | {mn:.2f}% | {mn - mo:+.2f} |")
print(f"\nload (1 min) before/after each run: old {', '.join(loads['old'])}; new {', '.join(loads['new'])}")
PY
