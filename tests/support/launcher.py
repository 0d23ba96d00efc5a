"""A fork server for the test suite's ``vllm-mlx`` runs: the heavy third-party imports are paid once per worker.

Every server or CLI run of the suite used to spend ~2 s of CPU importing transformers, mlx-lm, mlx-vlm and the
host before doing anything of its own. Here one long-lived process imports them once; each run is a fork of it
that takes its argv, environment, working directory and stdio from the caller and then runs the ``vllm-mlx``
console script's own entry point, so the test still meets a real host process: real HTTP, real signals, real
exit codes and logs. Like multiprocessing's forkserver with preloads.

What the fork server imports must not depend on what differs between runs: the plugin bridge and ``vllm_mlx.cli``
load in the child, and plugins are loaded and registered there (they read argv and ``VLLM_MLX_PLUGINS``); this
plugin's own engine modules, which register nothing at import, are preloaded with the rest, and the preloaded
objects are frozen out of the garbage collector's walks. A test plugin's folder on
``PYTHONPATH`` joins the child's ``sys.path`` as at interpreter start; a run whose environment differs in anything
else, or whose ``PYTHONPATH`` shadows a module the fork server imported, execs the command afresh in the child.
Besides the console script, a child runs ``python -c CODE`` as the interpreter would; a fork server of its own
(``Launcher(env)``, e.g. with another copy of the host first on ``PYTHONPATH``) serves runs in that environment.
No MLX operation runs in the fork server, so no MLX thread exists when it forks. Linux only (fork after macOS
frameworks load is unsafe); elsewhere, and with ``VLLM_MLX_TEST_LAUNCHER=0``, every run is a plain subprocess.
"""

from __future__ import annotations

import contextlib
import gc
import io
import json
import locale
import os
import selectors
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import warnings
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

VLLM_MLX = str(Path(sys.executable).with_name("vllm-mlx"))
# The fork server's program. This module is test code, not installed: the folder holding its package goes first on
# sys.path for its import only, so the children's import path stays what a fresh interpreter's would be.
_BOOT = (f"import sys; sys.path.insert(0, {str(Path(__file__).resolve().parents[__name__.count('.')])!r}); "
         f"import {__name__} as launcher; del sys.path[0]; launcher.main()")
DISABLE_VAR = "VLLM_MLX_TEST_LAUNCHER"
# Read at run time only (by the bridge, the child's own stdio set-up; pytest's per-test name by no one), so a
# run may set them.
RUN_TIME_VARS = frozenset({"VLLM_MLX_PLUGINS", "PYTHONUNBUFFERED", "PYTEST_CURRENT_TEST"})
# None of them reads argv or VLLM_MLX_PLUGINS at import; what every server start of the suite imports next (the
# server's protocol modules, the tiny Qwen3.5's model and tokenizer classes, this plugin's engine, which registers
# nothing at import: registration is the bridge's, in the child).
PRELOAD = ("transformers", "mlx_lm", "mlx_lm.models.cache", "mlx_lm.models.qwen3_5", "mlx_lm.utils", "mlx_vlm",
           "vllm_mlx.server", "pluggy", "statistics", "difflib",
           "uvicorn.protocols.http.h11_impl", "uvicorn.protocols.websockets.websockets_sansio_impl",
           "uvicorn.lifespan.on", "uvicorn.loops.asyncio", "anyio._backends._asyncio",
           "mlx_vlm.models.qwen3_5", "transformers.models.qwen3_5.tokenization_qwen3_5",
           "vllm_mlx_mtp_routing.plugin", "vllm_mlx_mtp_routing.model.text_model", "vllm_mlx_mtp_routing.text_engine.engine",
           "vllm_mlx_mtp_routing.text_engine.spec.mtp", "vllm_mlx_mtp_routing.prefix_cache.cache",
           "vllm_mlx_mtp_routing.prefix_cache.disk_tier", "vllm_mlx_mtp_routing.admission",
           "vllm_mlx_mtp_routing.specprefill", "vllm_mlx_mtp_routing.routing.prompt_preparation",
           # what the host's MLLM scheduler imports at its first start (its batch generator patches the gemma4 and
           # glm4v-moe models' modules), JSON mode's processor, and the plugin's server-side modules
           "vllm_mlx.mllm_scheduler", "vllm_mlx.constrained", "lmformatenforcer", "mlx_vlm.models.gemma4.language",
           "mlx_vlm.models.glm4v_moe.language", "vllm_mlx_mtp_routing.host.choices",
           "vllm_mlx_mtp_routing.host.server_hooks", "vllm_mlx_mtp_routing.host.request_body",
           "vllm_mlx_mtp_routing.plugin_api.plugin_manager", "vllm_mlx_mtp_routing.prefix_cache.metrics")


