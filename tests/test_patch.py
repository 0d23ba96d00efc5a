"""The upstream patch: it applies to the pinned host, and the patched host alone runs our plugin.

Every run works on a fresh copy of the installed ``vllm_mlx`` package, patched in a temp dir and put
first on ``PYTHONPATH`` of a process of its own (forked from one that imported the patched copy); the installed
host is never touched. Our bridge is still installed there (its ``.pth``), so these tests also show that it steps
aside for a native host.
"""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import os
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from dataclasses import fields
from pathlib import Path
from types import ModuleType

import httpx
import pytest

from support import launcher
from support.server import Server, serve

PINNED_VERSION = "0.6.0"
PATCH = Path(__file__).resolve().parents[1] / "patches" / f"vllm-mlx-{PINNED_VERSION}-plugin-hooks.patch"
API_KEY = "patch-test-key"

# Runs the stock entry point of whichever vllm_mlx is first on sys.path; argv follows `-c CODE`.
CLI = """
import sys
import vllm_mlx.cli as cli
print("HOST", cli.__file__, "BRIDGE", hasattr(cli, "_vllm_mlx_plugin_bridge"), file=sys.stderr, flush=True)
sys.argv[0] = "vllm-mlx"
cli.main()
"""

# A second plugin that raises OUR package's exception classes: the patched host must take them by shape.
REFUSER = """
import pluggy
from vllm_mlx_mtp_routing.plugin_api.errors import FlagError, RequestRejected

hookimpl = pluggy.HookimplMarker("vllm_mlx")


@hookimpl
def vllm_mlx_add_cli_args(group):
    group.add_argument("--refuser-limit", type=int, default=0, help="refuser's own flag")


@hookimpl
def vllm_mlx_validate_args(args):
    if args.refuser_limit > 10:
        raise FlagError("--refuser-limit", "cannot exceed 10")


@hookimpl
def vllm_mlx_pre_generate(request):
    if request.headers.get("x-refuse"):
        raise RequestRejected(503, "busy, try later", retry_after=2.2)


@hookimpl
def vllm_mlx_register_routes(router):
    @router.get("/v1/refuser/conflict")
    async def conflict():
        raise RequestRejected(409, "conflict")
"""


