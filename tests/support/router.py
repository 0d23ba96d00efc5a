"""Replicas of the plugin server behind a real router on 127.0.0.1, for the replica tests (``make test-replicas``).

The routers are Rust binaries in wheels of their own (sglang-router, vllm-router), installed by ``make test-replicas``
into a virtual environment beside the project's (``.venv-router``; ``VLLM_MLX_ROUTER_VENV`` names another): their
web-framework pins would otherwise move the host's. Without it the tests that need a router are skipped.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from .server import Server, free_port, run_server, stop

ROUTER_VENV = Path(os.environ.get("VLLM_MLX_ROUTER_VENV", Path(__file__).resolve().parents[2] / ".venv-router"))
SGLANG = ("sglang", [str(ROUTER_VENV / "bin" / "python"), "-m", "sglang_router.launch_router"])
VLLM = ("vllm", [str(ROUTER_VENV / "bin" / "vllm-router")])
# Checks every second, a worker out after one failure and back after one success: the tests wait seconds, not minutes.
FAST_HEALTH = ("--health-check-interval-secs", "1", "--health-failure-threshold", "1", "--health-success-threshold", "1",
               "--worker-startup-check-interval", "1")


def installed(router: tuple[str, list[str]]) -> bool:
    name, cmd = router
    if name == "vllm":
        return Path(cmd[0]).is_file()
    probe = subprocess.run([cmd[0], "-c", "import sglang_router"], capture_output=True) if Path(cmd[0]).is_file() else None
    return probe is not None and probe.returncode == 0


@dataclass
class Router:
    url: str
    proc: subprocess.Popen[str]
    log_path: Path

    def workers(self) -> dict[str, bool]:
        """Each worker's URL and whether the router counts it healthy."""
        listed = httpx.get(f"{self.url}/workers", timeout=5).json()["workers"]
        return {w["url"]: bool(w["is_healthy"]) for w in listed}

    def wait_workers(self, expected: dict[str, bool], within: float) -> None:
        deadline = time.monotonic() + within
        while (seen := self.workers()) != expected:
            assert time.monotonic() < deadline, f"router workers {seen}, waited for {expected}:\n{self.log()[-3000:]}"
            time.sleep(0.2)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


@contextlib.contextmanager
def route(router: tuple[str, list[str]], workers: list[str], *flags: str, log_dir: Path) -> Iterator[Router]:
    """The router in front of ``workers``, ready once it counts them all healthy; stopped on exit."""
    name, cmd = router
    port = free_port()
    full = [*cmd, "--host", "127.0.0.1", "--port", str(port), "--prometheus-port", str(free_port()),
            "--worker-urls", *workers, *FAST_HEALTH, *flags]
    log_path = log_dir / f"router-{name}-{port}.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(full, stdout=log, stderr=subprocess.STDOUT, text=True)
    router_ = Router(f"http://127.0.0.1:{port}", proc, log_path)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, f"router exited with {proc.returncode}:\n{router_.log()[-3000:]}"
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{router_.url}/readiness", timeout=2).status_code == 200:
                    router_.wait_workers(dict.fromkeys(workers, True), within=30)
                    break
            assert time.monotonic() < deadline, f"router not ready:\n{router_.log()[-3000:]}"
            time.sleep(0.1)
        yield router_
    finally:
        stop(proc, 10)


@contextlib.contextmanager
def replica(model: Path, flags: tuple[str, ...], log_dir: Path, port: int | None = None) -> Iterator[Server]:
    """``vllm-mlx serve`` on ``port`` (a free one by default): a replica started again takes its old port."""
    from .server import VLLM_MLX

    port = port or free_port()
    cmd = [VLLM_MLX, "serve", str(model), "--host", "127.0.0.1", "--port", str(port), *flags]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    with run_server(cmd, port, model=str(model), log_path=log_dir / f"replica-{port}-{time.monotonic_ns()}.log", env=env,
                    ready_path="/health", ready_line=f"Uvicorn running on http://127.0.0.1:{port}") as server:
        yield server


def prefix_lookups(server: Server) -> int:
    """Prefix-cache lookups of the replica's text path: one per text request it served."""
    status: dict[str, Any] = server.get("/v1/status", timeout=10).json()
    return int(status["plugins"]["mtp-routing"]["prefix_cache"]["lookups"])
