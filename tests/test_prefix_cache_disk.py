"""The prefix cache's disk tier (--ssd-cache-dir): snapshots evicted from memory spill to files and
come back exactly (greedy output with a disk hit equals the output without any cache, fp32 tiny
Qwen3.5), system prefixes are written through and survive a restart, the disk budget evicts files,
and damaged or foreign files are skipped, never served."""

from __future__ import annotations

import argparse

import numpy as np
import pytest

from scheduling import run_schedule
from vllm_mlx_mtp_routing.model.weights_fingerprint import fingerprint
from vllm_mlx_mtp_routing.plugin_api.errors import FlagError
from vllm_mlx_mtp_routing.prefix_cache import settings
from vllm_mlx_mtp_routing.prefix_cache.cache import PrefixCache
from vllm_mlx_mtp_routing.prefix_cache.disk_tier import DiskTier
from vllm_mlx_mtp_routing.text_engine.sampling import SamplingOptions

MB = 1 << 20


def _tokens(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(10, 3000, size=n).tolist()


SYSTEM = _tokens(40, 11)
USERS = [_tokens(12, 20 + i) for i in range(5)]
OPTS = SamplingOptions(max_tokens=8)


def run(bundle, tok, prompt, cache=None, marks=None, salt=None):
    job = (0, prompt, OPTS, marks or [], salt)
    finals, _ = run_schedule(bundle.model, tok, [job], max_num_seqs=2, prefill_step_size=16, prefix_cache=cache)
    return finals[0]


def tier(bundle, path, budget=10**9) -> DiskTier:
    return DiskTier(path, budget, fingerprint(bundle.model))


def test_system_prefix_survives_a_restart(tiny, tmp_path):
    bundle, tok = tiny
    first = PrefixCache(bundle.model, 64 * MB, disk=tier(bundle, tmp_path))
    run(bundle, tok, SYSTEM + USERS[0], first, marks=[(len(SYSTEM), "system")])
    assert first.disk.stats()["written"] == 1  # the system block, written through
    # A new process: memory empty, the index rebuilt from the files' headers.
    again = PrefixCache(bundle.model, 64 * MB, disk=tier(bundle, tmp_path))
    assert again.disk.stats()["entries"] == 1 and again.stats()["entries"] == 0
    prompt = SYSTEM + USERS[1]
    out = run(bundle, tok, prompt, again)
    assert out.cached_tokens == len(SYSTEM)
    assert out.token_ids == run(bundle, tok, prompt).token_ids
    stats = again.stats()
    assert stats["disk_hits"] == 1 and stats["disk"]["loaded"] == 1 and stats["entries"] >= 1  # back in memory


def test_a_salted_snapshot_is_read_back_into_its_salt_only(tiny, tmp_path):
    bundle, tok = tiny
    first = PrefixCache(bundle.model, 64 * MB, disk=tier(bundle, tmp_path))
    run(bundle, tok, SYSTEM + USERS[0], first, marks=[(len(SYSTEM), "system")], salt="tenant-a")
    assert first.disk.stats()["written"] == 1  # the system block, written through in tenant-a's space
    (path,) = first.disk.dir.glob("*.safetensors")
    assert b"tenant-a" not in path.read_bytes()  # a digest of the salt, never the salt
    again = PrefixCache(bundle.model, 64 * MB, disk=tier(bundle, tmp_path))  # a restart: the index from the headers
    prompt = SYSTEM + USERS[1]
    assert run(bundle, tok, prompt, again, salt="tenant-b").cached_tokens == 0
    assert run(bundle, tok, prompt, again).cached_tokens == 0
    out = run(bundle, tok, prompt, again, salt="tenant-a")
    assert out.cached_tokens == len(SYSTEM) and again.stats()["disk_hits"] == 1
    assert out.token_ids == run(bundle, tok, prompt).token_ids


def test_evicted_snapshots_spill_and_come_back_exactly(tiny, tmp_path):
    bundle, tok = tiny
    probe = PrefixCache(bundle.model, 64 * MB)
    run(bundle, tok, USERS[0] + USERS[1], probe)
    one = max(e.nbytes for e in probe.tree.entries())
    cache = PrefixCache(bundle.model, int(1.5 * one), disk=tier(bundle, tmp_path))  # room for about one
    firsts = [USERS[i] + USERS[(i + 1) % 5] for i in range(4)]
    outs = [run(bundle, tok, p, cache) for p in firsts]
    stats = cache.stats()
    assert stats["evictions"] >= 2 and stats["disk"]["written"] >= 2
    assert stats["bytes"] <= cache.budget_bytes
    # The first conversation's next turn: its end-of-generation/prompt snapshot is on disk only now.
    follow = firsts[0] + outs[0].token_ids + USERS[4]
    out = run(bundle, tok, follow, cache)
    assert out.cached_tokens >= len(firsts[0])
    assert cache.stats()["disk_hits"] >= 1
    assert out.token_ids == run(bundle, tok, follow).token_ids


def test_disk_budget_evicts_files(tiny, tmp_path):
    bundle, tok = tiny
    probe = PrefixCache(bundle.model, 64 * MB, disk=tier(bundle, tmp_path / "probe"))
    run(bundle, tok, SYSTEM + USERS[0], probe, marks=[(len(SYSTEM), "system")])
    size = probe.disk.stats()["bytes"]
    disk = tier(bundle, tmp_path / "small", budget=int(2.5 * size))
    cache = PrefixCache(bundle.model, 64 * MB, disk=disk)
    for i in range(5):
        run(bundle, tok, _tokens(40, 100 + i) + USERS[i], cache, marks=[(40, "system")])
    stats = disk.stats()
    files = list(disk.dir.glob("*.safetensors"))
    assert stats["evictions"] >= 3 and len(files) == stats["entries"] <= 2
    assert sum(f.stat().st_size for f in files) == stats["bytes"] <= stats["budget_bytes"]


def test_damaged_and_foreign_files_are_skipped(tiny, tmp_path, caplog):
    bundle, tok = tiny
    first = PrefixCache(bundle.model, 64 * MB, disk=tier(bundle, tmp_path))
    run(bundle, tok, SYSTEM + USERS[0], first, marks=[(len(SYSTEM), "system")])
    (first.disk.dir / "foreign.safetensors").write_bytes(b"not a safetensors file")
    again = PrefixCache(bundle.model, 64 * MB, disk=tier(bundle, tmp_path))
    assert again.disk.stats()["entries"] == 1 and "skipping foreign.safetensors" in caplog.text
    for f in again.disk.dir.glob("*.safetensors"):
        if f.name != "foreign.safetensors":
            f.write_bytes(f.read_bytes()[:100])  # truncated after indexing
    prompt = SYSTEM + USERS[2]
    out = run(bundle, tok, prompt, again)
    assert out.cached_tokens == 0 and out.token_ids == run(bundle, tok, prompt).token_ids
    assert again.disk.stats()["read_errors"] == 1 and again.disk.stats()["entries"] == 0


def test_another_model_uses_another_directory(tiny, tmp_path):
    bundle, _ = tiny
    import mlx.core as mx

    first = tier(bundle, tmp_path)
    w = bundle.model.model.embed_tokens.weight
    bundle.model.model.embed_tokens.weight = w + 1
    try:
        assert tier(bundle, tmp_path).dir != first.dir
    finally:
        bundle.model.model.embed_tokens.weight = w
    mx.eval(w)


@pytest.mark.parametrize(("flags", "flag"), [({"ssd_cache_max_gb": 0.0}, "--ssd-cache-max-gb"),
                                             ({"ssd_cache_max_gb": float("nan")}, "--ssd-cache-max-gb"),
                                             ({"ssd_cache_dir": "FILE"}, "--ssd-cache-dir")])
def test_bad_ssd_flags_name_the_flag(tmp_path, flags, flag):
    (tmp_path / "file").write_text("x")
    values = {"ssd_cache_dir": str(tmp_path / "d"), "ssd_cache_max_gb": 10.0, "cache_memory_mb": 64}
    values.update(flags)
    if values["ssd_cache_dir"] == "FILE":
        values["ssd_cache_dir"] = str(tmp_path / "file")
    with pytest.raises(FlagError) as e:
        settings.from_args(argparse.Namespace(**values))
    assert flag in str(e.value)


def test_ssd_flags_read_with_the_hosts_defaults(tmp_path):
    s = settings.from_args(argparse.Namespace(ssd_cache_dir=str(tmp_path / "ssd"), cache_memory_mb=64))
    assert s.ssd_dir == str(tmp_path / "ssd") and s.ssd_budget_bytes == 10 * 10**9
    assert settings.from_args(argparse.Namespace(cache_memory_mb=64)).ssd_dir is None


def test_twenty_distinct_long_prompts_stay_within_both_budgets(tiny, tmp_path):
    """Bounded memory over many prompts: 20 distinct long prompts through a cache that holds about
    three of them in memory and six on disk (each prompt leaves two entries: ~40 through room for ~13);
    after every request both tiers are within budget, every eviction is counted, and the disk holds
    exactly the files its index names."""
    bundle, tok = tiny
    probe = PrefixCache(bundle.model, 64 * MB)
    run(bundle, tok, _tokens(120, 999), probe)
    one = sum(e.nbytes for e in probe.tree.entries())
    cache = PrefixCache(bundle.model, 3 * one, disk=tier(bundle, tmp_path, budget=6 * one))
    for i in range(20):
        run(bundle, tok, _tokens(120, 1000 + i), cache)
        stats = cache.stats()
        assert stats["bytes"] <= stats["budget_bytes"]
        assert stats["disk"]["bytes"] <= stats["disk"]["budget_bytes"]
    stats = cache.stats()
    assert stats["evictions"] >= 30 and stats["disk"]["evictions"] >= 20 and stats["entries"] > 0
    assert len(list(cache.disk.dir.glob("*.safetensors"))) == stats["disk"]["entries"] > 0
