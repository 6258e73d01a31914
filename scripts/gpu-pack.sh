#!/usr/bin/env bash
# Packs what one device session needs into .gpu-pack/ (ignored through
# .git/info/exclude, so the device tool carries it only when asked):
#   pipewright   the release binary built with --features cuda, stripped
#                (93 MB with debug = 1; the device tool carries at most 64 MiB)
#   COMMIT       git rev-parse HEAD (the device copy has no .git), "+dirty" when
#                the work tree had changes
#   scripts/     the device-side scripts, configs/ the ready configs
# The device then runs scripts/gpu-device.sh first: one call inside the session's
# 15 minutes of device time (docs/gpu.md gives the exact device-tool call).
#
# usage: scripts/gpu-pack.sh            (builds, then packs)
# env:   PIPEWRIGHT_BIN=path            pack this binary instead of building
#        (it must have been built with --features cuda at this commit)
set -euo pipefail
cd "$(dirname "$0")/.."
PACK=.gpu-pack

exclude="$(git rev-parse --git-path info/exclude)"
mkdir -p "$(dirname "$exclude")"
grep -qxF "/$PACK/" "$exclude" 2>/dev/null || echo "/$PACK/" >>"$exclude"

bin="${PIPEWRIGHT_BIN:-}"
if [ -z "$bin" ]; then
    cargo build --release --features cuda
    bin=target/release/pipewright
fi
[ -x "$bin" ] || { echo "gpu-pack: no executable at $bin" >&2; exit 1; }

rm -rf "$PACK"
mkdir -p "$PACK"
# --strip-debug keeps the symbol table, so a crash on the device still names functions.
strip --strip-debug -o "$PACK/pipewright" "$bin"
commit="$(git rev-parse HEAD)"
git diff --quiet HEAD -- src kernels Cargo.toml Cargo.lock || commit="$commit+dirty"
echo "$commit" >"$PACK/COMMIT"
cp -r scripts configs "$PACK/"
size=$(du -sm "$PACK" | cut -f1)
echo "gpu-pack: $PACK holds $size MiB at $commit"
[ "$size" -lt 60 ] || { echo "gpu-pack: $size MiB is too close to the device tool's 64 MiB carry limit" >&2; exit 1; }
