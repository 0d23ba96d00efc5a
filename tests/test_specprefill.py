"""SpecPrefill in the text engine on the real tiny fp32 models: the positioned forward against
mlx-lm's own attention, sparse keeping everything equal to dense, the per-request and threshold
decisions, a scoring error falling back to dense, the prefix-cache composition, MTP after a
sparse prefill, and the chunk selection."""

from __future__ import annotations

import logging

import mlx.core as mx
import numpy as np
import pytest

from vllm_mlx_mtp_routing.model.backbone import lm_head
from vllm_mlx_mtp_routing.model.mlx_lm_internals import KVCache
from vllm_mlx_mtp_routing.specprefill import RequestChoice, SpecPrefill, SpecPrefillSettings, prefill_sparse
from vllm_mlx_mtp_routing.specprefill.scoring import select_chunks
from vllm_mlx_mtp_routing.specprefill.sparse_prefill import SparsePrefill, positioned_forward
from vllm_mlx_mtp_routing.text_engine.runner import prefill_forward
from vllm_mlx_mtp_routing.text_engine.sampling import SamplingOptions
from vllm_mlx_mtp_routing.text_engine.scheduler import BatchScheduler
from vllm_mlx_mtp_routing.text_engine.spec.mtp import MTPDecode
from vllm_mlx_mtp_routing.text_engine.state import PrefillState, TextRequest

OPTS = SamplingOptions(max_tokens=10)
PROMPT = mx.random.randint(10, 3000, (260,), key=mx.random.key(1)).tolist()


@pytest.fixture(scope="module")
def draft(tiny_draft_dir):
    from mlx_lm import load

    return load(str(tiny_draft_dir))[0]


def run(sched: BatchScheduler, requests: list[TextRequest], restored: list[PrefillState | None] | None = None) -> dict:
    for r, s in zip(requests, restored or [None] * len(requests)):
        sched.add(r, restored=s)
    done = {}
    while sched.has_work():
        for out in sched.step():
            if out.finished:
                done[out.request_id] = out
    return done


def dense_tokens(bundle, tok, prompt, mtp: bool = False) -> list[int]:
    decode = MTPDecode(bundle.mtp, k=1) if mtp else None
    return run(BatchScheduler(bundle.model, tok, prefill_step_size=64, decode=decode), [TextRequest("d", prompt, OPTS)])["d"].token_ids


def _dense_head(bundle, prompt):
    state = PrefillState()
    state.backbone = bundle.model.make_cache()
    decode = MTPDecode(bundle.mtp, k=1)
    for start in range(0, len(prompt) - 1, 64):
        prefill_forward(bundle.model, decode.proposer, mx.array(prompt[start : min(start + 64, len(prompt) - 1)])[None], state)
    return state.head


class _RopeAtCache(KVCache):
    """mlx-lm's KVCache whose RoPE offset (``offset``, what the attention reads) is set per run of
    consecutive kept tokens while the keys are appended densely: a reference through mlx-lm's own
    attention for the positioned forward."""

    held = 0

    def update_and_fetch(self, keys, values):
        position, self.offset = self.offset, self.held
        out = super().update_and_fetch(keys, values)
        self.held, self.offset = self.offset, position + keys.shape[2]
        return out


def test_positioned_forward_matches_mlx_lm_attention_at_the_kept_positions(tiny):
    bundle, _ = tiny
    model = bundle.model
    kept = [*range(0, 40), *range(100, 132), *range(200, 259)]
    runs: list[list[int]] = []
    for p in kept:
        runs[-1].append(p) if runs and runs[-1][-1] == p - 1 else runs.append([p])
    ref_cache = model.make_cache()
    for c in ref_cache:
        if type(c) is KVCache:
            c.__class__ = _RopeAtCache
    for r in runs:
        for c in ref_cache:
            if isinstance(c, _RopeAtCache):
                c.offset = r[0]
        ref = model(mx.array([[PROMPT[p] for p in r]]), cache=ref_cache)[0, -1]
    cache = model.make_cache()
    hidden = positioned_forward(model, mx.array([[PROMPT[p] for p in kept]]), mx.array(kept, dtype=mx.int32), cache)
    ours = lm_head(model, hidden[:, -1:])[0, -1]
    assert mx.abs(ours - ref).max().item() < 1e-4
    assert cache[model.model.fa_idx].offset == len(kept)


