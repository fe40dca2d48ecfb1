#!/usr/bin/env bash
# Download the wheels of benchmarks/device_requirements.txt into .device/wheels (ignored by
# git) for the GPU machine, and check that they fit what one command carries beside the tree.
#
#     benchmarks/device_wheels.sh            # then: run(..., carry=[".device"])
#
# Binary wheels (msgpack, PyYAML) for CPython 3.12 on x86_64 and aarch64 Linux: the GPU host's
# CPU is not known in advance, and device_setup.sh picks the one that installs.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
DEST=.device/wheels
LIMIT=$((64 * 1024 * 1024))  # bytes: the tree and the carried paths together, per command

rm -rf "$DEST"
mkdir -p "$DEST"
for arch in x86_64 aarch64; do
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform "manylinux_2_28_$arch" --platform "manylinux_2_17_$arch" \
    --platform "manylinux2014_$arch" -r benchmarks/device_requirements.txt -d "$DEST"
done

wheels=$(du -cb "$DEST"/*.whl | tail -1 | cut -f1)
tree=$(git ls-files -co --exclude-standard -z | du -cb --files0-from=- | tail -1 | cut -f1)
ls -l "$DEST"
echo "wheels $((wheels / 1024)) KiB + tree $((tree / 1024)) KiB = $(((wheels + tree) / 1024)) KiB" \
  "of $((LIMIT / 1024)) KiB a command carries"
if [ $((wheels + tree)) -gt "$LIMIT" ]; then
  echo "too large for one command: the wheels and the tree exceed 64 MiB" >&2
  exit 1
fi