@pytest.fixture(scope="module")
def patched_host(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory holding a freshly patched copy of the installed host's ``vllm_mlx`` package."""
    import vllm_mlx

    if vllm_mlx.__version__ != PINNED_VERSION:
        pytest.skip(f"the patch is generated against vllm-mlx {PINNED_VERSION}; installed is {vllm_mlx.__version__}")
    if shutil.which("patch") is None:
        pytest.skip("GNU patch is not installed")
    root = tmp_path_factory.mktemp("patched_host")
    shutil.copytree(Path(vllm_mlx.__file__).parent, root / "vllm_mlx", ignore=shutil.ignore_patterns("__pycache__"))
    dry = _patch(root, "--dry-run")
    assert dry.returncode == 0, dry.stdout + dry.stderr
    assert not (root / "vllm_mlx" / "plugins").exists()  # a dry run changes nothing
    real = _patch(root)
    assert real.returncode == 0, real.stdout + real.stderr
    # clean: no hunk needed an offset or fuzz, nothing was rejected
    assert "Hunk" not in real.stdout + real.stderr, real.stdout
    assert not list(root.rglob("*.rej")) and not list(root.rglob("*.orig"))
    return root


def _patch(root: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    cmd = ["patch", "-p1", "--batch", "--forward", *flags, "-i", str(PATCH)]
    return subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=60)


@pytest.fixture(scope="module")
def refuser_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A hermetic test plugin: its module plus a dist-info declaring the entry point."""
    root = tmp_path_factory.mktemp("refuser")
    (root / "refuser_plugin.py").write_text(textwrap.dedent(REFUSER))
    dist = root / "refuser_plugin-0.0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: refuser-plugin\nVersion: 0.0.1\n")
    (dist / "entry_points.txt").write_text("[vllm_mlx.plugins]\nrefuser = refuser_plugin\n")
    return root


def host_env(*paths: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "VLLM_MLX_PLUGINS"}
    env.update(HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([*map(str, paths), *filter(None, [env.get("PYTHONPATH")])])
    return env


@pytest.fixture(scope="module")
def forks(patched_host: Path) -> Iterator[launcher.Launcher | None]:
    """The patched host's runs fork from a process that imported it once (support/launcher.py): each run is a child
    that runs CLI as `python -c` would, instead of ~2.5 s of CPU importing the host and its dependencies again."""
    with launcher.of_own(host_env(patched_host)) as fork_server:
        yield fork_server


def run_host(
    host: Path, via: launcher.Launcher | None, *args: str, extra: Path | None = None
) -> subprocess.CompletedProcess[str]:
    paths = [host] if extra is None else [host, extra]
    cmd = [sys.executable, "-c", CLI, *args]
    result = launcher.run(cmd, env=host_env(*paths), timeout=120, via=via)
    # the patched copy ran, and our bridge left it alone
    assert f"HOST {host / 'vllm_mlx' / 'cli.py'} BRIDGE False" in result.stderr, result.stderr[-2000:]
    return result


def test_patch_adds_the_plugins_package(patched_host: Path) -> None:
    package = patched_host / "vllm_mlx" / "plugins"
    assert {p.name for p in package.glob("*.py")} >= {"__init__.py", "hookspecs.py", "errors.py", "manager.py"}


def _load(path: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while building
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[name]
    return module


def test_hookspecs_match_ours(patched_host: Path) -> None:
    from vllm_mlx_mtp_routing.plugin_api import hookspecs as ours

    native = _load(patched_host / "vllm_mlx" / "plugins" / "hookspecs.py", "_patched_vllm_mlx_hookspecs")
    assert (native.PROJECT_NAME, native.ENTRY_POINT_GROUP) == (ours.PROJECT_NAME, ours.ENTRY_POINT_GROUP)

    def hooks(module: ModuleType) -> dict[str, list[str]]:
        return {
            name: list(inspect.signature(fn).parameters)
            for name, fn in vars(module).items()
            if name.startswith("vllm_mlx_") and callable(fn)
        }

    assert hooks(native) == hooks(ours)
    for cls in ("EngineContext", "ModelInfo", "GenerationRequest"):
        assert [f.name for f in fields(getattr(native, cls))] == [f.name for f in fields(getattr(ours, cls))]


def test_help_lists_plugin_flags_and_bridge_steps_aside(patched_host: Path, forks: launcher.Launcher | None) -> None:
    result = run_host(patched_host, forks, "serve", "--plugins", "mtp-routing", "--help")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "--plugins NAME[,NAME...]" in result.stdout
    assert "plugin mtp-routing:" in result.stdout
    assert "--mtp-routing-disable" in result.stdout


def test_unknown_plugin_exits_2_listing_installed(patched_host: Path, forks: launcher.Launcher | None) -> None:
    result = run_host(patched_host, forks, "serve", "some-model", "--plugins", "nope")
    assert result.returncode == 2
    assert "argument --plugins: unknown plugin 'nope'" in result.stderr
    assert "installed plugins:" in result.stderr and "mtp-routing" in result.stderr


def test_our_flag_error_exits_2(patched_host: Path, forks: launcher.Launcher | None, refuser_dir: Path) -> None:
    result = run_host(
        patched_host, forks, "serve", "some-model", "--plugins", "mtp-routing,refuser", "--refuser-limit", "11", extra=refuser_dir
    )
    assert result.returncode == 2
    assert "error: argument --refuser-limit: cannot exceed 10" in result.stderr


def test_misspelled_hook_fails_start_up_naming_it(patched_host: Path, forks: launcher.Launcher | None, tmp_path: Path) -> None:
    (tmp_path / "typo_plugin.py").write_text("def vllm_mlx_stat(engine):\n    return {}\n")
    dist = tmp_path / "typo_plugin-0.0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: typo-plugin\nVersion: 0.0.1\n")
    (dist / "entry_points.txt").write_text("[vllm_mlx.plugins]\ntypo = typo_plugin\n")
    result = run_host(patched_host, forks, "serve", "some-model", "--plugins", "typo", extra=tmp_path)
    assert result.returncode == 1
    assert "implements unknown hook 'vllm_mlx_stat' (did you mean 'vllm_mlx_stats'?)" in result.stderr


def serve_patched(
    host: Path, via: launcher.Launcher | None, model: Path, *flags: str, extra: Path, log_dir: Path
) -> contextlib.AbstractContextManager[Server]:
    """The shared server helper, started through the stock entry point of the patched copy."""
    return serve(model, *flags, log_dir=log_dir, env=host_env(host, extra), command=[sys.executable, "-c", CLI], via=via)


@pytest.fixture(scope="module")
def patched_server(
    patched_host: Path, forks: launcher.Launcher | None, refuser_dir: Path, tiny_vlm_bf16: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    flags = ("--plugins", "mtp-routing,refuser", "--continuous-batching", "--mllm", "--api-key", API_KEY)
    with serve_patched(patched_host, forks, tiny_vlm_bf16, *flags, extra=refuser_dir, log_dir=tmp_path_factory.mktemp("logs")) as server:
        yield server


def _client(server: Server) -> httpx.Client:
    client = server.client(timeout=60)
    client.headers["Authorization"] = f"Bearer {API_KEY}"
    return client


@pytest.mark.server
def test_patched_server_runs_the_plugin(patched_server: Server) -> None:
    with _client(patched_server) as client:
        plugins = client.get("/v1/plugins").json()["plugins"]
        assert [p["name"] for p in plugins] == ["mtp-routing", "refuser"]
        assert patched_server.get("/v1/plugins").status_code == 401  # behind --api-key

        chat = {"model": patched_server.model, "messages": [{"role": "user", "content": "def add(a, b):"}], "max_tokens": 8, "temperature": 0}
        out = client.post("/v1/chat/completions", json=chat)
        assert out.status_code == 200, out.text
        assert out.json()["usage"]["completion_tokens"] > 0
        assert isinstance(out.json()["choices"][0]["message"]["content"], str)

        status = client.get("/v1/status").json()
        # the text request took the plugin's text path: its wrapper sits under the host's decorator
        assert status["plugins"]["mtp-routing"]["routing"]["text"] >= 1
        assert status["plugins"]["refuser"] == {}
    log = patched_server.log()
    assert "INFO:vllm_mlx.plugins.manager:Plugins loaded: mtp-routing" in log
    assert "vllm_mlx_mtp_routing.bridge" not in log


@pytest.mark.server
def test_patched_server_takes_our_rejections(patched_server: Server) -> None:
    chat = {"model": patched_server.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    with _client(patched_server) as client:
        refused = client.post("/v1/chat/completions", json=chat, headers={"x-refuse": "1"})
        assert refused.status_code == 503 and refused.headers["retry-after"] == "2"
        # a refused stream is a plain HTTP error, not an error frame inside a 200 event stream
        streamed = client.post("/v1/chat/completions", json={**chat, "stream": True}, headers={"x-refuse": "1"})
        assert streamed.status_code == 503
        assert streamed.headers["content-type"] == "application/json"
        assert streamed.json()["error"]["message"] == "busy, try later"
        route = client.get("/v1/refuser/conflict")
        assert route.status_code == 409 and route.json()["error"]["message"] == "conflict"
