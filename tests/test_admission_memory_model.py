"""MemoryModel against real prefills of the tiny Qwen3.5 VLM (mlx-vlm language model, MLX CPU).

Tolerances, stated once:
  * the projected persistent KV + state equals the allocated bytes of the cache make_cache() built
    (KV buffers at their full 256-token-step capacity, conv and recurrent state): exact;
  * active memory grows after the prefill by that plus less than 64 KiB (model-side bookkeeping);
  * the peak during the prefill (mx.get_peak_memory) is at most the projection, and the
    projection is within 2x of that peak (an upper bound that is not wildly loose).
"""

from __future__ import annotations

import asyncio
import json

import mlx.core as mx
import pytest

from vllm_mlx_mtp_routing.admission import AdmissionController, MemoryModel, device_memory_bytes
from vllm_mlx_mtp_routing.admission.memory_model import KV_STEP

KiB = 1 << 10


def cache_bytes(cache) -> int:
    """Allocated bytes (whole buffers, not the filled views that `.state` returns)."""
    total = 0
    for c in cache:
        arrays = [c.keys, c.values] if hasattr(c, "keys") else list(c.cache)
        total += sum(a.nbytes for a in arrays if a is not None)
    return total


def prefill(lm, cache, tokens: mx.array, step: int) -> None:
    """Chunked prefill as mlx-lm does it: evaluate the cache, and the last row of logits."""
    for s in range(0, tokens.shape[1], step):
        out = lm(tokens[:, s : s + step], cache=cache)
        mx.eval([c.state for c in cache], out.logits[:, -1])
        del out


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def tiny_lm(request, tiny_vlm_factory):
    from mlx_vlm import load

    path = tiny_vlm_factory(request.param)
    model, _ = load(str(path))
    lm = model.language_model
    mx.eval(lm.parameters())
    config = json.loads((path / "config.json").read_text())
    return lm, config, request.param


@pytest.mark.parametrize("prompt_tokens", [300, 1300])
def test_projection_matches_real_prefill(tiny_lm, prompt_tokens):
    lm, config, dtype = tiny_lm
    step = 512  # three chunks for 1300 tokens: exercises KV growth across chunks
    # The VLM's language model has no MTP cache and this prefill decodes nothing.
    mm = MemoryModel.from_model_config(config, prefill_step_size=step, include_mtp=False, draft_tokens=0)
    assert mm.dtype_bytes == (4 if dtype == "float32" else 2)
    tokens = mx.random.randint(0, 1000, (1, prompt_tokens))
    mx.eval(tokens)

    mx.clear_cache()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    cache = lm.make_cache()
    prefill(lm, cache, tokens, step)
    mx.clear_cache()
    growth = mx.get_active_memory() - base
    peak = mx.get_peak_memory() - base

    persistent = mm.kv_capacity_tokens(prompt_tokens, 0) * mm.kv_bytes_per_token + mm.state_bytes
    assert cache_bytes(cache) == persistent
    assert 0 <= growth - persistent < 64 * KiB, (growth, persistent)
    projected = mm.project(prompt_tokens, 0)
    assert peak <= projected <= 2 * peak, (peak, projected)


def test_kv_capacity_follows_kvcache_growth(tiny_lm):
    lm, config, _ = tiny_lm
    mm = MemoryModel.from_model_config(config, prefill_step_size=100, include_mtp=False, draft_tokens=0)
    cache = lm.make_cache()
    prefill(lm, cache, mx.zeros((1, 250), dtype=mx.int32), 100)  # chunks 100, 100, 50
    for _ in range(40):  # decode-shaped single-token writes
        mx.eval([c.state for c in cache], lm(mx.zeros((1, 1), dtype=mx.int32), cache=cache).logits)
    kv = next(c for c in cache if hasattr(c, "keys"))
    assert kv.keys.shape[2] == mm.kv_capacity_tokens(250, 40)
    assert mm.kv_capacity_tokens(250, 40) == 512  # one 256 step for the prompt, one more while decoding


