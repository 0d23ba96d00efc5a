"""KV memory follows each row's own length: one 4000-token row beside seven 20-token rows.

The attention KV the batch holds (backbone attention layers and the MTP head's layer) must stay
within 1.25x of what the rows' own lengths need (the dense buffer it replaced gave every row the
longest row's capacity: ~7.6x here), while rows join, decode, roll back drafts and leave.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from vllm_mlx_mtp_routing.text_engine.batch_cache import RaggedKVCache
from vllm_mlx_mtp_routing.text_engine.sampling import SamplingOptions
from vllm_mlx_mtp_routing.text_engine.scheduler import BatchScheduler
from vllm_mlx_mtp_routing.text_engine.spec.mtp import MTPDecode
from vllm_mlx_mtp_routing.text_engine.state import TextRequest


@pytest.fixture(scope="module")
def two_layers(tiny_vlm_fp32: Path, tmp_path_factory: pytest.TempPathFactory):
    """The tiny model's shape with one linear-attention and one full-attention layer (the default has three and one):
    the KV held per attention layer is the same, and the 4000-token prefill runs one gated-delta recurrence, not three
    (on MLX's CPU backend it steps token by token: most of this module's time)."""
    from mlx_vlm import load

    from support.tiny_model import build_tiny_qwen35_vlm
    from vllm_mlx_mtp_routing.model.text_model import build_text_model

    path = tmp_path_factory.mktemp("two-layers") / "model"
    build_tiny_qwen35_vlm(path, num_layers=2, full_attention_interval=2, tokenizer_from=tiny_vlm_fp32)
    vlm, processor = load(str(path))
    bundle = build_text_model(vlm, path, json.loads((path / "config.json").read_text()))
    assert bundle.mtp is not None
    return bundle, processor.tokenizer


def _attention_caches(sched):
    return [c for c in sched.batch.backbone.layers if isinstance(c, RaggedKVCache)] + list(sched.batch.head)


def _own_need(caches) -> int:
    """Bytes the rows' own lengths need: tokens held x bytes per token, per layer."""
    total = 0
    for c in caches:
        if c.empty():
            continue
        k, v = c.state[0], c.state[1]
        per_token = (k.nbytes + v.nbytes) // k.shape[1]
        total += per_token * sum(c.lengths)
    return total


def test_long_row_beside_short_rows_holds_its_own_length(two_layers):
    bundle, tok = two_layers
    rng = np.random.default_rng(0)
    prompts = [rng.integers(10, 3000, size=4000).tolist()] + [rng.integers(10, 3000, size=20).tolist() for _ in range(7)]
    # The head over the whole prompt, as admission projects it (with the default --mtp-prompt-pairs
    # the long row's head holds only its last positions: the projection is then an upper bound)
    sched = BatchScheduler(bundle.model, tok, max_num_seqs=8, prefill_step_size=1024,
                           decode=MTPDecode(bundle.mtp, k=2, adaptive=False, prompt_pairs=None))
    for i, p in enumerate(prompts):
        sched.add(TextRequest(str(i), p, SamplingOptions(max_tokens=24 if i else 40)))
    ratios, dense, peak = [], [], 0
    while sched.has_work():
        sched.step()
        peak = max(peak, sched.batch.nbytes)
        caches = _attention_caches(sched)
        if len(sched.running) == 8:
            need = _own_need(caches)
            held = sum(c.nbytes for c in caches)
            ratios.append(held / need)
            # what one dense buffer at the longest row's capacity held for the same rows
            dense.append(sum(c.state[0].nbytes // c.state[0].shape[1] * 2 * 8 * -(-c.size() // 256) * 256
                             for c in caches) / need)
    print(f"held/need max {max(ratios):.3f} min {min(ratios):.3f}; dense layout {min(dense):.2f}-{max(dense):.2f}")
    assert ratios, "the eight rows never ran together"
    assert max(ratios) <= 1.25, max(ratios)
    assert min(dense) > 4.0  # the layout this replaced
    assert sched.batch.nbytes == 0  # every block returned once the rows left
    # Admission asks the engine: its projection of the rows' caches is within 15% of what they held.
    mm = sched.memory_model()
    projected = sum(mm.row_cache_bytes(len(p), 24 if i else 40) for i, p in enumerate(prompts))
    print(f"projected {projected} measured peak {peak} ({projected / peak:.3f})")
    assert 0.85 <= projected / peak <= 1.15
    assert mm.draft_tokens == 2 and mm.num_mtp_layers == len(bundle.mtp.layers)


