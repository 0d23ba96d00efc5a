"""The package's one device check (model/kernels/device.py): read at each call, never at import."""

from __future__ import annotations

from types import SimpleNamespace

import mlx.core as mx

from vllm_mlx_mtp_routing.model.kernels import device
from vllm_mlx_mtp_routing.text_engine.batch_cache import RaggedKVCache, default_group_overhead


def test_the_cpu() -> None:
    assert mx.default_device().type == mx.cpu  # the suite runs MLX on the CPU
    assert device.kind() == "cpu"
    assert not (device.on_cuda() or device.on_metal() or device.on_gpu())


def test_read_at_each_call(monkeypatch) -> None:
    monkeypatch.setattr(mx, "default_device", lambda: SimpleNamespace(type=mx.gpu))
    for backend in ("cuda", "metal"):
        monkeypatch.setattr(device, "_gpu_backend", lambda backend=backend: backend)
        assert device.kind() == backend and device.on_gpu()
        assert device.on_cuda() == (backend == "cuda") and device.on_metal() == (backend == "metal")
    # the attention split's default follows the device of the moment, not the one at import
    assert RaggedKVCache.group_overhead is None and default_group_overhead() == 0
    monkeypatch.undo()
    assert default_group_overhead() == 1024
