"""Admission counts the prefix cache's growth while requests run as resident memory."""

from __future__ import annotations

import asyncio

from vllm_mlx_mtp_routing.admission import AdmissionController
from vllm_mlx_mtp_routing.admission.memory_model import Projection

MB = 1 << 20


class PerToken:
    def project_parts(self, prompt_tokens: int, max_tokens: int) -> Projection:
        return Projection((prompt_tokens + max_tokens) * MB, 0)


def test_cache_growth_after_the_baseline_counts_as_used():
    active = {"v": 100 * MB}
    cache = {"v": 10 * MB}
    ctl = AdmissionController(budget_bytes=1000 * MB, max_running=4, max_queue=4, queue_timeout_s=None,
                              memory_model=PerToken(), active_memory=lambda: active["v"])
    ctl.cache_bytes = lambda: cache["v"]

    async def run():
        first = await ctl.acquire(prompt_tokens=300, max_tokens=100)  # baseline 100 MB (10 MB of it cache)
        assert ctl.stats()["prefix_cache_bytes"] == 10 * MB
        # 100 + 400 reserved + 400 projected = 900 <= 1000: fits
        assert ctl._fits(400 * MB)
        # the cache grows by 200 MB while the first request runs; live memory has not shown it yet
        cache["v"] = 210 * MB
        assert not ctl._fits(400 * MB)  # 100 + 200 + 400 + 400 > 1000
        assert ctl._fits(300 * MB)
        first.release()
        # idle again: the baseline is measured afresh (live memory now includes the cache)
        active["v"] = 300 * MB
        second = await ctl.acquire(prompt_tokens=300, max_tokens=100)
        assert ctl._resident() == 300 * MB
        second.release()

    asyncio.run(run())
