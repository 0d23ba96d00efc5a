"""A chunk run in pieces of layers across steps: the same caches and outputs as one forward, the stall bound per piece."""

from __future__ import annotations

import numpy as np
import pytest

from vllm_mlx_mtp_routing.prefix_cache.cache import PrefixCache
from vllm_mlx_mtp_routing.text_engine.prefill_budget import ChunkGrid, PrefillBudget
from vllm_mlx_mtp_routing.text_engine.row import Row
from vllm_mlx_mtp_routing.text_engine.runner import ModelRunner
from vllm_mlx_mtp_routing.text_engine.sampling import SamplingOptions
from vllm_mlx_mtp_routing.text_engine.scheduler import BatchScheduler
from vllm_mlx_mtp_routing.text_engine.spec.mtp import MTPDecode
from vllm_mlx_mtp_routing.text_engine.state import TextRequest
from vllm_mlx_mtp_routing.text_engine.step_plan import PrefillChunk

GRID = 64


def _arrays(state) -> list[np.ndarray]:
    out = []
    for c in state.backbone:
        for a in c.state if isinstance(c.state, (list, tuple)) else [c.state]:
            if a is not None:
                out.append(np.array(a))
    return out


def _prefill(model, tok, prompt: list[int], pieces: list[tuple[int, int | None]], decode=None) -> Row:
    """One chunk of ``prompt`` (all but its last token) run as the given layer pieces [(first, last)]."""
    runner = ModelRunner(model, decode)
    row = Row(TextRequest("r", prompt, SamplingOptions(max_tokens=1)), tok, set(), None)
    layers = len(model.model.layers)
    for first, last in pieces:
        (done,) = runner.prefill([PrefillChunk(row, 0, len(prompt) - 1, first, last, layers)])
        assert done.error is None, done.error
    return row


def test_a_chunk_in_pieces_leaves_bitwise_the_caches_of_one_forward(tiny) -> None:
    bundle, tok = tiny
    model = bundle.model
    layers = len(model.model.layers)
    assert layers >= 3
    prompt = np.random.default_rng(1).integers(10, 3000, size=41).tolist()
    for decode in (None, MTPDecode(bundle.mtp, k=2, adaptive=False)):
        whole = _prefill(model, tok, prompt, [(0, None)], decode)
        for pieces in ([(0, 1), (1, None)], [(0, 1), (1, 2), (2, None)], [(0, layers - 1), (layers - 1, None)]):
            split = _prefill(model, tok, prompt, pieces, decode)
            assert split.prefill.partial is None and split.prefill.prefilled == whole.prefill.prefilled == 40
            for a, b in zip(_arrays(whole.prefill), _arrays(split.prefill), strict=True):
                assert a.shape == b.shape and np.array_equal(a, b), pieces
            if decode is not None:  # the MTP head's pairs and hidden state too
                assert np.array_equal(np.array(whole.prefill.head_hidden), np.array(split.prefill.head_hidden))
                for c, d in zip(whole.prefill.head, split.prefill.head, strict=True):
                    assert np.array_equal(np.array(c.keys[..., : c.offset, :]), np.array(d.keys[..., : d.offset, :]))


def test_a_piece_that_does_not_continue_the_chunk_under_way_fails_its_row(tiny) -> None:
    bundle, tok = tiny
    runner = ModelRunner(bundle.model)
    prompt = list(range(10, 40))
    row = Row(TextRequest("r", prompt, SamplingOptions(max_tokens=1)), tok, set(), None)
    layers = len(bundle.model.model.layers)
    (done,) = runner.prefill([PrefillChunk(row, 0, 20, 0, 1, layers)])
    assert done.error is None and row.prefill.partial is not None and row.prefill.prefilled == 0
    (done,) = runner.prefill([PrefillChunk(row, 0, 20, 2, None, layers)])  # skips layer 1
    assert isinstance(done.error, RuntimeError)


