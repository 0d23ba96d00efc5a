"""Shared pytest fixtures: tiny random Qwen3.5 VLM checkpoints, built once per session."""

from __future__ import annotations

import contextlib
import fcntl
import gc
import os

# Set before any test module imports transformers/mlx_vlm: nothing may reach the hub.
os.environ["HF_HUB_OFFLINE"] = "1"

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from support import launcher
from support.server import Server, serve
from support.tiny_model import tiny_model_dir

# Modules that take the same server from `shared_server` are one work unit, so it starts once.
SHARED_SERVER_UNITS = {
    "test_routing_e2e.py": "stock-fp32-server", "test_server_bridge_e2e.py": "stock-fp32-server",
    "test_media_e2e.py": "stock-fp32-server",
    "test_mtp_e2e.py": "trained-servers", "test_logits_processing_e2e.py": "trained-servers",
    "test_reliability_e2e.py": "shared-bf16-server", "test_malformed_input_e2e.py": "shared-bf16-server",
    "test_fuzz_e2e.py": "shared-bf16-server", "test_cache_salt_e2e.py": "shared-bf16-server",
    "test_operator_messages_e2e.py": "shared-bf16-server", "test_agent_replays_e2e.py": "shared-bf16-server",
    "test_hostile_input_e2e.py": "shared-bf16-server",
}


# `make test` runs the suite on two workers (pytest-xdist). A module runs on one worker, so its module-scoped servers
# start once; modules that start a server per test (or per cell) are split further so both workers share them.
def _work_unit(nodeid: str) -> str:
    module, _, test = nodeid.partition("::")
    if (unit := SHARED_SERVER_UNITS.get(module.rsplit("/", 1)[-1])) is not None:
        return unit
    if module.endswith("test_checkpoint_layouts_e2e.py"):  # per precision: its plain server is started once
        return f"{module}:{test.rstrip(']').rsplit('-', 1)[-1]}"
    if module.endswith("test_prefix_cache_e2e.py"):
        return nodeid
    return module


@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session: pytest.Session) -> None:
    # The test modules' imports (transformers, mlx-vlm, the host) leave ~300k objects that live as long as the
    # process: out of the collector's reach, a full collection (dozens per worker, from tests that allocate many
    # objects) no longer walks them all again, ~0.15 s of CPU each.
    gc.collect()
    gc.freeze()


@pytest.fixture
def gc_heap_unfrozen() -> Iterator[None]:
    """For tests of the collector itself: the worker's heap back in its scans (a full collection walks it), frozen
    again afterwards."""
    gc.unfreeze()
    yield
    gc.collect()
    gc.freeze()


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: without it installed the suite runs in one process
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    from xdist.scheduler import LoadScopeScheduling

    class ByWorkUnit(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _work_unit(nodeid)

    config.option.loadscopereorder = False  # collection order: the slow server modules start early
    return ByWorkUnit(config, log)


def _run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """This run's folder that every xdist worker shares (the workers' common parent)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture(scope="session", autouse=True)
def vllm_mlx_fork_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The suite's `vllm-mlx` servers and CLI runs fork from one process per worker that imported the host once
    (support/launcher.py): ~2 s of CPU less per run. VLLM_MLX_TEST_LAUNCHER=0 starts each as a plain subprocess.
    Their prefill calibrations are kept for this run only (set before the fork server copies the environment)."""
    from vllm_mlx_mtp_routing.text_engine.calibration_file import ENV_VAR

    os.environ[ENV_VAR] = str(_run_dir(tmp_path_factory) / "prefill-calibration.json")
    launcher.enable()
    yield
    launcher.disable()


class _SharedServers:
    """One server per (model, flags), kept while the work unit that uses it runs (its modules run one after another
    on one worker) and stopped when the unit ends: an idle server still costs ~3% of a core (the host's scheduler
    polls), over the rest of the session."""

    def __init__(self, tmp_path_factory: pytest.TempPathFactory) -> None:
        self._tmp = tmp_path_factory
        self._servers: dict[tuple[str, tuple[str, ...]], Server] = {}
        self._stack = contextlib.ExitStack()

    def get(self, model: Path, *flags: str) -> Server:
        key = (str(model), flags)
        if key not in self._servers:
            self._servers[key] = self._stack.enter_context(serve(model, *flags, log_dir=self._tmp.mktemp("shared-server")))
        return self._servers[key]

    def close(self) -> None:
        self._servers.clear()
        self._stack.close()


_shared_servers: _SharedServers | None = None


@pytest.fixture(scope="session")
def shared_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., Server]]:
    """`get(model, *flags) -> Server`: one server per (model, flags) for the work unit (a start-up is ~1 s of CPU),
    for tests that only read from it or count by deltas. Its modules go in SHARED_SERVER_UNITS."""
    global _shared_servers
    _shared_servers = _SharedServers(tmp_path_factory)
    yield _shared_servers.get
    _shared_servers.close()
    _shared_servers = None


