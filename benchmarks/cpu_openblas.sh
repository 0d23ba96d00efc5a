#!/usr/bin/env bash
# MLX's Linux CPU wheel (mlx-cpu 0.32.4) links netlib's reference BLAS for its fp32 gemm; this builds a preload library
# that sends those calls to OpenBLAS instead, so a CPU benchmark can be run in both regimes (docs/benchmarks.md, "Where a
# CPU round's decode goes"). Both servers of a run get it alike: set LD_PRELOAD before starting the benchmark.
#
#   bash benchmarks/cpu_openblas.sh /tmp/openblas        # then: LD_PRELOAD=/tmp/openblas/libmlx_openblas.so python ...
#
# Only fp32 matmuls go through BLAS: a bf16 or fp16 model runs MLX's own CPU gemm either way (convert it to fp32 first).
set -euo pipefail
dir=${1:?usage: cpu_openblas.sh DIR}
py=${PYTHON:-python3}
mkdir -p "$dir"
"$py" -m pip download -q --no-deps -d "$dir/wheel" scipy-openblas32
"$py" - "$dir" <<'EOF'
import glob, sys, zipfile
d = sys.argv[1]
with zipfile.ZipFile(glob.glob(f"{d}/wheel/scipy_openblas32-*.whl")[0]) as z:
    with open(f"{d}/libscipy_openblas.so", "wb") as f:
        f.write(z.read("scipy_openblas32/lib/libscipy_openblas.so"))
EOF
# scipy's OpenBLAS prefixes its symbols; MLX imports cblas_sgemm / cblas_dgemm (nm -D --undefined-only libmlx.so)
cat > "$dir/shim.c" <<'EOF'
typedef int blasint;
void scipy_cblas_sgemm(int, int, int, blasint, blasint, blasint, float, const float *, blasint, const float *, blasint,
                       float, float *, blasint);
void scipy_cblas_dgemm(int, int, int, blasint, blasint, blasint, double, const double *, blasint, const double *,
                       blasint, double, double *, blasint);
void cblas_sgemm(int o, int ta, int tb, blasint m, blasint n, blasint k, float al, const float *a, blasint lda,
                 const float *b, blasint ldb, float be, float *c, blasint ldc) {
  scipy_cblas_sgemm(o, ta, tb, m, n, k, al, a, lda, b, ldb, be, c, ldc);
}
void cblas_dgemm(int o, int ta, int tb, blasint m, blasint n, blasint k, double al, const double *a, blasint lda,
                 const double *b, blasint ldb, double be, double *c, blasint ldc) {
  scipy_cblas_dgemm(o, ta, tb, m, n, k, al, a, lda, b, ldb, be, c, ldc);
}
EOF
cc -O2 -shared -fPIC "$dir/shim.c" -o "$dir/libmlx_openblas.so" -L"$dir" -lscipy_openblas -Wl,-rpath,"$(cd "$dir" && pwd)"
echo "LD_PRELOAD=$(cd "$dir" && pwd)/libmlx_openblas.so"