class _Pieces:
    """Pieces of one or two layers; projected at a second each, so every measured piece reads as faster."""

    def __init__(self, one: bool = False) -> None:
        self.one, self.scales = one, []

    def piece_end(self, position: int, tokens: int, first: int, scale: float = 1.0, spent_s: float = 0.0) -> int:
        self.scales.append(scale)
        return first + 1 + (0 if self.one else (first + tokens) % 2)

    def piece_s(self, position: int, tokens: int, first: int, end: int) -> float:
        return float(end - first)


def _schedule(model, tok, jobs, *, pieces: bool, decode=None, cache=None, steps_seen=None):
    sched = BatchScheduler(model, tok, max_num_seqs=4, prefill_step_size=256, decode=decode, prefix_cache=cache)
    sched.chunk_grid = ChunkGrid(lambda p: GRID)
    sched.prefill_time_s = (1e-9, 1e-9)  # one item per step
    sched.layer_pieces = _Pieces() if pieces else None
    if steps_seen is not None:
        real = sched.runner.prefill

        def spy(work):
            steps_seen.extend(w for w in work if isinstance(w, PrefillChunk))
            return real(work)

        sched.runner.prefill = spy
    pending, finals, step = list(range(len(jobs))), {}, 0
    while pending or sched.has_work():
        while pending and jobs[pending[0]][0] <= step:
            i = pending.pop(0)
            sched.add(TextRequest(str(i), jobs[i][1], SamplingOptions(max_tokens=jobs[i][2])))
        for out in sched.step():
            if out.finished:
                finals[int(out.request_id)] = out
        step += 1
    return finals, sched


def test_chunks_in_pieces_while_rows_decode_give_the_same_outputs_batched_and_alone(tiny) -> None:
    bundle, tok = tiny
    rng = np.random.default_rng(4)
    jobs = [(0, rng.integers(10, 3000, size=9).tolist(), 24), (2, rng.integers(10, 3000, size=230).tolist(), 6),
            (3, rng.integers(10, 3000, size=75).tolist(), 6)]
    for decode in (None, MTPDecode(bundle.mtp, k=2, adaptive=False)):
        seen: list[PrefillChunk] = []
        split, _ = _schedule(bundle.model, tok, jobs, pieces=True, decode=decode, steps_seen=seen)
        whole, _ = _schedule(bundle.model, tok, jobs, pieces=False, decode=decode)
        assert any(not w.whole for w in seen) and any(w.whole for w in seen)  # pieces while "0" decodes
        for i, (_, prompt, n) in enumerate(jobs):
            alone, _ = _schedule(bundle.model, tok, [(0, prompt, n)], pieces=True, decode=decode)
            assert split[i].token_ids == whole[i].token_ids == alone[0].token_ids, i


def test_an_abort_between_pieces_keeps_no_torn_snapshot_and_a_retry_equals_a_cold_run(tiny) -> None:
    bundle, tok = tiny
    cache = PrefixCache(bundle.model, 64 << 20)
    rng = np.random.default_rng(6)
    runner_up = rng.integers(10, 3000, size=7).tolist()
    long = rng.integers(10, 3000, size=200).tolist()
    sched = BatchScheduler(bundle.model, tok, max_num_seqs=4, prefill_step_size=256, prefix_cache=cache)
    sched.chunk_grid = ChunkGrid(lambda p: GRID)
    sched.prefill_time_s = (1e-9, 1e-9)
    sched.layer_pieces = _Pieces()
    sched.add(TextRequest("a", runner_up, SamplingOptions(max_tokens=200)))
    sched.step()
    sched.add(TextRequest("b", long, SamplingOptions(max_tokens=6)))
    for _ in range(200):  # until "b" stops between the layers of its second chunk
        sched.step()
        row = next((r for r in sched.prefilling if r.rid == "b"), None)
        if row is not None and row.prefill is not None and row.prefill.partial is not None and row.prefilled == GRID:
            break
    else:
        pytest.fail("no piece of a second chunk was seen")
    sched.abort("b")
    sched.abort("a")
    assert not sched.has_work()
    retry, _ = _schedule(bundle.model, tok, [(0, long, 6)], pieces=True, cache=cache)
    cold, _ = _schedule(bundle.model, tok, [(0, long, 6)], pieces=False)
    assert retry[0].cached_tokens == GRID  # where the abort's whole chunks ended, not inside the torn one
    assert retry[0].token_ids == cold[0].token_ids