def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    if _shared_servers is not None and (nextitem is None or _work_unit(nextitem.nodeid) != _work_unit(item.nodeid)):
        _shared_servers.close()


@pytest.fixture(scope="session")
def tiny_vlm_factory(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """`factory(dtype="float32", placement="subdir") -> Path`, each pair built once per run (shared by the workers)."""
    root = _run_dir(tmp_path_factory) / "tiny_vlm"

    def factory(dtype: str = "float32", placement: str = "subdir") -> Path:
        root.mkdir(exist_ok=True)
        with open(str(root) + ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # the other worker waits instead of training the same tokenizer
            return tiny_model_dir(root, dtype=dtype, placement=placement)

    return factory


TRAINED = Path(__file__).resolve().parents[1] / "models" / "tiny-qwen35-trained"
MOE_LAYOUTS = ("mlx", "fused", "per-expert")


@pytest.fixture(scope="session")
def moe_vlm_factory(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """`factory(layout="fused", dtype="float32") -> Path`: the trained tiny model made a Qwen3.5-MoE VLM
    (support/moe_model.py: its MTP head too, so drafts are accepted), in mlx-vlm's MLX layout ("mlx") or as a raw
    Hugging Face checkpoint with fused ("fused") or per-expert ("per-expert") experts; each built once per run."""
    from support.checkpoint_variants import export_raw_hf, staged
    from support.moe_model import moe_from_dense

    root = _run_dir(tmp_path_factory) / "moe_vlm"

    def factory(layout: str = "fused", dtype: str = "float32") -> Path:
        if layout not in MOE_LAYOUTS:
            raise ValueError(f"layout {layout!r} not in {MOE_LAYOUTS}")
        root.mkdir(exist_ok=True)
        with open(str(root) + ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            mlx = root / f"mlx-{dtype}"
            if not (mlx / "config.json").exists():
                moe_from_dense(TRAINED, mlx, dtype=dtype)
            if layout == "mlx":
                return mlx
            return staged(root / f"{layout}-{dtype}", lambda d: export_raw_hf(mlx, d, dtype=dtype, experts=layout))

    return factory


@pytest.fixture(scope="session")
def tiny_vlm_fp32(tiny_vlm_factory: Callable[..., Path]) -> Path:
    """fp32 tiny Qwen3.5 VLM, MTP head in mtp/weights.safetensors: use it for exactness checks."""
    return tiny_vlm_factory("float32", "subdir")


@pytest.fixture(scope="session")
def tiny_vlm_bf16(tiny_vlm_factory: Callable[..., Path]) -> Path:
    """bf16 tiny Qwen3.5 VLM (the fp32 weights rounded), MTP head in mtp/weights.safetensors."""
    return tiny_vlm_factory("bfloat16", "subdir")


@pytest.fixture(scope="session")
def tiny_vlm_bf16_1k(tiny_vlm_bf16: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bf16 tiny VLM seen with a 1024-token context: a prompt can fill it cheaply (one path per worker, so the
    modules of a work unit share its server)."""
    from support.tiny_model import with_context

    return with_context(tiny_vlm_bf16, tmp_path_factory.getbasetemp() / "context-1k" / tiny_vlm_bf16.name, 1024)


@pytest.fixture(scope="module")
def tiny_text(tiny_vlm_fp32: Path):
    """(the host's mlx-lm TextModel built from the fp32 tiny VLM, without MTP; its tokenizer), per test module."""
    from mlx_vlm import load
    from vllm_mlx.text_model_from_vlm import build_text_model

    vlm, processor = load(str(tiny_vlm_fp32))
    model = build_text_model(vlm, tiny_vlm_fp32, enable_mtp=False)
    assert model is not None
    return model, processor.tokenizer


@pytest.fixture(scope="module")
def tiny(tiny_vlm_fp32: Path):
    """(the plugin's TextBundle from the fp32 tiny VLM, MTP head loaded; its tokenizer), per test module."""
    import json

    from mlx_vlm import load

    from vllm_mlx_mtp_routing.model.text_model import build_text_model

    vlm, processor = load(str(tiny_vlm_fp32))
    bundle = build_text_model(vlm, tiny_vlm_fp32, json.loads((tiny_vlm_fp32 / "config.json").read_text()))
    assert bundle.mtp is not None
    return bundle, processor.tokenizer


@pytest.fixture(scope="session")
def tiny_draft_dir(tiny_vlm_fp32: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A SpecPrefill draft for the tiny model: 2 layers (one full-attention), its tokenizer, other weights."""
    from support.tiny_model import build_tiny_qwen35_vlm

    out = tmp_path_factory.mktemp("draft") / "tiny-draft"
    build_tiny_qwen35_vlm(out, num_layers=2, full_attention_interval=2, mtp_placement="none", tokenizer_from=tiny_vlm_fp32, seed=5)
    return out

