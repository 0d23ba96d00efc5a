#!/usr/bin/env bash
# Stage MLX's CUDA build (and extra wheels) for an offline NVIDIA machine with Python 3.12 that takes
# at most 64 MiB per transfer: mlx + mlx-cuda-13 pack to ~76 MB, so they travel as two halves.
# On the GPU machine: cat mlx.part.aa mlx.part.ab | xz -d | tar -C /root/site -xf - ; then
# pip install --no-index --no-deps --target /root/site whl/*.whl ; PYTHONPATH=/root/site.
#
# usage: bash benchmarks/gpu/stage.sh [EXTRA_REQUIREMENT ...]     (on the workstation, from the repository)
#   writes .device-a/ (half 1) and .device-b/ (half 2 + extra wheels), which .gitignore ignores;
#   benchmarks/gpu_setup.sh unpacks them on the GPU machine (benchmarks/README.md, "GPU runs").
set -euo pipefail
MLX_VERSION=${MLX_VERSION:-0.32.4}
root=$(git rev-parse --show-toplevel)
cd "$root"
work=$(mktemp -d)
plat=(--only-binary=:all: --python-version 3.12 --implementation cp
      --platform manylinux_2_35_x86_64 --platform manylinux_2_28_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
python3 -m pip download -q --no-deps "${plat[@]}" -d "$work/whl" \
    "mlx==$MLX_VERSION" "mlx-cuda-13==$MLX_VERSION"
mkdir -p "$work/site"
for w in "$work"/whl/*.whl; do (cd "$work/site" && python3 -m zipfile -e "$w" .); done
tar -C "$work/site" -cf - . | xz -T0 -6 > "$work/mlx.tar.xz"
rm -rf .device-a .device-b && mkdir -p .device-a .device-b/whl
split -b 40m "$work/mlx.tar.xz" "$work/part."
mv "$work/part.aa" .device-a/mlx.part.aa
mv "$work/part.ab" .device-b/mlx.part.ab
if [ $# -gt 0 ]; then
  # pure-Python or cp312 manylinux wheels; name every dependency the GPU machine lacks
  python3 -m pip download -q --no-deps "${plat[@]}" -d .device-b/whl "$@" ||
  python3 -m pip download -q --no-deps -d .device-b/whl "$@"
fi
rm -rf "$work"
du -sh .device-a .device-b
echo "staged: .device-a/ (half 1) and .device-b/ (half 2 + wheels)"