def test_the_grid_grows_to_the_step_size_where_a_layer_fits_and_pieces_stay_within_the_limit() -> None:
    kinds = (False, False, False, True) * 6  # 24 layers, one in four full attention
    budget = PrefillBudget(chunk_tokens=832, max_chunk_tokens=2048, ratio=3.0, decode_step_s=0.0103,
                           chunk_fixed_s=0.0151, per_token_s=1.9e-5, calibration_s=0.0, layer_kinds=kinds)  # an H100, 2B
    assert budget.chunk_at(0) == 832 and budget.grid_chunk_at(0) == budget.grid_chunk_at(65536) == 2048
    assert PrefillBudget(**{**budget.__dict__, "layer_kinds": ()}).grid_chunk_at(0) == 832  # no layers: whole chunks
    slow = PrefillBudget(chunk_tokens=16, max_chunk_tokens=2048, ratio=3.0, decode_step_s=0.01, chunk_fixed_s=0.03,
                         per_token_s=0.004, calibration_s=0.0, attention_s=6.6e-7, probe_depth=8192,
                         layer_kinds=(False, False, False, True) * 2)  # a CPU: 8 layers
    for p in (0, 1024, 16384, 65536):
        n = slow.grid_chunk_at(p)
        assert n >= slow.chunk_at(p) and max(slow.layer_s(n, p)) <= slow.chunk_limit_s
        assert n >= 2048 or max(slow.layer_s(n + 16, p)) > slow.chunk_limit_s  # the largest that fits
        first = 0
        while first < 8:
            end = slow.piece_end(p, n, first)
            costs = slow.layer_s(n, p)[first:end]
            assert end > first and (len(costs) == 1 or sum(costs) <= slow.chunk_limit_s)
            assert slow.piece_s(p, n, first, end) == pytest.approx(sum(costs))
            assert slow.piece_end(p, n, first, scale=100.0) == first + 1  # pieces measured far slower: one layer
            first = end
    assert slow.grid_chunk_at(16384) > 3 * slow.chunk_at(16384)  # deep in a prompt: the attention layers bound it


def test_calibration_records_the_layers(tiny_text) -> None:
    from vllm_mlx_mtp_routing.text_engine.prefill_budget import calibrate

    model, tok = tiny_text
    budget = calibrate(model, max_chunk=256, ratio=3.0, vocab_size=1000)
    assert budget.layer_kinds == tuple(not layer.is_linear for layer in model.model.layers)
    sched = BatchScheduler(model, tok, max_num_seqs=2, prefill_step_size=256)
    budget.apply(sched)
    assert sched.layer_pieces is not None and sched.chunk_grid.next_end(0) == budget.grid_chunk_at(0)


def test_pieces_measured_slower_than_projected_shrink(tiny) -> None:
    bundle, tok = tiny
    rng = np.random.default_rng(8)
    pieces = _Pieces()
    sched = BatchScheduler(bundle.model, tok, max_num_seqs=4, prefill_step_size=256)
    sched.chunk_grid = ChunkGrid(lambda p: GRID)
    sched.prefill_time_s = (1e-9, 1e-9)
    sched.layer_pieces = pieces
    sched.add(TextRequest("a", rng.integers(10, 3000, size=7).tolist(), SamplingOptions(max_tokens=40)))
    sched.add(TextRequest("b", rng.integers(10, 3000, size=150).tolist(), SamplingOptions(max_tokens=2)))
    while sched.has_work():
        sched.step()
    assert pieces.scales[0] == 1.0 and min(pieces.scales[1:]) < 0.6  # a piece takes far less than its projected second


