"""folded_attention: short queries attending as single-token queries give what they give unfolded."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest

from scheduling import run_schedule
from vllm_mlx_mtp_routing.folded_attention import folded_sdpa
from vllm_mlx_mtp_routing.text_engine import SamplingOptions
from vllm_mlx_mtp_routing.text_engine.mtp_decode import MTPDecode
from vllm_mlx_mtp_routing.text_model import build_text_model


@pytest.mark.parametrize("Hq,Hkv,L", [(4, 2, 2), (8, 2, 3), (2, 2, 4)])
def test_folded_sdpa_equals_sdpa(Hq, Hkv, L):
    rng = np.random.default_rng(Hq * 10 + L)
    B, T, D = 3, 40, 16
    q = mx.array(rng.standard_normal((B, Hq, L, D)), dtype=mx.float32)
    k = mx.array(rng.standard_normal((B, Hkv, T, D)), dtype=mx.float32)
    v = mx.array(rng.standard_normal((B, Hkv, T, D)), dtype=mx.float32)
    lengths = mx.array([5, 17, T - L])  # per-row slots, each query l sees slots <= length + l
    mask = (mx.arange(T)[None, None, :] <= (lengths[:, None] + mx.arange(L))[:, :, None])[:, None]
    ref = mx.fast.scaled_dot_product_attention(q, k, v, scale=D**-0.5, mask=mask)
    assert mx.allclose(folded_sdpa(q, k, v, D**-0.5, mask), ref, atol=1e-5)


def test_mtp_decode_folded_equals_unfolded(tiny_vlm_fp32):
    """Verify and head steps with folded attention: the same greedy tokens and acceptance."""
    from mlx_vlm import load

    vlm, processor = load(str(tiny_vlm_fp32))
    bundle = build_text_model(vlm, tiny_vlm_fp32, json.loads((tiny_vlm_fp32 / "config.json").read_text()))
    rng = np.random.default_rng(3)
    jobs = [(a, rng.integers(10, 3000, size=n).tolist(), SamplingOptions(max_tokens=12))
            for a, n in zip([0, 0, 2, 4], [3, 20, 9, 300])]

    def go(fold):
        decode = MTPDecode(bundle.mtp, k=2, adaptive=False, fold=fold)
        finals, _ = run_schedule(bundle.model, processor.tokenizer, jobs, max_num_seqs=4,
                                 prefill_step_size=64, decode=decode)
        return {i: f.token_ids for i, f in finals.items()}, decode.stats()["accepted_histogram"]

    assert go(True) == go(False)
