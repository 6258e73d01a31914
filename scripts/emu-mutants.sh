#!/usr/bin/env bash
# The planted-bug campaign: for each mutant of scripts/emu-mutants.tsv (one
# edit of one kernel file), gpu-check runs the mutant's group on an emulated
# GPU with the bug planted through the NVRTC stand-in's compiler setting
# (PW_EMU_CXX = scripts/emu_mutant_cxx.py; the checkout is never edited), and
# the table says whether CI's emulated job catches it: a failed check, or the
# emulator naming an error. Each mutant gets fresh kernel caches, so no build
# of another mutant (or of the clean kernels) is reused.
#
# usage: scripts/emu-mutants.sh [--order] [ID ...]   (default: every mutant)
#   --order   also run each with PW_EMU_CHECK=order (CI's order-check job)
# env:   MUTANT_TIMEOUT_S (default 300), PIPEWRIGHT_BIN (default
#        target/release/pipewright, built with --features cuda)
# exit status: 0 when every mutant that was planted was caught, 1 otherwise.
set -uo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
order=""
if [ "${1:-}" = "--order" ]; then order="--check-order"; shift; fi
bin="${PIPEWRIGHT_BIN:-target/release/pipewright}"
[ -x "$bin" ] || { echo "emu-mutants: no binary at $bin: cargo build --release --features cuda --bin pipewright" >&2; exit 2; }
limit="${MUTANT_TIMEOUT_S:-300}"
work="$(mktemp -d "${TMPDIR:-/tmp}/pw-mutants.XXXXXX")"
trap 'rm -rf "$work"' EXIT
real_cxx="${PW_EMU_CXX:-$(command -v c++ || command -v g++)}"
wanted=" $* "
rows=()
missed=0
equivalent=0
while IFS=$'\t' read -r id group file nth from to what; do
    case "$id" in "#"* | "") continue ;; esac
    [ $# -eq 0 ] || [[ "$wanted" == *" $id "* ]] || continue
    # GROUP@MODES: the group runs under those check modes, as a row of CI's
    # emulated job does (emulated-gpu-check.sh runs every kernel group under
    # bounds,blocks,warp too).
    modes="${PW_EMU_CHECK:-}"
    [ -n "$order" ] && modes="${modes:+$modes,}order"
    if [[ "$group" == *@* ]]; then
        modes="${modes:+$modes,}${group#*@}"
        group="${group%@*}"
    fi
    dir="$work/$id"
    mkdir -p "$dir/emu-cache" "$dir/kernel-cache"
    start=$(date +%s)
    PW_EMU_CXX="$root/scripts/emu_mutant_cxx.py" PW_MUTANT_CXX="$real_cxx" PW_MUTANT_FILE="$file" \
        PW_MUTANT_NTH="$nth" PW_MUTANT_FROM="$from" PW_MUTANT_TO="$to" PW_MUTANT_LOG="$dir/planted" \
        PW_EMU_CACHE="$dir/emu-cache" PIPEWRIGHT_KERNEL_CACHE="$dir/kernel-cache" PW_EMU_CHECK="$modes" \
        timeout --kill-after=10 "$limit" scripts/emulated-gpu.sh "$bin" gpu-check --only "$group" \
        >"$dir/out.txt" 2>&1
    rc=$?
    secs=$(($(date +%s) - start))
    how=""
    if [ ! -s "$dir/planted" ]; then
        verdict="NOT PLANTED"
        missed=$((missed + 1))
    elif grep -q "build failed" "$dir/planted"; then
        verdict="NO BUILD"
        how="the mutant does not compile: fix its line in emu-mutants.tsv"
        missed=$((missed + 1))
    elif [ "$rc" -eq 0 ] && [[ "$what" == equivalent:* ]]; then
        verdict="equivalent"
        how="${what#equivalent: }"
        equivalent=$((equivalent + 1))
    elif [ "$rc" -eq 0 ]; then
        verdict="MISSED"
        how="$what"
        missed=$((missed + 1))
    elif [[ "$what" == equivalent:* ]]; then
        verdict="caught?"
        how="listed as equivalent but caught: its description is wrong"
        missed=$((missed + 1))
    else
        verdict="caught"
        how=$(grep -m1 '^FAIL' "$dir/out.txt" | sed 's/  */ /g' | cut -c1-70)
        [ -n "$how" ] || how=$(grep -m1 -iE 'error|illegal|misaligned|race|barrier' "$dir/out.txt" | cut -c1-70)
        [ "$rc" -ge 124 ] && how="timed out after ${limit}s"
    fi
    rows+=("$(printf '%-27s %-20s %-12s %4ss  %s' "$id" "$group${modes:+@$modes}" "$verdict" "$secs" "$how")")
    printf '%s\n' "${rows[-1]}" >&2
done <scripts/emu-mutants.tsv
echo
printf '%-27s %-20s %-12s %5s  %s\n' mutant group verdict time "first failure"
printf '%s\n' "${rows[@]}"
echo "$(( ${#rows[@]} - missed - equivalent )) of $(( ${#rows[@]} - equivalent )) caught, $equivalent equivalent${order:+ (with --check-order)}"
[ "$missed" -eq 0 ]