def test_a_later_piece_in_a_step_gets_only_what_the_budget_leaves() -> None:
    kinds = (False, False, False, True) * 6
    budget = PrefillBudget(chunk_tokens=832, max_chunk_tokens=2048, ratio=3.0, decode_step_s=0.0103,
                           chunk_fixed_s=0.0151, per_token_s=1.9e-5, calibration_s=0.0, layer_kinds=kinds)  # an H100, 2B
    n, limit = budget.grid_chunk_at(0), budget.chunk_limit_s
    whole, half = budget.piece_end(0, n, 0), budget.piece_end(0, n, 0, spent_s=limit / 2)
    assert 1 < half < whole and budget.piece_s(0, n, 0, half) <= limit / 2 < budget.piece_s(0, n, 0, half + 1)
    assert budget.piece_end(0, n, 5, spent_s=2 * limit) == 6  # nothing left: one layer (the step's check refuses it)


class _Recorded(_Pieces):
    """Pieces of one layer projected at ``layer_s`` each; records the prefill already spent when each is planned."""

    def __init__(self, layer_s: float) -> None:
        super().__init__(one=True)
        self.layer_s, self.spent = layer_s, []

    def piece_end(self, position: int, tokens: int, first: int, scale: float = 1.0, spent_s: float = 0.0) -> int:
        self.spent.append(spent_s)
        return super().piece_end(position, tokens, first, scale, spent_s)

    def piece_s(self, position: int, tokens: int, first: int, end: int) -> float:
        return self.layer_s * (end - first)


def _items_per_step(model, tok, pieces: _Recorded, prefill_s: float) -> list[int]:
    """A long prompt prefilled in pieces while a short one decodes; the prefill items each step ran."""
    rng = np.random.default_rng(12)
    sched = BatchScheduler(model, tok, max_num_seqs=4, prefill_step_size=256)
    sched.chunk_grid = ChunkGrid(lambda p: GRID)
    sched.prefill_time_s = (prefill_s, prefill_s)
    sched.layer_pieces = pieces
    seen: list[int] = []
    real = sched.runner.prefill

    def spy(work):
        seen[-1] += len(work)
        return real(work)

    sched.runner.prefill = spy
    sched.add(TextRequest("a", rng.integers(10, 3000, size=7).tolist(), SamplingOptions(max_tokens=60)))
    seen.append(0)
    sched.step()
    sched.add(TextRequest("b", rng.integers(10, 3000, size=150).tolist(), SamplingOptions(max_tokens=2)))
    while sched.has_work():
        seen.append(0)
        sched.step()
    return seen[1:]


def test_a_step_plans_each_piece_after_the_first_with_its_prefill_so_far_and_runs_it_only_where_projected_to_fit(tiny) -> None:
    bundle, tok = tiny
    roomy = _Recorded(layer_s=1e-9)  # a budget of seconds, pieces projected at nothing: several a step
    many = _items_per_step(bundle.model, tok, roomy, prefill_s=1e3)
    assert max(many) > 1
    assert any(s > 0 for s in roomy.spent)  # a later piece of a step knows what the step spent before it
    heavy = _Recorded(layer_s=1e3)  # every piece projected past any step's budget: one a step, however fast it ran
    assert max(_items_per_step(bundle.model, tok, heavy, prefill_s=1.0)) == 1


def test_the_pieces_rate_follows_a_slower_piece_halfway_and_a_faster_one_a_fifth(tiny) -> None:
    bundle, tok = tiny
    sched = BatchScheduler(bundle.model, tok, max_num_seqs=2, prefill_step_size=256)
    sched.layer_pieces = _Recorded(layer_s=1.0)
    piece = PrefillChunk(None, 0, 32, 0, 2, 8)  # type: ignore[arg-type]  # two layers: projected at 2 s
    sched._note_piece(piece, 0.2)  # ten times faster: a fifth of the way there
    assert sched._piece_scale == pytest.approx(0.8 + 0.2 * 0.1)
    sched._note_piece(piece, 4.0)  # slower: half the way
    assert sched._piece_scale == pytest.approx(0.5 * 0.82 + 0.5 * 2.0)