def _warm_caches() -> None:
    """What every child would otherwise redo: PIL's image plugins, and the compiled chat template of the suite's
    tiny models (transformers keeps compiled templates by their text; the host compiles it at its start, ~50 ms)."""
    from PIL import Image
    from transformers.utils.chat_template_utils import _compile_jinja_template  # transformers internal (5.x)

    from .tokenizer_builder import CHAT_TEMPLATE

    Image.init()
    _compile_jinja_template(CHAT_TEMPLATE)


# ---- the fork server ---------------------------------------------------------------------------------------------

def _recv_exact(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            raise ConnectionError("client went away")
        data += chunk
    return data


def _receive(conn: socket.socket) -> tuple[dict[str, Any], list[int]]:
    _, fds, _, _ = socket.recv_fds(conn, 1, 3)
    (size,) = struct.unpack("!Q", _recv_exact(conn, 8))
    return json.loads(_recv_exact(conn, size)), fds


def _stdio(fd: int, unbuffered: bool, line_buffering: bool, encoding: str, errors: str) -> IO[str]:
    # As the interpreter builds sys.stdout/sys.stderr at start-up for this environment.
    raw = io.FileIO(fd, "w", closefd=False)
    if unbuffered:
        return io.TextIOWrapper(raw, encoding=encoding, errors=errors, write_through=True)
    return io.TextIOWrapper(io.BufferedWriter(raw), encoding=encoding, errors=errors, line_buffering=line_buffering)


def _changed_vars(env: Mapping[str, str], envs: tuple[Mapping[str, str], Mapping[str, str]]) -> set[str]:
    # The fork server's environment before and after its imports: a variable that an import sets itself
    # (mlx-lm sets TRANSFORMERS_NO_ADVISORY_WARNINGS) is set the same way in a fresh interpreter.
    before, after = envs
    return {k for k in env.keys() | before.keys() | after.keys() if env.get(k) not in (before.get(k), after.get(k))}


def _import_paths(env: Mapping[str, str]) -> list[str]:
    """``PYTHONPATH`` as it enters ``sys.path`` at interpreter start: absolute, each once."""
    entries = [os.path.abspath(p) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    return list(dict.fromkeys(entries))


def _fresh_interpreter_needed(env: Mapping[str, str], envs: tuple[Mapping[str, str], Mapping[str, str]]) -> bool:
    """Whether this fork would differ from a fresh interpreter run with ``env``."""
    changed = _changed_vars(env, envs) - RUN_TIME_VARS
    if not changed:
        return False
    if changed != {"PYTHONPATH"}:
        return True
    base, paths = _import_paths(envs[0]), _import_paths(env)
    remaining = iter(paths)
    if not all(entry in remaining for entry in base):  # the fork server's own import paths, in their order
        return True
    # Extra import paths (a test plugin's folder) are fine unless they hold a module already imported here.
    imported = {name.partition(".")[0] for name in sys.modules}
    for entry in set(paths) - set(base):
        names = {Path(n).stem if n.endswith(".py") else n for n in os.listdir(entry)} if os.path.isdir(entry) else {"?"}
        if names & imported or "?" in names:
            return True
    return False


def _become(
    request: dict[str, Any], fds: list[int], envs: tuple[Mapping[str, str], Mapping[str, str]], site_path: list[str]
) -> str | None:
    """In the forked child: take the caller's stdio, directory, environment and argv; returns the program of a
    ``python -c`` run."""
    argv, env = list(request["argv"]), dict(request["env"])
    afresh = _fresh_interpreter_needed(env, envs)
    how, changed = "exec" if afresh else "fork", sorted(_changed_vars(env, envs))
    print(f"{os.getpid()}: {how} {argv[1:]} (environment: {changed})", file=sys.stderr, flush=True)  # to our log
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in set(fds) - {0, 1, 2}:
        os.close(fd)
    os.chdir(request["cwd"])
    if afresh:
        os.execve(argv[0], argv, env)  # the same process, now as the caller would have started it
    os.environ.clear()
    os.environ.update(env)
    program = argv[2] if _is_program(argv) else None
    # As a fresh interpreter: the console script's folder (the working directory for -c) first, then PYTHONPATH.
    sys.argv = ["-c", *argv[3:]] if program is not None else argv
    first = "" if program is not None else os.path.dirname(os.path.abspath(argv[0]))
    sys.path[:] = [first, *_import_paths(env), *site_path]
    import importlib

    importlib.invalidate_caches()
    unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
    sys.stdin = sys.__stdin__ = open(0, closefd=False)  # noqa: SIM115 (lives as long as the process)
    encoding = sys.stdout.encoding
    sys.stdout = sys.__stdout__ = _stdio(1, unbuffered, os.isatty(1), encoding, "strict")
    sys.stderr = sys.__stderr__ = _stdio(2, unbuffered, True, encoding, "backslashreplace")
    # A fresh interpreter seeds these from the OS; the children must not share the fork server's state.
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    if "mlx.core" in sys.modules:
        sys.modules["mlx.core"].random.seed(int.from_bytes(os.urandom(8), "little"))
    return program


def _is_program(argv: Sequence[str]) -> bool:
    return len(argv) > 2 and argv[0] == sys.executable and argv[1] == "-c"


def serve_forks(socket_path: str, preload: Sequence[str] = ()) -> str | None:
    """Preload (the suite's PRELOAD unless given), then fork one child per request; returns only in a child, ready
    to run the CLI (or, for a ``python -c`` run, the program it returns)."""
    warnings.filterwarnings("ignore", message=".*fork.*", category=DeprecationWarning)  # we fork on purpose
    import importlib

    before = dict(os.environ)
    own = set(_import_paths(before))
    site_path = [p for p in sys.path[1:] if p not in own]  # what follows PYTHONPATH in sys.path
    for name in preload or PRELOAD:
        importlib.import_module(name)
    if not preload:
        with contextlib.suppress(Exception):  # an optimization only: a child compiles it again
            _warm_caches()
    envs = (before, dict(os.environ))
    # Out of the collector's reach: a child's full collections (the host's at start and stop, the server's before it
    # freezes its own start-up heap) no longer walk every preloaded object, ~0.25 s of CPU a server start, nor write to
    # their pages (copy-on-write). No collection here: the plugin's collection counters (imported above) would count it.
    gc.freeze()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(socket_path)
    listener.listen(16)
    sys.stdout.write("ready\n")
    sys.stdout.flush()

    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ, ("accept",))
    sel.register(sys.stdin, selectors.EVENT_READ, ("caller",))  # EOF: the test worker is gone
    children: dict[int, tuple[socket.socket, int]] = {}
    while True:
        for key, _ in sel.select():
            kind = key.data[0]
            if kind == "caller":
                for pid in children:
                    with contextlib.suppress(ProcessLookupError, ConnectionError):
                        os.kill(pid, signal.SIGKILL)
                for pid in children:
                    os.waitpid(pid, 0)
                os._exit(0)
            if kind == "exited":
                pid = key.data[1]
                conn, pidfd = children.pop(pid)
                sel.unregister(pidfd)
                os.close(pidfd)
                _, status, usage = os.wait4(pid, 0)
                code = os.waitstatus_to_exitcode(status)
                print(f"{pid}: exit {code}, CPU {usage.ru_utime + usage.ru_stime:.2f} s", file=sys.stderr, flush=True)
                with contextlib.suppress(ConnectionError):
                    conn.sendall(f"R{code}\n".encode())
                conn.close()
                continue
            conn, _ = listener.accept()
            try:
                request, fds = _receive(conn)
            except (ConnectionError, ValueError, OSError):
                conn.close()
                continue
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                sel.close()
                listener.close()
                conn.close()
                for other, pidfd in children.values():
                    other.close()
                    os.close(pidfd)
                return _become(request, fds, envs, site_path)
            for fd in fds:
                os.close(fd)
            pidfd = os.pidfd_open(pid)
            children[pid] = (conn, pidfd)
            sel.register(pidfd, selectors.EVENT_READ, ("exited", pid))
            with contextlib.suppress(ProcessLookupError, ConnectionError):
                conn.sendall(f"P{pid}\n".encode())


# ---- the caller's side -------------------------------------------------------------------------------------------

class ForkedProcess:
    """The part of ``subprocess.Popen`` that the suite uses, for a child of the fork server."""

    def __init__(self, conn: socket.socket, args: list[str]) -> None:
        self.args = args
        self._conn = conn
        self._file = conn.makefile("rb")
        line = self._file.readline()
        if not line.startswith(b"P"):
            raise RuntimeError("the fork server did not start the process")
        self.pid = int(line[1:])
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self._conn.setblocking(False)
            try:
                self._conn.recv(1, socket.MSG_PEEK)  # the status line has come (or the fork server is gone)
            except BlockingIOError:
                return None
            finally:
                self._conn.setblocking(True)
            self._read_status()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self._conn.settimeout(timeout)
            try:
                self._conn.recv(1, socket.MSG_PEEK)
            except TimeoutError:
                raise subprocess.TimeoutExpired(self.args, timeout) from None
            finally:
                self._conn.settimeout(None)
            self._read_status()
        assert self.returncode is not None
        return self.returncode

    def _read_status(self) -> None:
        line = self._file.readline()
        if not line.startswith(b"R"):
            raise RuntimeError(f"the fork server lost process {self.pid}")
        self.returncode = int(line[1:])
        self._file.close()
        self._conn.close()

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # not yet reaped by the fork server, so the pid is still this process's
            with contextlib.suppress(ProcessLookupError, ConnectionError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _env_of_fork_server(env: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k not in RUN_TIME_VARS}


class Launcher:
    """A fork server for runs in ``env`` (this process's, by default) that imported ``preload`` (PRELOAD, by
    default), started on first use; ``close`` stops it."""

    def __init__(self, env: Mapping[str, str] | None = None, preload: Sequence[str] = ()) -> None:
        self._preload = list(preload)
        self._dir = tempfile.mkdtemp(prefix="vllm-mlx-launcher-")
        self._path = os.path.join(self._dir, "fork.sock")
        self._env = _env_of_fork_server(os.environ if env is None else env)
        self._proc: subprocess.Popen[bytes] | None = None
        self._failed = False
        self._lock = threading.Lock()

    def _server(self) -> bool:
        with self._lock:
            return self._start()

    def _start(self) -> bool:
        if self._proc is None and not self._failed:
            with open(os.path.join(self._dir, "fork-server.log"), "w") as log:
                self._proc = subprocess.Popen(
                    [sys.executable, "-c", _BOOT, self._path, *self._preload], stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE, stderr=log, env=self._env,
                )
            assert self._proc.stdout is not None
            self._failed = self._proc.stdout.readline().strip() != b"ready"
            if self._failed:  # slower, not wrong: every run becomes a plain subprocess
                log = Path(self._dir, "fork-server.log").read_text(errors="replace")
                warnings.warn(f"the vllm-mlx fork server did not start; plain subprocesses instead:\n{log[-2000:]}", stacklevel=2)
        return self._proc is not None and not self._failed and self._proc.poll() is None

    def can_run(self, cmd: Sequence[str]) -> bool:
        return bool(cmd) and (cmd[0] == VLLM_MLX or _is_program(cmd))  # afresh in the child where a fork would differ

    def popen(
        self, cmd: Sequence[str], *, env: Mapping[str, str], stdout: int, stderr: int, stdin: int | None = None,
        cwd: str | None = None,
    ) -> ForkedProcess | None:
        """A child of the fork server, or None where it cannot run ``cmd`` as a fresh interpreter would."""
        if not self.can_run(cmd) or not self._server():
            return None
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(self._path)
        devnull = os.open(os.devnull, os.O_RDONLY) if stdin is None else None
        try:
            payload = json.dumps({"argv": list(cmd), "env": dict(env), "cwd": cwd or os.getcwd()}).encode()
            socket.send_fds(conn, [b"!"], [stdin if devnull is None else devnull, stdout, stderr])
            conn.sendall(struct.pack("!Q", len(payload)) + payload)
        finally:
            if devnull is not None:
                os.close(devnull)
        return ForkedProcess(conn, list(cmd))

    def close(self) -> None:
        if self._proc is not None:
            assert self._proc.stdin is not None
            self._proc.stdin.close()  # the fork server kills what is left and exits
            if self._proc.wait(timeout=30) != 0:
                log = Path(self._dir, "fork-server.log").read_text(errors="replace")
                print(f"vllm-mlx fork server exited with {self._proc.returncode}:\n{log[-4000:]}", file=sys.stderr)
            self._proc = None
        shutil.rmtree(self._dir, ignore_errors=True)


_LAUNCHER: Launcher | None = None


def enable() -> None:
    """Use a fork server for this process's ``vllm-mlx`` runs (see ``popen`` and ``run``)."""
    global _LAUNCHER
    if _LAUNCHER is None and sys.platform == "linux" and os.environ.get(DISABLE_VAR, "1") != "0":
        _LAUNCHER = Launcher()


@contextlib.contextmanager
def of_own(env: Mapping[str, str], preload: Sequence[str] = ()) -> Iterator[Launcher | None]:
    """Where forking is enabled, a fork server of its own for runs in ``env`` (pass it as ``via``), stopped on exit;
    elsewhere None (the runs are plain subprocesses)."""
    fork_server = Launcher(env, preload) if _LAUNCHER is not None else None
    try:
        yield fork_server
    finally:
        if fork_server is not None:
            fork_server.close()


def disable() -> None:
    global _LAUNCHER
    if _LAUNCHER is not None:
        _LAUNCHER.close()
        _LAUNCHER = None


def popen(
    cmd: Sequence[str], *, env: Mapping[str, str], stdout: IO[Any] | int, stderr: IO[Any] | int,
    via: Launcher | None = None,
) -> ForkedProcess | subprocess.Popen[str]:
    """``subprocess.Popen(cmd, stdout=..., stderr=..., env=..., text=True)``, forked where it can be."""
    launcher = via or _LAUNCHER
    if launcher is not None:
        out = stdout if isinstance(stdout, int) else stdout.fileno()
        err = out if stderr == subprocess.STDOUT else stderr if isinstance(stderr, int) else stderr.fileno()
        proc = launcher.popen(cmd, env=env, stdout=out, stderr=err)
        if proc is not None:
            return proc
    return subprocess.Popen(list(cmd), stdout=stdout, stderr=stderr, text=True, env=dict(env))


def run(
    cmd: Sequence[str], *, env: Mapping[str, str], timeout: float, via: Launcher | None = None
) -> subprocess.CompletedProcess[str]:
    """``subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)``, forked where it can be."""
    launcher = via or _LAUNCHER
    if launcher is None or not launcher.can_run(cmd):
        return subprocess.run(list(cmd), capture_output=True, text=True, env=dict(env), timeout=timeout)
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = launcher.popen(cmd, env=env, stdout=out.fileno(), stderr=err.fileno())
        if proc is None:
            return subprocess.run(list(cmd), capture_output=True, text=True, env=dict(env), timeout=timeout)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise
        texts = []
        for f in (out, err):  # decoded as subprocess's text mode does
            f.seek(0)
            texts.append(f.read().decode(locale.getpreferredencoding(False)).replace("\r\n", "\n").replace("\r", "\n"))
        return subprocess.CompletedProcess(list(cmd), proc.returncode, texts[0], texts[1])


def main() -> None:
    """The fork server's process (``_BOOT``): argv is the socket path, then the modules to preload."""
    program = serve_forks(sys.argv[1], sys.argv[2:])
    # Only a forked child gets here: a -c program, run as the interpreter runs it, or the console script's body.
    if program is not None:
        try:
            exec(compile(program, "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
        except Exception as e:  # the traceback a fresh interpreter prints: from the program's frame down
            import traceback

            traceback.print_exception(e.with_traceback(e.__traceback__.tb_next if e.__traceback__ else None))
            sys.exit(1)
        sys.exit()
    from vllm_mlx.cli import main as cli_main

    sys.argv[0] = sys.argv[0].removesuffix(".exe")
    sys.exit(cli_main())
