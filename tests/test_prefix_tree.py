"""The token-prefix tree on its own: longest match, edge splits, budget, leaf-first LRU, pins."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from vllm_mlx_mtp_routing.prefix_cache.tree import PrefixTree


@dataclass
class P:
    nbytes: int
    name: str = ""


def test_longest_prefix_and_exact_get():
    t = PrefixTree(1000)
    a = t.insert([1, 2, 3, 4, 5], 3, "system", P(10, "a"))
    b = t.insert([1, 2, 3, 4, 5, 6, 7], 6, "prompt", P(10, "b"), base=a)
    c = t.insert([1, 2, 9, 9], 4, "prompt", P(10, "c"))  # splits the [1,2,3] edge at 2
    assert t.longest([1, 2, 3, 4, 5, 6, 7, 8]) is b
    assert t.longest([1, 2, 3, 4, 5, 6, 7, 8], max_len=5) is a
    assert t.longest([1, 2, 3, 0]) is a
    assert t.longest([1, 2, 9, 9, 9]) is c
    assert t.longest([1, 2, 9, 8]) is None
    assert t.longest([1, 2]) is None
    assert t.longest([7]) is None
    assert t.get([1, 2, 3, 4, 5, 6], 6) is b and t.get([1, 2, 3], 2) is None
    assert b.chain() == [a, b]
    assert t.longest([1, 2, 3, 4, 5, 6, 7], accept=lambda e: e is not b) is a
    assert len(t) == 3 and t.nbytes == 30


def test_insert_existing_prefix_keeps_one_entry_and_raises_its_class():
    t = PrefixTree(1000)
    a = t.insert([1, 2, 3], 3, "prompt", P(10))
    again = t.insert([1, 2, 3, 4], 3, "system", P(10))
    assert again is a and a.kind == "system" and len(t) == 1 and t.nbytes == 10


def test_budget_evicts_lru_leaves_and_keeps_system_longest():
    t = PrefixTree(40)
    sys_ = t.insert([1, 1, 1, 1], 2, "system", P(10))
    old = t.insert([5, 5, 5], 3, "prompt", P(10))
    mid = t.insert([6, 6, 6], 3, "prompt", P(10))
    t.touch(old)  # old is now the most recently used prompt
    new = t.insert([7, 7, 7], 3, "prompt", P(15))  # 45 > 40: evict the LRU prompt (mid)
    assert not mid.alive and old.alive and sys_.alive and new.alive
    assert t.nbytes == 35 and t.stats.evictions == 1
    big = t.insert([8, 8], 2, "message", P(30))  # evicts both prompts, keeps the system entry
    assert big is not None and sys_.alive and not old.alive and not new.alive
    assert t.nbytes == 40
    assert t.longest([5, 5, 5]) is None


def test_base_outlives_its_dependents():
    t = PrefixTree(30)
    a = t.insert([1, 2, 3, 4], 2, "prompt", P(10))
    b = t.insert([1, 2, 3, 4], 4, "prompt", P(10), base=a)
    t.touch(a)  # a is newer, but b depends on it: b must go first
    c = t.insert([9, 9], 2, "prompt", P(15))
    assert c is not None and a.alive and not b.alive
    assert a.dependents == 0
    d = t.insert([8, 8], 2, "prompt", P(15))  # now a (no dependents, LRU) can go
    assert d is not None and not a.alive


def test_pinned_entries_are_not_evicted_and_oversize_is_rejected():
    t = PrefixTree(20)
    a = t.insert([1], 1, "prompt", P(10))
    t.pin(a)
    assert t.insert([2], 1, "prompt", P(15)) is None  # a pinned: no room
    assert t.stats.rejected == 1 and a.alive
    t.unpin(a)
    assert t.insert([2], 1, "prompt", P(15)) is not None and not a.alive
    assert t.insert([3], 1, "prompt", P(21)) is None  # larger than the whole budget
    with pytest.raises(RuntimeError):
        t.unpin(a)


def test_eviction_prunes_and_merges_nodes():
    t = PrefixTree(100)
    a = t.insert([1, 2, 3, 4], 4, "prompt", P(10))
    b = t.insert([1, 2, 5, 6], 4, "prompt", P(10))
    t.evict_to(10)
    assert len(t) == 1 and (a.alive != b.alive)
    live = a if a.alive else b
    tokens = [1, 2, 3, 4] if live is a else [1, 2, 5, 6]
    assert t.longest(tokens + [0]) is live
    # after the merge, the root has one child whose edge is the whole surviving path
    (child,) = t._roots[None].children.values()
    assert child.edge == tuple(tokens)
    t.evict_to(0)
    assert len(t) == 0 and t.nbytes == 0 and not t._roots  # the last entry's space went with it


def test_many_random_inserts_stay_consistent():
    import random

    rng = random.Random(0)
    t = PrefixTree(500)
    seqs = [[rng.randrange(4) for _ in range(12)] for _ in range(200)]
    for s in seqs:
        n = rng.randrange(1, 13)
        base = t.longest(s, n - 1)
        t.insert(s, n, rng.choice(["prompt", "message", "system"]), P(rng.randrange(5, 40)), base=base)
        assert t.nbytes <= 500
        assert t.nbytes == sum(e.nbytes for e in t.entries())
        for e in t.entries():
            assert e.base is None or e.base.alive
    for s in seqs:
        e = t.longest(s)
        if e is not None:
            assert t.get(s, e.length) is e


def test_spaces_never_share_entries_and_an_empty_space_leaves_no_root():
    t = PrefixTree(40)
    a = t.insert([1, 2, 3, 4], 4, "system", P(10), space="A")
    assert a.space == "A" and t.tokens(a) == [1, 2, 3, 4]
    assert t.longest([1, 2, 3, 4, 5]) is None and t.longest([1, 2, 3, 4, 5], space="B") is None
    assert t.longest([1, 2, 3, 4, 5], space="A") is a and t.get([1, 2, 3, 4], 4, "A") is a and t.get([1, 2, 3, 4], 4) is None
    plain = t.insert([1, 2, 3, 4], 4, "prompt", P(10))  # the same tokens unsalted: an entry of its own
    assert plain is not a and plain.space is None and len(t) == 2 and t.longest([1, 2, 3, 4, 5]) is plain
    with pytest.raises(ValueError, match="same space"):
        t.insert([1, 2, 3, 4, 5, 6], 6, "prompt", P(10), base=a)  # a base of another space
    b = t.insert([1, 2, 3, 4, 5, 6], 6, "prompt", P(10), base=a, space="A")
    assert t.longest([1, 2, 3, 4, 5, 6, 7], space="A") is b and b.chain() == [a, b]
    # The budget is shared: many salts evict each other's entries, and a space goes with its last entry.
    for i in range(20):
        t.insert([9, i], 2, "prompt", P(10), space=f"s{i}")
    assert len(t) == 4 and set(t._roots) == {e.space for e in t.entries()}  # no root without an entry
    assert t.longest([9, 19], space="s19") is not None and t.longest([9, 19]) is None and t.longest([9, 19], space="s18") is None
