#!/usr/bin/env bash
# Both device phases in one go, on a GPU machine with no time limit per
# command (a device-tool session runs them as two commands: docs/gpu.md):
# scripts/gpu-device.sh check, then bench, into OUTDIR, and one summary.json
# merging the two (commit, device, gpu_check_passed, gpu_pipeline_bits_match,
# pipewright_mfu, ratio_tokens_per_s, ...).
#
# usage: scripts/gpu-check.sh [path/to/pipewright] [gpu ordinal] [outdir]
# env:   BENCH_STEPS (default 20), PIPEWRIGHT_COMMIT (when not run in the git checkout)
set -uo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
export PIPEWRIGHT_BIN="${1:-target/release/pipewright}"
export GPU="${2:-0}"
OUTDIR="${3:-gpu-figures/$(date -u +%Y%m%dT%H%M%SZ)}"
mkdir -p "$OUTDIR"
"$HERE/gpu-device.sh" check "$OUTDIR"
check_rc=$?
"$HERE/gpu-device.sh" bench "$OUTDIR"
bench_rc=$?
python3 - "$OUTDIR" <<'PY'
import json, sys
out = sys.argv[1]
merged = {}
for phase in ("check", "bench"):
    try:
        s = json.load(open(f"{out}/{phase}-summary.json"))
    except (OSError, ValueError):
        continue
    s.pop("phase", None)
    s[phase + "_passed"] = s.pop("passed", False)
    merged.update(s)
json.dump(merged, open(f"{out}/summary.json", "w"), indent=1)
PY
cat "$OUTDIR/check-summary.txt" "$OUTDIR/bench-summary.txt" 2>/dev/null
[ "$check_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
