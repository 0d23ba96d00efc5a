"""Drive a BatchScheduler step by step with requests arriving at chosen steps (test helper)."""

from __future__ import annotations

from typing import Any

from vllm_mlx_mtp_routing.text_engine.scheduler import BatchScheduler
from vllm_mlx_mtp_routing.text_engine.state import TextRequest


def run_schedule(
    model: Any, tokenizer: Any, jobs: list, *, max_num_seqs: int, prefill_step_size: int, decode: Any = None, prefix_cache: Any = None,
    chunk_grid: Any = None,
) -> tuple[dict, BatchScheduler]:
    """jobs: [(arrival_step, prompt_ids, SamplingOptions[, snapshot_at[, cache_salt]])] -> ({index: final TextOutput}, scheduler)."""
    sched = BatchScheduler(model, tokenizer, max_num_seqs=max_num_seqs, prefill_step_size=prefill_step_size, decode=decode, prefix_cache=prefix_cache)
    sched.chunk_grid = chunk_grid
    pending = sorted(range(len(jobs)), key=lambda i: jobs[i][0])
    finals, step = {}, 0
    while pending or sched.has_work():
        while pending and jobs[pending[0]][0] <= step:
            i = pending.pop(0)
            salt = jobs[i][4] if len(jobs[i]) > 4 else None
            sched.add(TextRequest(str(i), jobs[i][1], jobs[i][2], *jobs[i][3:4], cache_salt=salt))
        for out in sched.step():
            if out.finished:
                finals[int(out.request_id)] = out
        step += 1
    return finals, sched
