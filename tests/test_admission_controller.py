"""AdmissionController: ordering, release on every exit path, 503/413 decisions, stats, metrics.

Memory here is an injected counter (`Memory`) so decisions are exact; the projection against real
prefills is in test_admission_memory_model.py. No test asserts on elapsed time.
"""

from __future__ import annotations

import asyncio
import gc

import pytest

from vllm_mlx_mtp_routing.admission import AdmissionController, guard_stream, register_metrics
from vllm_mlx_mtp_routing.admission.memory_model import Projection
from vllm_mlx_mtp_routing.plugin_api.errors import RequestRejected

MB = 1 << 20


class Memory:
    """A stand-in for mx.get_active_memory() that tests move by hand."""

    def __init__(self, value: int = 100 * MB) -> None:
        self.value = value

    def __call__(self) -> int:
        return self.value


class PerToken:
    """Projection = 1 MiB per token (prompt + max), half of it prefill working set."""

    def project_parts(self, prompt_tokens: int, max_tokens: int) -> Projection:
        half = (prompt_tokens + max_tokens) * MB // 2
        return Projection(half, half)


def make(memory: Memory | None = None, **kw) -> AdmissionController:
    args = dict(budget_bytes=1000 * MB, max_running=1, max_queue=16, queue_timeout_s=None,
                policy="fifo", memory_model=PerToken(), active_memory=memory or Memory(),
                poll_interval_s=0.01)
    args.update(kw)
    return AdmissionController(**args)


async def until(cond, steps: int = 1000) -> None:
    for _ in range(steps):
        if cond():
            return
        await asyncio.sleep(0)
    raise AssertionError("condition never became true")


async def admission_order(policy: str, requests: list[dict]) -> list[int]:
    """Hold the only slot, queue `requests` in order, free the slot, return the admission order."""
    ctl = make(policy=policy)
    blocker = await ctl.acquire(prompt_tokens=1, max_tokens=1)
    order: list[int] = []

    async def one(i: int, req: dict) -> None:
        ticket = await ctl.acquire(**req)
        order.append(i)
        ticket.release()  # hands the slot to the next in policy order

    tasks = []
    for i, req in enumerate(requests):
        tasks.append(asyncio.create_task(one(i, req)))
        await until(lambda i=i: ctl.stats()["queued"] == i + 1)
    blocker.release()
    await asyncio.gather(*tasks)
    assert ctl.stats()["running"] == 0 and ctl.stats()["reserved_bytes"] == 0
    return order


REQS = [
    dict(prompt_tokens=50, max_tokens=10, priority=0),
    dict(prompt_tokens=5, max_tokens=5, priority=1),
    dict(prompt_tokens=30, max_tokens=0, priority=5),
    dict(prompt_tokens=5, max_tokens=5, priority=5),
    dict(prompt_tokens=1, max_tokens=1, priority=-3),
]


def test_fifo_admits_in_arrival_order():
    assert asyncio.run(admission_order("fifo", REQS)) == [0, 1, 2, 3, 4]


def test_shortest_first_orders_by_prompt_plus_max_tokens_then_arrival():
    # sizes 60, 10, 30, 10, 2: the two 10s keep arrival order
    assert asyncio.run(admission_order("shortest-first", REQS)) == [4, 1, 3, 2, 0]


def test_priority_orders_higher_first_then_arrival():
    assert asyncio.run(admission_order("priority", REQS)) == [2, 3, 1, 0, 4]


def test_strict_order_a_big_head_is_not_overtaken():
    async def main():
        ctl = make(max_running=8, budget_bytes=200 * MB + 100 * MB, policy="fifo")
        a = await ctl.acquire(prompt_tokens=100, max_tokens=0)  # 100 MiB of 200 free
        big = asyncio.create_task(ctl.acquire(prompt_tokens=150, max_tokens=0))
        await until(lambda: ctl.stats()["queued"] == 1)
        small = asyncio.create_task(ctl.acquire(prompt_tokens=10, max_tokens=0))  # would fit, must wait
        await until(lambda: ctl.stats()["queued"] == 2)
        assert not big.done() and not small.done()
        a.release()
        t_big = await big
        t_small = await small
        assert t_big.id < t_small.id
        t_big.release(), t_small.release()

    asyncio.run(main())