@pytest.mark.parametrize("mtp", [False, True])
def test_keeping_every_token_is_the_dense_prefill(tiny, mtp):
    bundle, tok = tiny
    state = PrefillState()
    decode = MTPDecode(bundle.mtp, k=1, adaptive=False) if mtp else None  # drafting every step: counts do not follow the clock
    job = SparsePrefill(bundle.model, PROMPT, list(range(len(PROMPT) - 1)), state, chunk_tokens=48,
                        head=bundle.mtp if mtp else None)
    while not job.done:
        job.advance()
    out = run(BatchScheduler(bundle.model, tok, prefill_step_size=64, decode=decode), [TextRequest("s", PROMPT, OPTS)], [state])["s"]
    dense_decode = MTPDecode(bundle.mtp, k=1, adaptive=False) if mtp else None
    dense = run(BatchScheduler(bundle.model, tok, prefill_step_size=64, decode=dense_decode), [TextRequest("d", PROMPT, OPTS)])["d"]
    assert out.token_ids == dense.token_ids
    if mtp:  # the head's cache is the dense one too: the same drafts are made and accepted
        assert out.mtp_drafted > 0 and (out.mtp_drafted, out.mtp_accepted) == (dense.mtp_drafted, dense.mtp_accepted)
        n = state.head[0].offset
        assert mx.allclose(state.head[0].keys[..., :n, :], _dense_head(bundle, PROMPT)[0].keys[..., :n, :], atol=1e-5)


def test_opt_out_and_threshold_stay_dense_forced_and_long_go_sparse(tiny, draft):
    bundle, tok = tiny
    sp = SpecPrefill(draft, SpecPrefillSettings(threshold=200, keep_pct=0.3))
    short = PROMPT[:150]
    sched = BatchScheduler(bundle.model, tok, prefill_step_size=64, specprefill=sp)
    out = run(sched, [
        TextRequest("off", PROMPT, OPTS, specprefill=RequestChoice(enabled=False)),
        TextRequest("short", short, OPTS),
        TextRequest("long", PROMPT, OPTS),
        TextRequest("forced", short, OPTS, specprefill=RequestChoice(enabled=True, keep_pct=0.5)),
    ])
    assert out["off"].token_ids == dense_tokens(bundle, tok, PROMPT)
    assert out["short"].token_ids == dense_tokens(bundle, tok, short)
    m = sp.metrics.stats()
    assert m["requests"] == 2 and m["dense"] == {"below_threshold": 1, "opted_out": 1}
    assert m["tokens_scored"] == (len(PROMPT) - 1) + (len(short) - 1)
    # 30% of 259 and 50% of 149, in whole 32-token chunks (the last one short)
    assert m["tokens_kept"] == 3 * 32 + 3 + 2 * 32 + 21 and m["fallbacks"] == 0
    # the engine's sparse prefill is the one-shot helper's
    state, kept = prefill_sparse(bundle.model, draft, PROMPT, 0.3, chunk_tokens=64)
    alone = run(BatchScheduler(bundle.model, tok, prefill_step_size=64), [TextRequest("x", PROMPT, OPTS)], [state])["x"]
    assert alone.token_ids == out["long"].token_ids and len(kept) == 3 * 32 + 3


def test_a_scoring_error_falls_back_to_dense_with_one_log_line(tiny, tiny_draft_dir, caplog):
    from mlx_lm import load

    bundle, tok = tiny
    broken = load(str(tiny_draft_dir))[0]
    attn = broken.language_model.model.layers[1].self_attn
    attn.q_proj.weight = mx.full(attn.q_proj.weight.shape, float("nan"))  # non-finite scores: a real scoring fault
    sp = SpecPrefill(broken, SpecPrefillSettings(threshold=0, keep_pct=0.2))
    with caplog.at_level(logging.INFO, logger="vllm_mlx_mtp_routing.specprefill"):
        out = run(BatchScheduler(bundle.model, tok, prefill_step_size=64, specprefill=sp), [TextRequest("r", PROMPT, OPTS)])["r"]
    assert out.finish_reason == "length" and out.token_ids == dense_tokens(bundle, tok, PROMPT)
    assert sp.metrics.fallbacks == 1 and sp.metrics.requests == 0
    lines = [r for r in caplog.records if "SpecPrefill" in r.getMessage()]
    assert len(lines) == 1 and "dense prefill" in lines[0].getMessage() and lines[0].levelno == logging.WARNING


