"""A start-up warm-up of the decode step at each batch size, so that no request pays its one-off compiles.

On MLX's CUDA backend the first decode step at a new batch size costs seconds, plain and MTP verify alike:
kernels are compiled at their first use (the skinny matmul per row count, MLX's own JIT kernels, each operation's
first use in the process). Without a warm-up a server meets each the first time its batch grows to that size, and
every running stream stalls with it.

``run`` steps throwaway rows through the engine's own decode strategy once at each batch size 1..N, one row
joining per size as requests do: a plain step, and with MTP a verify of each draft count the strategy may choose
where it would draft at that size; then a longer row, prefilled in the server's chunks, joins and leaves. Where the
server has a prefix cache, that row's snapshots are taken (one mid-prompt, one at the end of its generation) and a
follow-up request restores one: the first end-of-generation snapshot has first uses of its own, a stall
every stream of a fresh server would meet at its first finished request. The rows live
in a scheduler of their own (its batch caches, counters and step profile; a throwaway prefix cache of the server's
kind, no SpecPrefill) stepping a twin of the strategy (MTP: its own counts and a policy that drafts where told), all
dropped afterwards: nothing is counted, cached or reserved, and no later request's output changes. Short prompts,
greedy, a fixed seed (no draw from the process's random state), no stop token.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import mlx.core as mx

from ..model.kernels.device import on_cuda
from .sampling import SamplingOptions
from .scheduler import BatchScheduler
from .spec.draft_policy import DraftPolicy
from .spec.mtp import MTPDecode
from .state import TextRequest

# The few-row matmul has a kernel per row count in 2..8 (skinny_matmul.MAX_ROWS), past which a step runs MLX's
# general kernels: the warm-up covers every row count that has a kernel of its own.
MAX_BATCH = 8
PROMPT_TOKENS = 4
# The long row: past the KV pool's slack (9 blocks of 64), so that the pool compacts when it leaves.
LONG_ROW_TOKENS = 9 * 64 + 1
SNAPSHOT_BUDGET = 512 << 20  # the throwaway prefix cache's: the long row's two snapshots
MODES = ("auto", "on", "off")


class WarmupError(RuntimeError):
    """A warm-up step failed (the server logs it and serves without the warm-up)."""


class ScriptedDrafts(DraftPolicy):
    """Drafts ``count`` (k unless told) on the steps it is told to (``drafting``) for every row that can, none on
    the others."""

    drafting = False

    def __init__(self, k: int) -> None:
        super().__init__(k, adaptive=False)
        self.count = k

    def draft_count(self, batch: int) -> int:
        return self.count if self.drafting else 0


@dataclass(frozen=True)
class Warmup:
    batch_sizes: list[int]
    draft_tokens: int  # the verify step's drafts at each size that drafts (0: plain steps only)
    verify_batch_sizes: list[int]
    seconds: float
    seconds_by_batch_size: list[float]
    snapshots: int = 0  # taken and restored by the rehearsal's throwaway prefix cache (0, 0: the server has none)
    snapshot_hits: int = 0

    def stats(self) -> dict[str, Any]:
        return asdict(self)


def enabled(mode: str) -> bool:
    """``--text-warmup``: 'auto' is on where the one-off compiles cost seconds, a CUDA GPU (MLX's GPU device where
    Metal is not there), and off on the CPU and Metal."""
    if mode not in MODES:
        raise ValueError(f"text warm-up mode must be one of {MODES}, got {mode!r}")
    if mode != "auto":
        return mode == "on"
    return on_cuda()


def run(scheduler: BatchScheduler, batch_sizes: Sequence[int]) -> Warmup:
    """Step throwaway rows through ``scheduler``'s decode strategy at each of ``batch_sizes`` (ascending), on the
    thread that owns the model; ``scheduler`` itself is only read."""
    tic = time.perf_counter()
    decode, policy = scheduler.spec, None
    if isinstance(decode, MTPDecode):
        policy = ScriptedDrafts(decode.k)
        decode = decode.twin(policy)
    sizes = sorted(batch_sizes)
    try:
        verified, seconds, snapshots = _rehearse(scheduler, decode, policy, sizes)
    finally:
        mx.clear_cache()  # the rehearsal's buffers, released with it, go back to the device
    return Warmup(sizes, decode.k if policy is not None and decode is not None else 0, verified, round(time.perf_counter() - tic, 3), seconds,
                  *snapshots)


def _rehearse(
    scheduler: BatchScheduler, decode: MTPDecode | None, policy: ScriptedDrafts | None, sizes: list[int]
) -> tuple[list[int], list[float], tuple[int, int]]:
    """(sizes that took a verify, seconds per size, (snapshots taken, restored)) of a scheduler of its own, dropped on
    return."""
    cache = scheduler.prefix_cache
    rehearsal = BatchScheduler(
        scheduler.model, scheduler.tokenizer, max_num_seqs=max(sizes, default=1),
        prefill_step_size=scheduler.prefill_step_size, decode=decode,
        prefix_cache=type(cache)(scheduler.model, SNAPSHOT_BUDGET, with_head=cache.with_head) if cache is not None else None,
    )
    rehearsal.eos_ids = set()  # the rows run until they are dropped, whatever they generate
    options = SamplingOptions(max_tokens=1 << 30, seed=0)
    verified, seconds = [], []
    try:
        for B in sizes:
            started = time.perf_counter()
            for i in range(len(rehearsal.running) + len(rehearsal.prefilling) + len(rehearsal.waiting), B):
                rehearsal.add(TextRequest(f"warmup-{i}", [1 + (i + j) % 7 for j in range(PROMPT_TOKENS)], options))
            if policy is not None:
                policy.drafting = False
            while len(rehearsal.running) < B:  # the new rows' prefill and join, then (in the same step) a plain step of B rows
                _check(rehearsal.step(), B)
            # The verify where the server's own policy could draft at this size (--mtp-max-batch-size), at each draft
            # count it may choose: each is a shape of its own.
            if policy is not None and scheduler.spec is not None and scheduler.spec.policy.draft_count(B):
                policy.drafting = True
                for count in scheduler.spec.policy.counts:
                    policy.count = count
                    _check(rehearsal.step(), B)
                verified.append(B)
            mx.synchronize()
            seconds.append(round(time.perf_counter() - started, 4))
        _long_row(rehearsal, scheduler, options, policy)
    finally:
        for row in reversed(list(rehearsal.running)):  # one by one: the batch's shrinking steps too
            rehearsal.abort(row.rid)
        for row in [*rehearsal.prefilling, *rehearsal.waiting]:
            rehearsal.abort(row.rid)
    if rehearsal.prefix_cache is None:
        return verified, seconds, (0, 0)
    rehearsal.finish_delivered()  # the last end-of-generation snapshot
    counts = rehearsal.prefix_cache.saved, rehearsal.prefix_cache.hits
    rehearsal.prefix_cache.clear()
    return verified, seconds, counts


def _long_row(rehearsal: BatchScheduler, scheduler: BatchScheduler, options: SamplingOptions,
              policy: ScriptedDrafts | None) -> None:
    """A longer row prefilled in the server's chunks joins the batch and leaves it: the prefill's chunk shape, and
    the KV pool's growth and compaction as it leaves, have first uses of their own, which warming batch sizes
    alone does not pay."""
    if rehearsal.running:
        rehearsal.abort(rehearsal.running[-1].rid)  # room for it
    rehearsal.prefill_chunk, rehearsal.chunk_grid = scheduler.prefill_chunk, scheduler.chunk_grid
    rehearsal.layer_pieces = scheduler.layer_pieces
    n = max(2 * scheduler.prefill_chunk + 1, LONG_ROW_TOKENS)
    prompt = [1 + j % 7 for j in range(n)]
    if policy is not None:
        policy.drafting = False
    rows = len(rehearsal.running) + 1
    if rehearsal.prefix_cache is None:
        rehearsal.add(TextRequest("warmup-long", prompt, options))
        while len(rehearsal.running) < rows:
            _check(rehearsal.step(), rows)
        rehearsal.abort("warmup-long")
        if rehearsal.running:
            _check(rehearsal.step(), rows - 1)
        return
    # Two tokens, then it finishes as requests do: its end-of-generation snapshot and its leaving; the follow-up
    # restores the mid-prompt one.
    rehearsal.add(TextRequest("warmup-long", prompt, replace(options, max_tokens=2), snapshot_at=[(n // 2, "system")]))
    _until_done(rehearsal, "warmup-long", rows)
    rehearsal.add(TextRequest("warmup-hit", prompt[: n // 2 + 3], replace(options, max_tokens=2)))
    _until_done(rehearsal, "warmup-hit", rows)


def _until_done(rehearsal: BatchScheduler, rid: str, batch: int) -> None:
    while any(r.rid == rid for r in [*rehearsal.waiting, *rehearsal.prefilling, *rehearsal.running]):
        _check(rehearsal.step(), batch)


def _check(outputs: list[Any], batch: int) -> None:
    for out in outputs:
        if out.finish_reason == "error":
            raise WarmupError(f"the decode step at batch size {batch} failed: {out.error}")
