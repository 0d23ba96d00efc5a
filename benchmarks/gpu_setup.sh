# Sourced by the GPU jobs (benchmarks/gpu/*.sh, run by gpu_run.sh) from the repository root: unpacks MLX's CUDA
# build and installs the staged wheels into $SITE once per machine (staging: benchmarks/README.md, "GPU runs"),
# then exports the environment the benchmarks run in. Needs REPO, SITE and PY set.
if [ ! -e "$SITE/.gpu_serve_staged" ]; then
  aa=$(ls /root/mlx.part.aa .device-a/mlx.part.aa 2>/dev/null | head -1)
  ab=$(ls /root/mlx.part.ab .device-b/mlx.part.ab 2>/dev/null | head -1)
  if [ -z "$aa" ] || [ -z "$ab" ]; then
    echo "gpu_setup: MLX halves missing (need /root/mlx.part.aa or .device-a/mlx.part.aa, and /root/mlx.part.ab or .device-b/mlx.part.ab)"; return 2
  fi
  mkdir -p "$SITE"
  cat "$aa" "$ab" | xz -d -T0 | tar -C "$SITE" -xf - || return 2
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
      .device-b/whl/*.whl || return 2
  touch "$SITE/.gpu_serve_staged"
fi
# The checkout comes first: the plugin's code is the working tree's; $SITE gives the host packages,
# the plugin's entry point and its .pth bootstrap (run by the launcher).
export PYTHONPATH=$REPO:$SITE HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv,noheader
$PY -c "import mlx.core as mx, mlx_lm, mlx_vlm; print('mlx', mx.__version__, mx.default_device())" || return 3
