#!/usr/bin/env bash
# Wheels for a GPU machine without network: everything gpufn and its GPU checks need that the
# machine's image lacks (scripts/gpu_image.txt says what it has), for CPython 3.12 on x86-64
# manylinux, plus gpufn's own wheel, into .whl/ (ignored by git). Bring that folder along and
# run scripts/gpu_check.sh there: it installs them into a target folder without network.
#   scripts/gpu_wheels.sh                          # for the GPU image's Python 3.12
#   GPUFN_WHEEL_PYTHON=3.11 scripts/gpu_wheels.sh  # for another Python (a local rehearsal)
# Then checks that the set is complete (every requirement carried or in the image, one
# version of each, every wheel installable on that Python and platform) and prints its size.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
PYVER=${GPUFN_WHEEL_PYTHON:-3.12}
DEST=.whl
LIMIT_MIB=64   # what a GPU run may carry in all, the working tree included

# What the image lacks, each named with its version (--no-deps: nothing comes unnamed).
# pyzmq: gpufn's sockets. pytest-timeout: pyproject's per-test timeouts. starlette, uvicorn
# and click (uvicorn's, which typer no longer pulls in): the HTTP gateway, for GPU checks
# that serve through it.
CARRY=(pyzmq==27.3.0 pytest-timeout==2.4.0 starlette==1.10.0 uvicorn==0.54.0 click==8.5.1)

TARGET=(--python-version "$PYVER" --implementation cp
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
  --platform manylinux1_x86_64 --only-binary=:all:)

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
rm -rf "$DEST"
mkdir -p "$DEST"
echo "== downloading for CPython $PYVER x86-64: ${CARRY[*]}"
"$PY" -m pip download -q --no-deps "${TARGET[@]}" -d "$DEST" "${CARRY[@]}"
# From a copy of the files git tracks or would (committed or not): a stale build/ here
# (modules since moved or deleted) never lands in the wheel, and nothing is written here.
echo "== building gpufn's wheel"
mkdir "$tmp/src"
git ls-files -z --cached --others --exclude-standard \
  | while IFS= read -r -d '' f; do if [[ -f $f ]]; then printf '%s\0' "$f"; fi; done \
  | xargs -0 cp --parents -t "$tmp/src" --
"$PY" -m pip wheel -q --no-deps -w "$DEST" "$tmp/src"

echo "== every wheel installs on CPython $PYVER x86-64 (pip, no index, one version each)"
"$PY" -m pip install -q --dry-run --no-index --no-deps --find-links "$DEST" "${TARGET[@]}" \
  --target "$tmp/site" "$DEST"/*.whl
echo "== every requirement is carried or in the image; every module of the checkout is in gpufn's wheel"
"$PY" scripts/gpu_wheels_check.py "$DEST" scripts/gpu_image.txt --python-version "$PYVER" \
  --source "$tmp/src"

wheels=$(du -cb "$DEST"/*.whl | tail -1 | cut -f1)
tree=$(git ls-files -z | xargs -0 du -cb 2>/dev/null | awk '/\ttotal$/ {s += $1} END {print s + 0}')
awk -v w="$wheels" -v t="$tree" -v lim="$LIMIT_MIB" 'BEGIN {
  printf "== %s: %.2f MiB of wheels; with the tracked tree (%.2f MiB) %.2f of the %d MiB a GPU run carries\n",
    ".whl", w / 2^20, t / 2^20, (w + t) / 2^20, lim
  exit (w + t > lim * 2^20) }' \
  || { echo "too large: carry fewer wheels" >&2; exit 1; }
