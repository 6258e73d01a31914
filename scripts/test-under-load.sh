#!/usr/bin/env bash
# `cargo test` (the README's test command) ROUNDS times in a row with BUSY
# busy loops beside it, as a busy laptop or a shared CI box would have them:
# the suite must pass every time. The loops are plain shell spins (one core
# each, nothing to wait on), started before the first round and killed on
# exit; the test binaries are built once first (untimed, without the loops),
# so each round measures the tests, not the compiler.
#
# Prints one line per round (exit status, seconds, load average before and
# after) and a table last; exits non-zero if any round failed. Each round's
# whole output is kept in OUT_DIR (default: a new temporary folder).
#
#   scripts/test-under-load.sh [ROUNDS] [OUT_DIR]      (ROUNDS default 3; BUSY=2)
set -uo pipefail
cd "$(dirname "$0")/.."
rounds="${1:-3}"
out="${2:-$(mktemp -d "${TMPDIR:-/tmp}/pw-test-under-load.XXXXXX")}"
busy="${BUSY:-2}"
[[ "$rounds" =~ ^[1-9][0-9]*$ ]] || { echo "test-under-load: ROUNDS must be a positive number, not '$rounds'" >&2; exit 2; }
[[ "$busy" =~ ^[0-9]+$ ]] || { echo "test-under-load: BUSY must be a number, not '$busy'" >&2; exit 2; }
mkdir -p "$out"

echo "test-under-load: building the tests first (no loops yet)"
cargo test --no-run >"$out/build.log" 2>&1 || { tail -n 30 "$out/build.log"; echo "test-under-load: the build failed" >&2; exit 1; }

pids=()
stop_loops() { [ ${#pids[@]} -gt 0 ] && kill "${pids[@]}" 2>/dev/null; }
trap stop_loops EXIT
for _ in $(seq "$busy"); do
    (while :; do :; done) &
    pids+=($!)
done
echo "test-under-load: $busy busy loops (pids ${pids[*]}) beside $rounds rounds of cargo test on $(nproc) cores"

rows=()
failed=0
for r in $(seq "$rounds"); do
    before=$(cut -d' ' -f1 /proc/loadavg)
    t0=$(date +%s)
    cargo test >"$out/round-$r.log" 2>&1
    rc=$?
    secs=$(( $(date +%s) - t0 ))
    after=$(cut -d' ' -f1 /proc/loadavg)
    binaries=$(grep -c '^test result:' "$out/round-$r.log")
    status=$([ $rc = 0 ] && echo pass || echo FAIL)
    [ $rc = 0 ] || failed=1
    rows+=("$(printf '%5s  %-4s  %6s s  %3s test binaries  load %s -> %s' "$r" "$status" "$secs" "$binaries" "$before" "$after")")
    echo "round $r: $status in $secs s (load $before -> $after)"
    if [ $rc != 0 ]; then
        grep -E '^test .* FAILED|panicked|^error' "$out/round-$r.log" | head -n 20
    fi
done

echo
echo "cargo test beside $busy busy loops, $rounds rounds, $(nproc) cores (logs in $out)"
echo "round status   time     binaries               load average"
printf '%s\n' "${rows[@]}"
exit $failed