def test_release_on_completion_exception_and_double_release():
    async def main():
        ctl = make(max_running=2)
        async with ctl.admit(prompt_tokens=10, max_tokens=10) as t:
            assert ctl.stats()["running"] == 1 and ctl.stats()["reserved_bytes"] == 20 * MB
        assert t.released and ctl.stats()["running"] == 0 and ctl.stats()["reserved_bytes"] == 0

        with pytest.raises(ValueError):
            async with ctl.admit(prompt_tokens=10, max_tokens=10):
                raise ValueError("generation failed")
        assert ctl.stats()["running"] == 0 and ctl.stats()["reserved_bytes"] == 0

        t = await ctl.acquire(prompt_tokens=3, max_tokens=3)
        t.release()
        t.release()
        s = ctl.stats()
        assert s["running"] == 0 and s["reserved_bytes"] == 0 and s["completed"] == 3

    asyncio.run(main())


def test_prefill_done_returns_the_working_set():
    async def main():
        ctl = make(max_running=4)
        t = await ctl.acquire(prompt_tokens=10, max_tokens=10)
        assert ctl.stats()["reserved_bytes"] == 20 * MB
        t.prefill_done()
        t.prefill_done()
        assert ctl.stats()["reserved_bytes"] == 10 * MB
        t.release()
        assert ctl.stats()["reserved_bytes"] == 0

    asyncio.run(main())


def test_cancel_while_queued_withdraws_the_request():
    async def main():
        ctl = make()
        a = await ctl.acquire(prompt_tokens=1, max_tokens=1)
        b = asyncio.create_task(ctl.acquire(prompt_tokens=1, max_tokens=1))
        await until(lambda: ctl.stats()["queued"] == 1)
        b.cancel()
        with pytest.raises(asyncio.CancelledError):
            await b
        assert ctl.stats()["queued"] == 0 and ctl.stats()["cancelled"] == 1
        a.release()
        c = await ctl.acquire(prompt_tokens=1, max_tokens=1)  # the slot is free, not leaked to b
        assert ctl.stats()["running"] == 1
        c.release()
        assert ctl.stats()["running"] == 0 and ctl.stats()["reserved_bytes"] == 0

    asyncio.run(main())


def test_cancel_while_running_releases():
    async def main():
        ctl = make()
        started = asyncio.Event()

        async def handler():
            async with ctl.admit(prompt_tokens=5, max_tokens=5):
                started.set()
                await asyncio.Event().wait()  # a stream the client abandons

        task = asyncio.create_task(handler())
        await started.wait()
        assert ctl.stats()["running"] == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert ctl.stats()["running"] == 0 and ctl.stats()["reserved_bytes"] == 0

    asyncio.run(main())


def test_cancel_right_after_admission_releases_the_new_ticket():
    async def main():
        ctl = make()
        a = await ctl.acquire(prompt_tokens=1, max_tokens=1)
        b = asyncio.create_task(ctl.acquire(prompt_tokens=1, max_tokens=1))
        await until(lambda: ctl.stats()["queued"] == 1)
        a.release()  # admits b, but b's task has not resumed yet
        assert ctl.stats()["running"] == 1
        b.cancel()
        with pytest.raises(asyncio.CancelledError):
            await b
        assert ctl.stats()["running"] == 0 and ctl.stats()["reserved_bytes"] == 0

    asyncio.run(main())


def test_release_from_another_thread_wakes_the_waiter():
    async def main():
        ctl = make()
        a = await ctl.acquire(prompt_tokens=1, max_tokens=1)
        b = asyncio.create_task(ctl.acquire(prompt_tokens=1, max_tokens=1))
        await until(lambda: ctl.stats()["queued"] == 1)
        await asyncio.to_thread(a.release)
        (await b).release()

    asyncio.run(main())


def test_guard_stream_releases_when_done_failed_or_never_started():
    async def body(fail: bool = False):
        yield "a"
        if fail:
            raise RuntimeError("engine error")
        yield "b"

    async def main():
        ctl = make(max_running=3)
        t1 = await ctl.acquire(prompt_tokens=1, max_tokens=1)
        assert [x async for x in guard_stream(t1, body())] == ["a", "b"]
        assert t1.released

        t2 = await ctl.acquire(prompt_tokens=1, max_tokens=1)
        with pytest.raises(RuntimeError):
            async for _ in guard_stream(t2, body(fail=True)):
                pass
        assert t2.released

        t3 = await ctl.acquire(prompt_tokens=1, max_tokens=1)
        stream = guard_stream(t3, body())  # client gone before the response body ever ran
        del stream
        gc.collect()
        assert t3.released
        assert ctl.stats()["running"] == 0

    asyncio.run(main())


