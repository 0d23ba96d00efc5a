"""The prefill calibration kept across starts, per model weights, device, software and settings.

``prefill_budget.calibrate`` times the loaded model at every start: a fraction of a second for a small model on
a GPU, seconds for a large quantized one on a CPU, and each start measures a slightly different chunk under a
different load, so a restarted server could cut prompts at other chunk boundaries. A start that finds a
calibration measured for the same weights (weights_fingerprint.py, as the prefix cache's disk tier), device, library versions, plugin
code, ``--prefill-step-size`` and ``--prefill-stall-ratio`` reuses it: the same chunk across restarts.
``--prefill-recalibrate`` measures again and replaces it; ``--prefill-calibration-file none`` keeps nothing.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import logging
import os
import platform
import time
from dataclasses import asdict, fields
from importlib import metadata
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from .prefill_budget import MIN_CHUNK, PROBE_LARGE, PROBE_SMALL, PrefillBudget, calibrate

logger = logging.getLogger(__name__)

ENV_VAR = "VLLM_MLX_PREFILL_CALIBRATION_FILE"
KEEP = 64
_PACKAGES = ("mlx", "mlx-lm", "mlx-vlm", "vllm-mlx", "vllm-mlx-mtp-routing")


def default_path() -> Path | None:
    if value := os.environ.get(ENV_VAR):
        return Path(value)
    try:
        cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    except RuntimeError:  # no home directory to be found
        logger.warning("mtp-routing: no home directory for the prefill calibration file: it is measured at every start")
        return None
    return Path(cache) / "vllm-mlx-mtp-routing" / "prefill-calibration.json"


def _version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "-"


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor()


@functools.cache
def _plugin_code() -> str:
    """A hash of this package's source: a change of the engine's forward or of the calibration measures again."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for f in sorted(root.rglob("*.py")):
        h.update(f.relative_to(root).as_posix().encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:16]


def device_identity() -> dict[str, Any]:
    """What the timings depend on besides the model: the device, the CPUs this process may use, the libraries (and
    this plugin's code)."""
    info: dict[str, Any] = {}
    with contextlib.suppress(Exception):  # older MLX, or a backend without it
        info = {k: v for k, v in mx.device_info().items() if isinstance(v, (str, int, float))}
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"device": str(mx.default_device()), "device_info": info, "machine": platform.machine(), "cpu": _cpu_model(),
            "cpus": cpus, "versions": {name: _version(name) for name in _PACKAGES}, "plugin_code": _plugin_code()}


def calibration_key(weights: str, *, max_chunk: int, ratio: float, device: dict[str, Any]) -> str:
    settings = {"max_chunk": max_chunk, "ratio": ratio, "probes": [PROBE_SMALL, PROBE_LARGE, MIN_CHUNK]}
    text = json.dumps({"weights": weights, "settings": settings, "device": device}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def _read(path: Path, *, quiet: bool = False) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        if not quiet:
            logger.warning("mtp-routing: prefill calibration file %s unreadable (%s): measuring", path, exc)
        return {}
    return data if isinstance(data, dict) else {}


def _budget(entry: Any) -> PrefillBudget | None:
    names = {f.name for f in fields(PrefillBudget)} - {"stored_at"}
    try:
        values = {k: entry["budget"][k] for k in names}
        values["layer_kinds"] = tuple(bool(k) for k in values["layer_kinds"])  # JSON keeps a list
        return PrefillBudget(**values, stored_at=str(entry["measured_at"]))
    except (KeyError, TypeError, ValueError):
        return None


def _store(path: Path, key: str, entry: dict[str, Any]) -> None:
    """Add ``entry`` under ``key``, keeping what other servers stored meanwhile (a lock beside the file) and the
    ``KEEP`` most recent entries (each upgrade or model adds one)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        entries = _read(path, quiet=True)
        entries[key] = entry
        newest = sorted(entries, key=lambda k: str(entries[k].get("measured_at", "")) if isinstance(entries[k], dict) else "")
        entries = {k: entries[k] for k in newest[-KEEP:]}
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(entries, indent=1, sort_keys=True) + "\n")
        os.replace(tmp, path)


_UNMEASURED = "not measured: the model's forward failed"


def _measured(model: nn.Module, *, max_chunk: int, ratio: float, vocab_size: int) -> PrefillBudget:
    """``calibrate``'s budget; where the model cannot run a forward on this device, one line saying so and the
    fixed chunk (its requests fail as they would on the host, and the server still starts)."""
    try:
        return calibrate(model, max_chunk=max_chunk, ratio=ratio, vocab_size=vocab_size)
    except Exception as exc:  # noqa: BLE001 - whatever the device refuses, said in one line instead of a traceback
        logger.error(
            "mtp-routing: the text model's forward fails on this device (%s: %s): text requests will fail with it; "
            "the prefill chunk stays --prefill-step-size %d (no calibration)",
            type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "", max_chunk,
        )
        return PrefillBudget(max_chunk, max_chunk, 0.0, 0.0, 0.0, 0.0, 0.0, stored_at=_UNMEASURED)


def calibrated(
    model: nn.Module, *, max_chunk: int, ratio: float, vocab_size: int, path: Path | None, remeasure: bool = False,
    weights: str | None = None,
) -> PrefillBudget:
    """The stored calibration for this model, device and settings, else ``calibrate``'s, stored in ``path``
    (None: measured, not stored). ``weights``: the model's fingerprint (computed here when not given)."""
    if path is None or ratio <= 0 or max_chunk <= MIN_CHUNK:  # nothing stored, or nothing to measure
        return _measured(model, max_chunk=max_chunk, ratio=ratio, vocab_size=vocab_size)
    if weights is None:
        from ..model.weights_fingerprint import fingerprint

        weights = fingerprint(model)
    key = calibration_key(weights, max_chunk=max_chunk, ratio=ratio, device=device_identity())
    if not remeasure and (budget := _budget(_read(path).get(key))) is not None:
        logger.info(
            "mtp-routing: text prefill chunk %d tokens, as measured on %s for these weights, device and flags "
            "(a decode step %.1f ms; %s; --prefill-recalibrate measures again)",
            budget.chunk_tokens, budget.stored_at, budget.decode_step_s * 1e3, path,
        )
        return budget
    budget = _measured(model, max_chunk=max_chunk, ratio=ratio, vocab_size=vocab_size)
    if budget.stored_at == _UNMEASURED:
        return budget
    entry = {"budget": {k: v for k, v in asdict(budget).items() if k != "stored_at"},
             "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    try:
        _store(path, key, entry)
    except OSError as exc:
        logger.warning("mtp-routing: cannot keep the prefill calibration in %s (%s): it is measured at every start",
                       path, exc)
    return budget


def from_flag(value: str | None) -> Path | None:
    """``--prefill-calibration-file``: the file (its folder must be usable), or None for 'none'."""
    from ..plugin_api.errors import FlagError

    if value is not None and value.strip().lower() == "none":
        return None
    if not value:  # the default may sit in a read-only home: that start measures and says so, it does not fail
        return default_path()
    path = Path(value)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.is_dir() or not os.access(path.parent, os.W_OK):
            raise PermissionError("not a writable file path")
    except OSError as exc:
        raise FlagError("--prefill-calibration-file", f"cannot keep calibrations in {value!r}: {exc}") from exc
    return path