def test_prefix_cache_keeps_the_system_prompt_dense_scores_only_the_rest_and_stores_no_sparse_state(tiny, draft):
    from vllm_mlx_mtp_routing.prefix_cache.cache import PrefixCache

    bundle, tok = tiny
    cache = PrefixCache(bundle.model, 64 * 2**20, with_head=True)
    sp = SpecPrefill(draft, SpecPrefillSettings(threshold=100, keep_pct=0.25))
    system = PROMPT[:120]
    first = [*system, *PROMPT[120:250]]
    second = [*system, *PROMPT[130:260]]
    sched = BatchScheduler(bundle.model, tok, prefill_step_size=64, decode=MTPDecode(bundle.mtp, k=1), prefix_cache=cache, specprefill=sp)
    # No hit yet: the system prompt is prefilled densely and snapshotted, the rest scored and sparse.
    a = run(sched, [TextRequest("a", first, OPTS, [(120, "system")])])["a"]
    assert a.cached_tokens == 0 and sp.metrics.requests == 1 and sp.metrics.tokens_scored == len(first) - 1 - 120
    stats = cache.stats()
    assert stats["entries"] == 1 and stats["snapshots_saved"] == 1  # the system prompt only: nothing sparse stored
    kept_a = sp.metrics.tokens_kept
    # A hit: the cached system prompt is restored, only the rest is scored and sparse-prefilled.
    b = run(sched, [TextRequest("b", second, OPTS, [(120, "system")])])["b"]
    stats = cache.stats()
    assert b.cached_tokens == 120 and stats["hits"] == 1 and (stats["entries"], stats["snapshots_saved"]) == (1, 1)
    assert sp.metrics.requests == 2 and sp.metrics.tokens_scored == (len(first) - 1 - 120) + (len(second) - 1 - 120)
    # the same as scoring the rest on the restored prefix by hand
    restored = cache.lookup(second, len(second) - 1).state
    state, kept = prefill_sparse(bundle.model, draft, second, 0.25, decode=MTPDecode(bundle.mtp, k=1), chunk_tokens=64, state=restored)
    assert kept[0] >= 120 and len(kept) < len(second) - 121
    alone = run(BatchScheduler(bundle.model, tok, prefill_step_size=64, decode=MTPDecode(bundle.mtp, k=1)), [TextRequest("c", second, OPTS)], [state])
    assert alone["c"].token_ids == b.token_ids and sp.metrics.tokens_kept - kept_a == len(kept)


def test_sparse_rows_decode_beside_dense_rows_as_they_do_alone(tiny, draft):
    bundle, tok = tiny
    sp = SpecPrefill(draft, SpecPrefillSettings(threshold=100, keep_pct=0.2))
    sched = BatchScheduler(bundle.model, tok, prefill_step_size=64, decode=MTPDecode(bundle.mtp, k=2, adaptive=False), specprefill=sp)
    together = run(sched, [TextRequest("dense", PROMPT[:60], OPTS), TextRequest("sparse", PROMPT, OPTS), TextRequest("d2", PROMPT[5:80], OPTS)])
    assert together["dense"].token_ids == dense_tokens(bundle, tok, PROMPT[:60], mtp=True)
    assert together["d2"].token_ids == dense_tokens(bundle, tok, PROMPT[5:80], mtp=True)
    alone = run(BatchScheduler(bundle.model, tok, prefill_step_size=64, decode=MTPDecode(bundle.mtp, k=2, adaptive=False), specprefill=sp),
                [TextRequest("sparse", PROMPT, OPTS)])
    assert alone["sparse"].token_ids == together["sparse"].token_ids and together["sparse"].mtp_drafted > 0


