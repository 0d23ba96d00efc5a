"""What every benchmark result file records: the commit, the device and the package versions."""

from __future__ import annotations

import contextlib
import os
import platform
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def commit() -> str:
    """BENCH_COMMIT (set by the GPU scripts, whose copy of the tree may have no .git) or git's HEAD."""
    if os.environ.get("BENCH_COMMIT"):
        return os.environ["BENCH_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                             timeout=10, check=False)
        return out.stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def device() -> str:
    """MLX's default device, with the NVIDIA GPU's name and driver when MLX runs on one."""
    import mlx.core as mx

    line = str(mx.default_device())
    if mx.default_device() == mx.gpu:
        try:
            gpu = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=20, check=False).stdout.strip()
            line += f" ({gpu.splitlines()[0]})" if gpu else ""
        except OSError:
            pass
    return line


def device_line() -> str:
    """MLX's version and device, the CPU, Python, and the NVIDIA GPU where one answers: a table's device line."""
    import mlx.core as mx

    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return (f"MLX {mx.__version__} {mx.default_device()}, {os.cpu_count()} cores {cpu}, "
            f"Python {platform.python_version()}{gpu_names()}{preloaded()}")


def preloaded() -> str:
    """', LD_PRELOAD libmlx_openblas.so' where a library is preloaded (cpu_openblas.sh's gemm), else ''."""
    libs = [Path(x).name for x in os.environ.get("LD_PRELOAD", "").replace(":", " ").split()]
    return f", LD_PRELOAD {' '.join(libs)}" if libs else ""


def gpu_names() -> str:
    """', on NVIDIA H100 80GB HBM3 (driver 580.159.04)' where nvidia-smi answers, else ''."""
    if not shutil.which("nvidia-smi"):
        return ""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20, check=False).stdout.strip().splitlines()
    except (OSError, subprocess.SubprocessError):
        return ""
    gpus = [tuple(x.strip() for x in line.split(",", 1)) for line in out if "," in line]
    return f", on {gpus[0][0]} (driver {gpus[0][1]})" + (f" x{len(gpus)}" if len(gpus) > 1 else "") if gpus else ""


def versions() -> dict:
    import mlx.core as mx

    out = {"mlx": mx.__version__, "python": platform.python_version(),
           "machine": f"{platform.machine()} {platform.system()}, {os.cpu_count()} cpus"}
    for mod in ("mlx_lm", "mlx_vlm", "vllm_mlx"):
        try:
            out[mod] = getattr(__import__(mod), "__version__", None)
        except Exception:  # noqa: BLE001 - informative only
            out[mod] = None
    return out


def record() -> dict:
    return {"commit": commit(), "device": device(), "versions": versions()}


if __name__ == "__main__":  # a helper module; run alone it prints what a result file would record
    import argparse
    import json

    argparse.ArgumentParser(description=__doc__).parse_args()
    print(json.dumps(record(), indent=1))
