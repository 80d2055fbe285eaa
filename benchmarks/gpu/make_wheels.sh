#!/usr/bin/env bash
# Download, where pip can reach an index, the wheels kvbench needs that a GPU machine without
# network may lack, for Linux x86_64 and CPython 3.10-3.13 (its Python version unknown), into
# wheels/ (or $WHEELS). Bring that folder along; check.sh installs from it with --no-index.
#
# Default set: pydantic with its dependencies (pydantic-core is compiled, one wheel per
# Python version), safetensors, and setuptools for the editable install. numpy, typer, rich,
# psutil and matplotlib come with the usual CUDA/PyTorch images; name any other package as
# an argument to add it, e.g. `make_wheels.sh numpy`.
#
# Usage: benchmarks/gpu/make_wheels.sh [EXTRA_PACKAGE...]
set -euo pipefail

cd "$(dirname "$0")/../.."
DEST=${WHEELS:-wheels}
PY=${PYTHON:-python3}
PACKAGES=(pydantic safetensors "setuptools>=68" "$@")
# pip matches manylinux tags exactly, so name each glibc baseline the wheels use.
PLATFORMS=(
  manylinux2014_x86_64 manylinux_2_17_x86_64 manylinux_2_24_x86_64 manylinux_2_27_x86_64
  manylinux_2_28_x86_64 manylinux_2_31_x86_64 manylinux_2_34_x86_64 linux_x86_64
)
PLATFORM_ARGS=()
for p in "${PLATFORMS[@]}"; do PLATFORM_ARGS+=(--platform "$p"); done

mkdir -p "$DEST"
for version in 3.10 3.11 3.12 3.13; do
  # Dependencies are resolved for each target, so versions agree (pydantic pins its core).
  "$PY" -m pip download --quiet --only-binary=:all: --implementation cp \
    --python-version "$version" "${PLATFORM_ARGS[@]}" --dest "$DEST" "${PACKAGES[@]}"
done
ls -l "$DEST"
du -sh "$DEST"