def _kv(n, seed, H=2, D=8):
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    c = KVCache()
    k = mx.random.normal((1, H, n, D), key=mx.random.key(seed))
    c.update_and_fetch(k, k + 1)
    return c


def test_blocks_return_and_pool_compacts_with_rows_intact():
    import mlx.core as mx

    kv = RaggedKVCache(whole_buffer=False)
    rows = [_kv(3000, 0), _kv(20, 1), _kv(130, 2)]
    for r in rows:
        kv.add_row(r)
    per_token = kv.used_bytes // sum(-(-n // kv.block) * kv.block for n in kv.lengths)
    assert kv.nbytes <= 1.25 * per_token * sum(kv.lengths)
    # a verify of 3 tokens, two rolled back: the extra block of row 1 goes back at the next filter
    H, D = 2, 8
    kv.update_and_fetch(mx.zeros((3, H, 50, D)), mx.zeros((3, H, 50, D)))
    kv.trim_rows([50, 50, 50])
    big = kv.nbytes
    kv.filter([2, 1])  # the long row leaves: its blocks are freed and the pool compacts
    assert kv.nbytes < big / 5 and kv.lengths == [130, 20]
    for i, r in zip([0, 1], [rows[2], rows[1]]):
        got = kv.extract(i)
        assert mx.array_equal(got.keys, r.keys[..., : r.offset, :])
        assert mx.array_equal(got.values, r.values[..., : r.offset, :])
    kv.add_row(_kv(70, 3))  # reuses free blocks or grows; old rows untouched
    assert mx.array_equal(kv.extract(0).keys, rows[2].keys[..., :130, :])
    assert kv.extract(2).offset == 70


def test_admission_projects_text_requests_with_the_engines_model(tiny, tiny_vlm_fp32):
    from vllm_mlx_mtp_routing.admission import AdmissionController, MemoryModel

    bundle, tok = tiny
    sched = BatchScheduler(bundle.model, tok, prefill_step_size=512, decode=MTPDecode(bundle.mtp, k=3))
    engine_mm = sched.memory_model()
    host_mm = MemoryModel.from_model_config(json.loads((tiny_vlm_fp32 / "config.json").read_text()), include_mtp=False)
    ctl = AdmissionController(budget_bytes=1 << 34, max_running=4, max_queue=4, queue_timeout_s=None,
                              memory_model=host_mm, path_models={"text": engine_mm}, active_memory=lambda: 0)
    assert ctl.projection(3000, 100, path="text") == engine_mm.project_parts(3000, 100)
    assert ctl.projection(3000, 100, path="media") == host_mm.project_parts(3000, 100)
    p = engine_mm.project_parts(3000, 100)
    # k = 3 drafts are counted; the prefill stage's own caches are transient (given back at join)
    assert engine_mm.pooled_kv_tokens(3000, 100) == -(-(3000 + 100 + 3) // 64) * 64
    assert p.transient_bytes >= engine_mm.kv_capacity_tokens(3000, 0) * engine_mm.kv_bytes_per_token


def test_on_joined_runs_once_when_the_row_joins(tiny):
    bundle, tok = tiny
    sched = BatchScheduler(bundle.model, tok, prefill_step_size=16)
    joined = []
    sched.add(TextRequest("a", list(range(10, 60)), SamplingOptions(max_tokens=3),
                           on_joined=lambda: joined.append(len(sched.running))))
    steps = 0
    while sched.has_work():
        sched.step()
        steps += 1
        if steps < 4:  # 49 prompt tokens in 16-token chunks: joins at the 4th step
            assert not joined
    assert joined == [1]