def test_counts_for_a_qwen35_shaped_config():
    """Hand-checked numbers for a Qwen3.5-27B-shaped config (64 layers, every 4th full attention)."""
    config = {
        "model_type": "qwen3_5",
        "text_config": {
            "num_hidden_layers": 64, "full_attention_interval": 4, "hidden_size": 5120,
            "intermediate_size": 17408, "vocab_size": 248320, "num_attention_heads": 24,
            "num_key_value_heads": 4, "head_dim": 256, "linear_num_key_heads": 16,
            "linear_num_value_heads": 48, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
            "linear_conv_kernel_dim": 4, "mtp_num_hidden_layers": 1, "dtype": "bfloat16",
            "layer_types": ["linear_attention"] * 3 + ["full_attention"],  # too short: only warned about
        },
    }
    mm = MemoryModel.from_model_config(config, delta_scan_block=0)
    assert (mm.num_full_attention_layers, mm.num_linear_layers, mm.num_mtp_layers) == (16, 48, 1)
    assert mm.kv_bytes_per_token == 17 * 2 * 4 * 256 * 2  # 68 KiB per token
    conv_dim = 2 * 16 * 128 + 48 * 128
    assert mm.state_bytes == 48 * (3 * conv_dim * 2 + 48 * 128 * 128 * 4)  # ~147 MiB per request
    no_mtp = MemoryModel.from_model_config(config, include_mtp=False, delta_scan_block=0)
    assert mm.kv_bytes_per_token - no_mtp.kv_bytes_per_token == 2 * 4 * 256 * 2
    # the last chunk's logits alone: 2048 x 248320 bf16 ~ 0.95 GiB
    assert mm.prefill_working_set(2048) > 2048 * 248320 * 2
    proj = mm.project_parts(8000, 2000)
    assert proj.persistent_bytes >= mm.kv_capacity_tokens(8000, 2000) * mm.kv_bytes_per_token + mm.state_bytes
    # chunks 2048 x 3 + 1856 -> 8192 slots; 2000 new + 1 draft token -> 8 more steps of 256
    assert mm.kv_capacity_tokens(8000, 2000) == 8192 + 8 * KV_STEP


def test_plain_attention_config_has_no_recurrent_state():
    mm = MemoryModel.from_model_config(
        {"num_hidden_layers": 4, "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 100}
    )
    assert mm.num_full_attention_layers == 4 and mm.state_bytes == 0
    assert mm.kv_bytes_per_token == 4 * 2 * 4 * 16 * 2


def test_device_memory_on_this_machine():
    n, source = device_memory_bytes()
    assert n > 0
    if mx.default_device().type == mx.cpu:
        assert source in ("physical-ram", "cgroup-limit")


def test_long_prompt_burst_over_a_small_budget_queues_and_all_finish(tiny_lm):
    """Real prefills and decode steps under a budget that fits one prefill and one more request."""
    lm, config, _ = tiny_lm
    step, prompt, new = 512, 600, 8  # two prefill chunks each (was 1000: the same two chunks, a longer second)
    mm = MemoryModel.from_model_config(config, prefill_step_size=step, include_mtp=False, draft_tokens=0)
    mx.clear_cache()
    base = mx.get_active_memory()
    proj = mm.project_parts(prompt, new)
    # Room for one prefill plus one more decoding request: the working set dominates this model.
    budget = base + proj.total_bytes + int(1.5 * proj.persistent_bytes)
    ctl = AdmissionController(budget_bytes=budget, max_running=8, max_queue=8, queue_timeout_s=None,
                              memory_model=mm, poll_interval_s=0.01)
    tokens = mx.random.randint(0, 1000, (1, prompt))
    running, most_running, finished = 0, 0, []

    async def request(i: int) -> None:
        nonlocal running, most_running
        async with ctl.admit(prompt_tokens=prompt, max_tokens=new) as ticket:
            running += 1
            most_running = max(most_running, running)
            cache = lm.make_cache()
            prefill(lm, cache, tokens, step)
            ticket.prefill_done()
            y = mx.zeros((1, 1), dtype=mx.int32)
            for _ in range(new):
                y = mx.argmax(lm(y, cache=cache).logits[:, -1:], axis=-1).astype(mx.int32)
                mx.eval(y)
                await asyncio.sleep(0)  # let the other requests interleave
            del cache
            running -= 1
            finished.append(i)

    mx.reset_peak_memory()

    async def burst():  # four: at most two run, the others queue until one finishes (six only repeated that)
        await asyncio.gather(*(request(i) for i in range(4)))

    asyncio.run(burst())
    s = ctl.stats()
    assert sorted(finished) == list(range(4))
    assert s["admitted"] == 4 and s["rejected"] == 0 and s["cancelled"] == 0
    assert most_running == 2  # the rest queued until a request finished
    assert s["queue_wait_p99_s"] > 0 and s["running"] == 0 and s["reserved_bytes"] == 0
    assert mx.get_peak_memory() <= budget
