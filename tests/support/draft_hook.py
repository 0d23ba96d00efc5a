"""Drafts as a controlled input: a proposer whose drafts a hook may replace (tests and benchmarks force acceptance
with it). A row whose drafts the hook changes counts them as deterministic (q = one-hot), which keeps speculative
sampling exact for any proposal."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx

from vllm_mlx_mtp_routing.model.mtp import MTPHead
from vllm_mlx_mtp_routing.text_engine.batch_cache import RaggedKVCache
from vllm_mlx_mtp_routing.text_engine.sampling import RowSampler
from vllm_mlx_mtp_routing.text_engine.spec.mtp import MTPDecode
from vllm_mlx_mtp_routing.text_engine.spec.mtp_rows import MTPRowState
from vllm_mlx_mtp_routing.text_engine.spec.proposer import MTPProposer, Proposal

# (histories, drafts) -> drafts. histories[i]: row i's prompt + generated tokens (its last token is the one it feeds
# now); drafts[i]: the head's k drafts, or None for a row not drafting.
DraftHook = Callable[[list[list[int]], list[list[int] | None]], list[list[int] | None]]


class HookedProposer(MTPProposer):
    """The head's proposer, its drafts passed through ``hook`` (settable: None proposes as the head does)."""

    def __init__(self, head: MTPHead, k: int, hook: DraftHook | None, **options: Any) -> None:
        super().__init__(head, k, **options)
        self.hook = hook

    def propose(
        self, k: int, rows: Sequence[MTPRowState], cache: list[RaggedKVCache], drafting: list[bool],
        samplers: Sequence[RowSampler],
    ) -> Proposal:
        proposal = super().propose(k, rows, cache, drafting, samplers)
        if self.hook is None:
            return proposal
        proposed = proposal.drafts.tolist()
        new = self.hook([list(r.history) for r in rows], [p if d else None for p, d in zip(proposed, drafting)])
        V = self.head.backbone.args.vocab_size
        qs = dict(proposal.qs)
        for i, d in enumerate(drafting):
            if d and list(new[i]) != proposed[i]:
                proposed[i] = list(new[i])
                if not samplers[i].greedy:  # the hook's own tokens: a point mass at each
                    qs[i] = (mx.arange(V)[None, :] == mx.array(proposed[i])[:, None]).astype(mx.float32)
        return Proposal(mx.array(proposed, dtype=mx.uint32), qs, proposal.caught_up)


def hooked_decode(head: MTPHead, hook: DraftHook | None, k: int = 1, **options: Any) -> MTPDecode:
    """``MTPDecode(head, k, **options)`` drafting through ``hook`` (``decode.proposer.hook`` can be changed later)."""
    proposer_options = {o: options.pop(o) for o in ("hidden_state_mode", "resume_window", "prompt_pairs") if o in options}
    return MTPDecode(head, k, proposer=HookedProposer(head, k, hook, **proposer_options), **options)
