# Sourced by the GPU jobs that read the device's busy time (loops, cpu_step) after gpu_setup.sh: installs cupti-python
# where it was staged after the machine's first setup, and puts libcupti on LD_LIBRARY_PATH (the image's
# nvidia-cuda-cupti wheel, torch's CUDA, else the CUDA toolkit's). Needs PY and SITE set.
if ! $PY -c "import cupti" 2>/dev/null && ls .device-b/whl/cupti_python-*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" \
      .device-b/whl/cupti_python-*.whl .device-b/whl/pyelftools-*.whl 2>&1 | tail -2
fi
cupti_lib=$($PY -c "import glob, site, os; l = [p for d in site.getsitepackages() for p in glob.glob(d + '/nvidia/**/libcupti.so*', recursive=True)]; print(os.path.dirname(l[0]) if l else '')" 2>/dev/null)
[ -n "$cupti_lib" ] || cupti_lib=$(ls -d /usr/local/cuda/extras/CUPTI/lib64 2>/dev/null | head -1)
[ -n "$cupti_lib" ] && export LD_LIBRARY_PATH=$cupti_lib:${LD_LIBRARY_PATH:-}
$PY -c "from cupti import cupti; print('cupti-python imports (libcupti from', '${cupti_lib:-its default}', ')')" 2>&1 | tail -1