def test_chunk_selection():
    scores = np.zeros(200, dtype=np.float32)
    scores[40:50] = 1.0  # inside chunk 1 (of 7, from position 10)
    kept = select_chunks(scores, 10, 0.3, 0.0, 32)
    chunks = sorted({(p - 10) // 32 for p in kept})
    assert chunks[-1] == 6 and 1 in chunks and len(chunks) == 3  # ceil(7 * 0.3) chunks, the last always
    assert kept == sorted(kept) and kept[-1] == 209 and kept[0] >= 10
    every = select_chunks(scores, 0, 0.3, 0.3, 32)
    assert {p // 32 for p in every} == {0, 3, 6}  # all evenly spaced
    assert select_chunks(scores, 0, 1.0, 0.0, 32) == list(range(200))


def test_scoring_and_sparse_prefill_run_in_pieces_between_decode_steps(tiny, draft):
    bundle, tok = tiny
    sp = SpecPrefill(draft, SpecPrefillSettings(threshold=100, keep_pct=0.3))
    sched = BatchScheduler(bundle.model, tok, prefill_step_size=64, specprefill=sp)
    sched.add(TextRequest("stream", PROMPT[:20], SamplingOptions(max_tokens=200)))
    while not sched.running:
        sched.step()
    sched.add(TextRequest("long", PROMPT, OPTS))
    steps, streamed = 0, 0
    while not any(r.rid == "long" for r in sched.running):
        outs = sched.step()
        steps += 1
        streamed += sum(len(o.new_token_ids) for o in outs if o.request_id == "stream")
        assert steps < 50
    # At most 64 prompt tokens a step (--prefill-step-size), one decode step each: 4 steps of 64 draft tokens, one of
    # the last 3 and the 8 look-ahead tokens, then the 99 kept tokens as 64 + 35, then the join, first thing in a step
    # of its own (a prompt longer than a chunk beside a decoding stream).
    assert steps == 4 + 1 + 2 + 1 and streamed == steps
    assert sp.metrics.requests == 1 and sp.metrics.tokens_kept == 3 * 32 + 3


def test_the_per_request_decision_keeps_the_hosts_meaning():
    from vllm_mlx_mtp_routing.specprefill.settings import decide

    s = SpecPrefillSettings(threshold=100, keep_pct=0.3, backbone_pct=0.1)
    assert decide(s, RequestChoice(), 100) is None and decide(s, RequestChoice(), 101) == (0.3, 0.1)
    assert decide(s, RequestChoice(enabled=False), 10_000) is None
    assert decide(s, RequestChoice(enabled=True), 50) == (0.3, 0.1)  # forced below the threshold
    assert decide(s, RequestChoice(keep_pct=0.05), 500) == (0.05, 0.05)  # backbone share capped at the keep
    assert decide(s, RequestChoice(keep_pct=1.0), 500) is None  # keeping everything is a dense prefill
    assert RequestChoice.from_options({"specprefill": True, "specprefill_keep_pct": 0.2}) == RequestChoice(True, 0.2, None)
    for bad in ({"specprefill_keep_pct": 0}, {"specprefill_keep_pct": 1.5}, {"specprefill_backbone_pct": -0.1},
                {"specprefill": "yes"}, {"specprefill_keep_pct": 0.2, "specprefill_backbone_pct": 0.3}):
        with pytest.raises(ValueError, match="specprefill"):
            RequestChoice.from_options(bad)


def test_the_draft_chunk_is_the_targets_scaled_by_their_sizes():
    from vllm_mlx_mtp_routing.specprefill.scoring import MAX_DRAFT_CHUNK_SCALE, draft_chunk

    assert draft_chunk(2048, 9_000_000_000, 500_000_000) == 2048 * MAX_DRAFT_CHUNK_SCALE == 8192
    assert draft_chunk(2048, 3_000_000_000, 500_000_000) == 2048  # a quarter of 6x rounds down to 1
    assert draft_chunk(512, 4_000_000, 500_000) == 1024
    assert draft_chunk(64, 1_000, 2_000) == 64  # a draft as large as its target never gets smaller chunks


def test_larger_overlapped_draft_chunks_keep_the_same_tokens_alone_and_beside_a_stream(tiny, draft):
    """A draft 4x cheaper per token than its target takes 4x the chunk: one piece a step, planned at the target's cost;
    launched without waiting when no row decodes, waited for while one does. On the CPU the output is that of the
    target's chunk size, alone and beside a decoding stream."""
    bundle, tok = tiny

    def scheduler(scale: int) -> tuple[BatchScheduler, SpecPrefill, list]:
        sp = SpecPrefill(draft, SpecPrefillSettings(threshold=100, keep_pct=0.3))
        sp._params = {id(bundle.model): 4 * scale, id(draft): 1}  # the parameter counts the draft's chunk is sized from
        sched = BatchScheduler(bundle.model, tok, prefill_step_size=64, specprefill=sp)
        pieces: list = []
        run_items = sched.runner.prefill
        sched.runner.prefill = lambda work: pieces.extend(work) or run_items(work)  # type: ignore[method-assign]
        return sched, sp, pieces

    def sparse_pieces(pieces: list) -> list:
        return [p for p in pieces if type(p).__name__ == "SparsePiece"]

    sched, base, pieces = scheduler(1)
    reference = run(sched, [TextRequest("long", PROMPT, OPTS)])
    assert [p.tokens for p in sparse_pieces(pieces)][:4] == [64, 64, 64, 64]  # 64 draft tokens a piece

    sched, big, pieces = scheduler(4)
    alone = run(sched, [TextRequest("long", PROMPT, OPTS)])
    assert [p.tokens for p in sparse_pieces(pieces)][:3] == [64, 1, 2]  # 256 draft tokens, the last 3, the look-ahead's 8
    assert all(p.overlap for p in sparse_pieces(pieces))  # nothing decodes: each launched without waiting
    assert alone["long"].token_ids == reference["long"].token_ids and big.metrics.tokens_kept == base.metrics.tokens_kept

    sched, _, pieces = scheduler(4)
    sched.add(TextRequest("stream", PROMPT[:20], SamplingOptions(max_tokens=200)))
    while not sched.running:
        sched.step()
    sched.add(TextRequest("long", PROMPT, OPTS))
    done: dict = {}
    while "long" not in done:
        done.update({o.request_id: o for o in sched.step() if o.finished})
    assert sparse_pieces(pieces) and not any(p.overlap for p in sparse_pieces(pieces))  # a stream decodes: waited for
    assert done["long"].token_ids == reference["long"].token_ids
