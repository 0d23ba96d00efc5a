"""The real ``vllm-mlx serve`` in a subprocess on 127.0.0.1, for end-to-end tests, the demo and benchmarks."""

from __future__ import annotations

import contextlib
import functools
import os
import socket
import ssl
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from . import launcher

VLLM_MLX = launcher.VLLM_MLX


@functools.cache
def ssl_context() -> ssl.SSLContext:
    """One for every client here: httpx builds (and loads the CA bundle into) one per client, ~30 ms of CPU."""
    return ssl.create_default_context()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Server:
    url: str
    model: str
    proc: subprocess.Popen[str] | launcher.ForkedProcess
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    # Clients for tests and scripts, all on the one SSL context (these URLs are plain HTTP, but every httpx client,
    # and so every openai/anthropic client and every httpx.get, would otherwise build its own).
    def client(self, timeout: float = 120.0) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=timeout, verify=ssl_context())

    def async_client(self, timeout: float = 120.0) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.url, timeout=timeout, verify=ssl_context())

    def get(self, path: str, **kwargs: Any) -> httpx.Response:
        """``httpx.get(self.url + path, ...)``."""
        return httpx.get(f"{self.url}{path}", verify=ssl_context(), **kwargs)

    def post(self, path: str, **kwargs: Any) -> httpx.Response:
        """``httpx.post(self.url + path, ...)``."""
        return httpx.post(f"{self.url}{path}", verify=ssl_context(), **kwargs)

    def openai(self, *, api_key: str = "x", **kwargs: Any) -> Any:
        """An ``openai.OpenAI`` client of this server (no retries)."""
        import openai

        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0,
                             http_client=openai.DefaultHttpxClient(verify=ssl_context()), **kwargs)

    def async_openai(self, *, api_key: str = "x", **kwargs: Any) -> Any:
        """An ``openai.AsyncOpenAI`` client of this server (no retries)."""
        import openai

        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0,
                                  http_client=openai.DefaultAsyncHttpxClient(verify=ssl_context()), **kwargs)

    def anthropic(self, *, api_key: str = "x", **kwargs: Any) -> Any:
        """An ``anthropic.Anthropic`` client of this server (no retries)."""
        import anthropic

        return anthropic.Anthropic(base_url=self.url, api_key=api_key, max_retries=0,
                                   http_client=anthropic.DefaultHttpxClient(verify=ssl_context()), **kwargs)


@contextlib.contextmanager
def serve(
    model: Path,
    *flags: str,
    log_dir: Path,
    startup_timeout: float = 180.0,
    env: dict[str, str] | None = None,
    command: list[str] | None = None,
    via: launcher.Launcher | None = None,
) -> Iterator[Server]:
    """``command`` replaces the ``vllm-mlx`` console script (e.g. ``[python, "-c", launcher]``);
    ``env`` is merged over this process's environment; ``via``: a fork server of its own (launcher.of_own)."""
    full_env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    for attempt in range(3):
        port = free_port()
        cmd = [*(command or [VLLM_MLX]), "serve", str(model), "--host", "127.0.0.1", "--port", str(port), *flags]
        try:
            # uvicorn's own line: /health alone could be answered by another process that took the port
            with run_server(cmd, port, model=str(model), log_path=log_dir / f"server-{port}.log", env=full_env,
                            ready_path="/health", startup_timeout=startup_timeout,
                            ready_line=f"Uvicorn running on http://127.0.0.1:{port}", via=via) as server:
                yield server
            return
        except PortTaken:
            if attempt == 2:
                raise


class PortTaken(RuntimeError):
    """Another process bound the port between ``free_port`` and the server's own bind (tests run in parallel)."""


@contextlib.contextmanager
def run_server(
    cmd: list[str], port: int, *, model: str, log_path: Path, env: dict[str, str], ready_path: str,
    startup_timeout: float = 180.0, ready_line: str | None = None, via: launcher.Launcher | None = None,
) -> Iterator[Server]:
    """Any HTTP server process on 127.0.0.1:``port``: ready once ``ready_path`` answers 200 (and, if given, its
    log has ``ready_line``), stopped on exit."""
    with open(log_path, "w") as log:
        proc = launcher.popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, via=via)
    server = Server(url=f"http://127.0.0.1:{port}", model=model, proc=proc, log_path=log_path)
    try:
        deadline = time.monotonic() + startup_timeout
        with httpx.Client(timeout=2, verify=ssl_context()) as poll:
            _wait_ready(server, poll, ready_path, ready_line, deadline, startup_timeout)
        yield server
    finally:
        stop(proc, 20)


def stop(proc: subprocess.Popen, within: float) -> None:
    """SIGTERM, then SIGKILL if it is still running ``within`` seconds later."""
    proc.terminate()
    try:
        proc.wait(timeout=within)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _wait_ready(server: Server, poll: httpx.Client, ready_path: str, ready_line: str | None, deadline: float,
                startup_timeout: float) -> None:
    proc = server.proc
    while True:
        if proc.poll() is not None:
            log_text = server.log()
            if "address already in use" in log_text.lower():
                raise PortTaken(f"port {server.url.rsplit(':', 1)[1]} was taken:\n{log_text[-2000:]}")
            raise RuntimeError(f"server exited with {proc.returncode}:\n{log_text[-4000:]}")
        try:
            ready = poll.get(f"{server.url}{ready_path}").status_code == 200
            if ready and (ready_line is None or ready_line in server.log()):
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"server did not start in {startup_timeout}s:\n{server.log()[-4000:]}")
        # a forked start-up takes ~0.3-0.5 s (a fresh process a few seconds): polled finely at first, a test (and
        # its worker's core) does not wait long past it
        time.sleep(0.02 if deadline - time.monotonic() > startup_timeout - 3 else 0.1)


def png_data_url(rgb: tuple[int, int, int], size: int = 64) -> str:
    import base64
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (size, size), rgb).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
