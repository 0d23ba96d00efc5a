"""The gated-delta decoder layer's compiled one-token step (model/kernels/compiled_decode.py).

fp32 tiny Qwen3.5: the layer's tail the verify runs (``layer_tail``) is mlx-lm's, gated-delta and attention layers
alike; the compiled layer gives, bit for bit, the output and the [conv, recurrent] state of mlx-lm's own layer, step
after step, alone and in a batch; the verify's compiled layer gives the uncompiled verify's logits and captured
states, through a rollback; the engine on the plugin's text model (compiled layers) decodes the tokens mlx-lm's
``stream_generate`` decodes on the host's (uncompiled) text model; calls the compiled step does not serve (a prompt
chunk, a masked or length-tracking cache) run mlx-lm's call.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import stream_generate

from scheduling import run_schedule
from vllm_mlx_mtp_routing.model.backbone import backbone_forward, rollback_rows
from vllm_mlx_mtp_routing.model.kernels.compiled_decode import CompiledDecoderLayer, layer_tail
from vllm_mlx_mtp_routing.model.mlx_lm_internals import ArraysCache, DecoderLayer
from vllm_mlx_mtp_routing.text_engine.sampling import SamplingOptions


def _linear_layers(model):
    return [layer for layer in model.model.layers if layer.is_linear]


def test_the_plugins_text_model_takes_the_compiled_layer_on_the_cpu(tiny):
    bundle, _ = tiny
    layers = bundle.model.model.layers
    assert all(type(layer) is CompiledDecoderLayer for layer in layers if layer.is_linear)
    assert all(type(layer) is DecoderLayer for layer in layers if not layer.is_linear)  # mlx-lm's: nothing compiled


def test_the_layer_tail_is_mlx_lms_layer_bit_for_bit(tiny):
    bundle, _ = tiny
    rng = np.random.default_rng(0)
    H = bundle.model.args.hidden_size
    for layer in bundle.model.model.layers[:4]:  # gated-delta and attention layers
        x = mx.array(rng.normal(size=(2, 3, H)).astype(np.float32))
        if layer.is_linear:
            ours, ref = ArraysCache(size=2), ArraysCache(size=2)
            r = layer.linear_attn(layer.input_layernorm(x), None, ours)
        else:
            ours = ref = None
            r = layer.self_attn(layer.input_layernorm(x), None, ours)
        got = layer_tail(layer, x, r)
        want = DecoderLayer.__call__(layer, x, None, ref)
        assert mx.array_equal(got, want).item()


@pytest.mark.parametrize("batch", [1, 3])
def test_the_compiled_step_is_mlx_lms_layer_bit_for_bit(tiny, batch):
    bundle, _ = tiny
    layer = _linear_layers(bundle.model)[1]
    lin = layer.linear_attn
    rng = np.random.default_rng(batch)
    H = bundle.model.args.hidden_size
    conv = mx.array(rng.normal(size=(batch, lin.conv_kernel_size - 1, lin.conv_dim)).astype(np.float32))
    state = mx.array(rng.normal(size=(batch, lin.num_v_heads, lin.head_v_dim, lin.head_k_dim)).astype(np.float32))
    ours, ref = ArraysCache(size=2), ArraysCache(size=2)
    ours[0], ours[1], ref[0], ref[1] = conv, state, conv, state
    for _ in range(4):
        x = mx.array(rng.normal(size=(batch, 1, H)).astype(np.float32))
        got = layer(x, None, ours)
        want = DecoderLayer.__call__(layer, x, None, ref)
        assert mx.array_equal(got, want).item()
        assert all(mx.array_equal(a, b).item() for a, b in zip(ours.state, ref.state))
    assert layer.__dict__.get("_step") is not None  # the compiled step ran


def test_the_compiled_verify_is_the_uncompiled_verify_through_rollbacks(tiny):
    bundle, _ = tiny
    model = bundle.model
    linear = _linear_layers(model)

    def run(compiled: bool) -> list:
        for layer in linear:
            layer.__class__ = CompiledDecoderLayer if compiled else DecoderLayer
        cache = model.make_cache()
        model(mx.array([[5, 6, 7, 8, 9], [9, 8, 7, 6, 5]]), cache=cache)
        seen = []
        for t, keep in enumerate([[1, 2], [2, 1], [1, 1]]):
            logits, hidden, captured = backbone_forward(model, mx.array([[10 + t, 20 + t], [30 + t, 40 + t]]), cache,
                                                        capture=True)
            rollback_rows(cache, captured, keep, 2)
            mx.eval(logits, hidden, [c.state for c in cache])
            seen += [logits, hidden, *[a for c in cache for a in c.state]]
        return seen

    try:
        want, got = run(False), run(True)
    finally:
        for layer in linear:
            layer.__class__ = CompiledDecoderLayer
    assert len(want) == len(got) and all(mx.array_equal(a, b).item() for a, b in zip(want, got))
    assert all(layer.__dict__.get("_verify_steps") for layer in linear)  # the compiled verify ran


def test_calls_the_step_does_not_serve_run_mlx_lms_layer(tiny):
    bundle, _ = tiny
    layer = _linear_layers(bundle.model)[0]
    H = bundle.model.args.hidden_size
    chunk = ArraysCache(size=2)
    out = layer(mx.ones((1, 3, H)), None, chunk)  # a prompt chunk from an empty cache
    assert out.shape == (1, 3, H) and chunk[1] is not None
    lengths = ArraysCache(size=2)
    lengths[0], lengths[1] = chunk[0], chunk[1]
    lengths.lengths = mx.array([1])
    want = ArraysCache(size=2)
    want[0], want[1], want.lengths = chunk[0], chunk[1], mx.array([1])
    x = mx.ones((1, 1, H))
    assert mx.array_equal(layer(x, None, lengths), DecoderLayer.__call__(layer, x, None, want)).item()


@pytest.mark.parametrize("length", [1, 9, 40])
def test_engine_on_compiled_layers_decodes_mlx_lms_tokens(tiny, tiny_text, length):
    bundle, tok = tiny
    host_model, _ = tiny_text  # the host's text model: mlx-lm's own layers, uncompiled
    assert not any(type(layer) is CompiledDecoderLayer for layer in host_model.model.layers)
    prompt = np.random.default_rng(length).integers(10, 3000, size=length).tolist()
    n = 12
    ref = [r.token for r in stream_generate(host_model, tok, prompt, max_tokens=n, prefill_step_size=16)]
    jobs = [(0, prompt, SamplingOptions(max_tokens=n)), (1, prompt[: max(1, length // 2)], SamplingOptions(max_tokens=n))]
    finals, _ = run_schedule(bundle.model, tok, jobs, max_num_seqs=2, prefill_step_size=16)
    assert finals[0].token_ids[: len(ref)] == ref