def test_queue_full_is_503_with_retry_after():
    async def main():
        ctl = make(max_queue=1)
        a = await ctl.acquire(prompt_tokens=1, max_tokens=1)
        b = asyncio.create_task(ctl.acquire(prompt_tokens=1, max_tokens=1))
        await until(lambda: ctl.stats()["queued"] == 1)
        with pytest.raises(RequestRejected) as err:
            await ctl.acquire(prompt_tokens=1, max_tokens=1)
        assert err.value.status_code == 503 and err.value.retry_after >= 1
        assert "--scheduler-max-queue" in err.value.message
        a.release()
        (await b).release()
        assert ctl.stats()["rejected_by_reason"]["queue_full"] == 1

    asyncio.run(main())


def test_max_queue_zero_still_admits_when_there_is_room():
    async def main():
        ctl = make(max_queue=0)
        a = await ctl.acquire(prompt_tokens=1, max_tokens=1)
        with pytest.raises(RequestRejected) as err:
            await ctl.acquire(prompt_tokens=1, max_tokens=1)
        assert err.value.status_code == 503
        a.release()

    asyncio.run(main())


def test_queue_timeout_is_503_and_frees_the_queue():
    now = [0.0]

    async def main():
        ctl = make(queue_timeout_s=30.0, clock=lambda: now[0])
        a = await ctl.acquire(prompt_tokens=1, max_tokens=1)
        b = asyncio.create_task(ctl.acquire(prompt_tokens=1, max_tokens=1))
        await until(lambda: ctl.stats()["queued"] == 1)
        now[0] += 31.0  # the waiter notices on its next poll
        with pytest.raises(RequestRejected) as err:
            await b
        assert err.value.status_code == 503 and err.value.retry_after >= 1
        assert "--scheduler-queue-timeout" in err.value.message
        s = ctl.stats()
        assert s["queued"] == 0 and s["rejected_by_reason"]["queue_timeout"] == 1 and s["cancelled"] == 0
        a.release()

    asyncio.run(main())


def test_never_fits_is_413_even_when_idle():
    async def main():
        mem = Memory(100 * MB)
        ctl = make(mem, budget_bytes=400 * MB, max_running=4)
        with pytest.raises(RequestRejected) as err:
            await ctl.acquire(prompt_tokens=250, max_tokens=60)  # 310 MiB > 400 - 100
        assert err.value.status_code == 413 and err.value.retry_after is None
        assert "max_tokens" in err.value.message
        t = await ctl.acquire(prompt_tokens=250, max_tokens=50)  # exactly the 300 MiB left
        t.release()
        s = ctl.stats()
        assert s["rejected_by_reason"]["too_large"] == 1 and s["queued"] == 0 and s["admitted"] == 1

    asyncio.run(main())


def test_live_memory_counts_once_with_reservations():
    async def main():
        mem = Memory(100 * MB)
        ctl = make(mem, budget_bytes=350 * MB, max_running=8)
        a = await ctl.acquire(prompt_tokens=100, max_tokens=0)
        mem.value += 90 * MB  # a's cache materializing inside its reservation
        b = await ctl.acquire(prompt_tokens=100, max_tokens=0)  # live + reserved would say 390 > 350
        c = asyncio.create_task(ctl.acquire(prompt_tokens=100, max_tokens=50))
        await until(lambda: ctl.stats()["queued"] == 1)
        b.release()
        t_c = await c
        assert ctl.stats()["reserved_bytes"] == 250 * MB
        for t in (a, t_c):
            t.release()

    asyncio.run(main())


def test_untracked_memory_blocks_until_it_is_freed():
    async def main():
        mem = Memory(100 * MB)
        ctl = make(mem, budget_bytes=400 * MB, max_running=8)
        a = await ctl.acquire(prompt_tokens=50, max_tokens=0)
        mem.value = 340 * MB  # something outside the controller holds memory
        b = asyncio.create_task(ctl.acquire(prompt_tokens=50, max_tokens=50))
        await until(lambda: ctl.stats()["queued"] == 1)
        await asyncio.sleep(0.05)  # several polls: still no room
        assert not b.done()
        mem.value = 150 * MB  # freed without any release: the poll notices
        (await b).release()
        a.release()
        async with ctl.admit(prompt_tokens=1, max_tokens=1):
            pass
        s = ctl.stats()
        assert s["running"] == 0 and s["baseline_bytes"] == 150 * MB  # re-measured while idle

    asyncio.run(main())


def test_memory_bound_burst_queues_and_all_finish():
    async def main():
        mem = Memory(100 * MB)
        ctl = make(mem, budget_bytes=100 * MB + 250 * MB, max_running=16, max_queue=16)
        running, peak_running, done = 0, 0, []

        async def client(i: int):
            nonlocal running, peak_running
            async with ctl.admit(prompt_tokens=80, max_tokens=20) as t:
                running += 1
                peak_running = max(peak_running, running)
                for _ in range(3):
                    await asyncio.sleep(0)
                running -= 1
                done.append(t.id)

        await asyncio.gather(*(client(i) for i in range(10)))
        s = ctl.stats()
        assert len(done) == 10 and peak_running == 2
        assert s["admitted"] == 10 and s["rejected"] == 0 and s["running"] == 0 and s["queued"] == 0
        assert s["queue_wait_p99_s"] >= s["queue_wait_p50_s"] >= 0

    asyncio.run(main())


def test_stats_and_prometheus_metrics_register_once():
    from prometheus_client import CollectorRegistry

    async def main():
        ctl = make(max_queue=0, headroom_bytes=2 << 30)
        a = await ctl.acquire(prompt_tokens=4, max_tokens=4)
        with pytest.raises(RequestRejected):
            await ctl.acquire(prompt_tokens=4, max_tokens=4)
        return ctl, a

    ctl, a = asyncio.run(main())
    s = ctl.stats()
    for key in ("admitted", "rejected", "queued", "running", "reserved_bytes", "budget_bytes", "policy",
                "headroom_gb", "queue_wait_p50_s", "queue_wait_p95_s", "queue_wait_p99_s"):
        assert key in s
    assert (s["admitted"], s["rejected"], s["running"], s["headroom_gb"]) == (1, 1, 1, 2.0)

    registry = CollectorRegistry()
    first = register_metrics(ctl, registry)
    assert register_metrics(ctl, registry) is first  # no duplicate-timeseries error
    p = "vllm_mlx_mtp_routing_admission_"
    samples = scrape(registry)
    assert samples[(p + "admitted_total", ())] == 1
    assert samples[(p + "rejected_total", (("reason", "queue_full"),))] == 1
    assert samples[(p + "running", ())] == 1
    assert samples[(p + "reserved_bytes", ())] == 8 * MB
    assert samples[(p + "policy_info", (("policy", "fifo"),))] == 1
    assert (p + "queue_wait_seconds", (("quantile", "0.99"),)) in samples
    assert samples[(p + "queued", ())] == 0 and samples[(p + "enqueued_total", ())] == 0
    a.release()
    assert scrape(registry)[(p + "running", ())] == 0


def scrape(registry) -> dict:
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(generate_latest(registry).decode())
        for s in fam.samples
    }


def test_register_metrics_defaults_to_the_host_registry():
    from vllm_mlx.metrics import metrics as host_metrics

    was_enabled = host_metrics.enabled
    host_metrics.configure(enabled=True)
    try:
        ctl = make()
        collector = register_metrics(ctl)
        assert collector is not None and register_metrics(make()) is collector
        samples = scrape(host_metrics._prom["registry"])
        assert samples[("vllm_mlx_mtp_routing_admission_budget_bytes", ())] == 1000 * MB
    finally:
        host_metrics._enabled = was_enabled


def test_retry_after_follows_the_measured_drain_rate() -> None:
    from vllm_mlx_mtp_routing.admission.refusals import DrainRate

    now = [0.0]
    drain = DrainRate(lambda: now[0])
    assert drain.retry_after(queued=3, running=2, mean_run_s=None, oldest_running_s=7.2) == 8  # no history
    assert drain.retry_after(queued=3, running=2, mean_run_s=4.0, oldest_running_s=0) == 8  # 2 slots / 4 s
    for t in (10.0, 10.5, 11.0, 11.5, 12.0):  # 2 completions per second
        now[0] = t
        drain.completed()
    assert drain.retry_after(queued=9, running=4, mean_run_s=4.0, oldest_running_s=0) == 5  # 10 ahead / 2 per s
    now[0] = 100.0  # the window has gone stale: back to the slots over the mean run time
    assert drain.retry_after(queued=9, running=4, mean_run_s=4.0, oldest_running_s=0) == 10


def test_refusals_log_once_per_burst_with_a_count(caplog: pytest.LogCaptureFixture) -> None:
    import logging

    from vllm_mlx_mtp_routing.admission.refusals import BURST_GAP_S, BurstLog

    now = [0.0]
    log = BurstLog(lambda: now[0])
    with caplog.at_level(logging.INFO, logger="vllm_mlx_mtp_routing.admission"):
        for i in range(40):
            now[0] = i * 0.01
            log.refused("queue_full", "server busy")
        now[0] += BURST_GAP_S
        log.flush()
    lines = [r for r in caplog.records if r.name == "vllm_mlx_mtp_routing.admission"]
    assert len(lines) == 2 and all(r.levelname == "INFO" for r in lines)
    assert "40 requests refused" in lines[1].getMessage() and "40 queue_full" in lines[1].getMessage()
