"""The simulated KV memory: prefix matching, pinning, LRU eviction and its accounting."""

from __future__ import annotations

import contextlib
import random

import pytest

from war.sim.kvcache import Match, Node, PrefixKV


def check(kv: PrefixKV) -> None:
    """Recounts the tree and compares with the counters."""
    cached = locked = 0
    stack = list(kv.root.children.items())
    while stack:
        first, node = stack.pop()
        assert node.key[:kv.block_size] == first and len(node.key) % kv.block_size == 0
        assert node.key and node.parent is not None
        assert node.locks >= sum(c.locks for c in node.children.values())
        cached += len(node.key) // kv.block_size
        locked += len(node.key) // kv.block_size if node.locks else 0
        stack.extend(node.children.items())
    assert (cached, locked) == (kv.cached_blocks, kv.locked_blocks)
    assert kv.used_blocks <= kv.num_blocks


def toks(*runs: tuple[int, int]) -> tuple[int, ...]:
    """Concatenated ranges: toks((0, 8), (100, 4)) = 0..7, 100..103."""
    return tuple(t for a, n in runs for t in range(a, a + n))


def test_match_is_whole_blocks_and_capped() -> None:
    kv = PrefixKV(64, 4)
    kv.insert(toks((0, 10)), now=0.0)  # 2 whole blocks cached, the last 2 tokens not
    assert kv.cached_blocks == 2
    assert kv.match(toks((0, 10))).tokens == 8
    assert kv.match(toks((0, 8)), limit=7).tokens == 4  # at most limit tokens, whole blocks
    assert kv.match(toks((0, 6), (99, 4))).tokens == 4  # diverges inside the second block
    assert kv.match(toks((50, 8))).tokens == 0
    check(kv)


def test_shared_prefix_is_stored_once_and_split_on_divergence() -> None:
    kv = PrefixKV(64, 4)
    a = kv.insert(toks((0, 8), (100, 8)), 0.0)
    b = kv.insert(toks((0, 8), (200, 8)), 1.0)
    assert kv.cached_blocks == 6  # 2 shared + 2 + 2
    assert a.parent is b.parent and a.parent is not None and len(a.parent.key) == 8
    check(kv)


def test_lock_pins_exactly_the_matched_blocks() -> None:
    kv = PrefixKV(8, 4)
    kv.insert(toks((0, 16)), 0.0)
    m = kv.match(toks((0, 8), (77, 8)))
    assert m.tokens == 8
    pinned = kv.lock(m.node, m.used)
    assert len(pinned.key) == 8 and kv.locked_blocks == 2
    assert kv.available_blocks == 8 - 2
    assert kv.allocate(6)  # evicts the unpinned tail (2 blocks) to make room
    assert kv.cached_blocks == 2 and kv.evicted_blocks == 2
    assert not kv.allocate(1)
    kv.free(6)
    kv.unlock(pinned, 5.0)
    assert kv.locked_blocks == 0
    check(kv)


def test_eviction_is_least_recently_used_leaf_first() -> None:
    kv = PrefixKV(6, 4)
    old = kv.insert(toks((0, 8)), 0.0)
    kv.insert(toks((100, 8)), 1.0)
    kv.insert(toks((200, 8)), 2.0)
    assert kv.allocate(2)  # the oldest entry goes
    assert old.parent is None
    assert kv.match(toks((100, 8))).tokens == 8 and kv.match(toks((200, 8))).tokens == 8
    check(kv)


def test_touching_an_entry_protects_it() -> None:
    kv = PrefixKV(4, 4)
    kv.insert(toks((0, 8)), 0.0)
    kv.insert(toks((100, 8)), 1.0)
    kv.insert(toks((0, 8)), 2.0)  # used again: now the newest
    assert kv.allocate(2)
    assert kv.match(toks((0, 8))).tokens == 8 and kv.match(toks((100, 8))).tokens == 0
    check(kv)


def test_random_operations_keep_the_accounting() -> None:
    rng = random.Random(0)
    kv = PrefixKV(40, 4)
    held: list[tuple[Node, int]] = []
    for step in range(2000):
        op = rng.random()
        if op < 0.4:
            base = rng.choice([0, 1000, 2000])
            seq = toks((base, rng.randint(0, 24)), (rng.randint(0, 5) * 100, rng.randint(0, 12)))
            m = kv.match(seq)
            pinned = kv.lock(m.node, m.used)
            blocks = rng.randint(0, 3)
            if kv.allocate(blocks):
                held.append((pinned, blocks))
            else:
                kv.unlock(pinned, float(step))
        elif op < 0.7 and held:
            pinned, blocks = held.pop(rng.randrange(len(held)))
            kv.free(blocks)
            kv.unlock(pinned, float(step))
        elif kv.private_blocks <= 30:
            seq = toks((rng.choice([0, 1000]), rng.randint(0, 32)))
            with contextlib.suppress(RuntimeError):  # all pinned (callers never get here)
                kv.insert(seq, float(step))
        check(kv)


def test_a_remembered_match_is_reused_only_while_it_holds() -> None:
    """``reuse`` gives back an earlier match only while it is exactly what a fresh match
    would answer, through inserts that extend or split the matched path, evictions
    and lock/unlock splits."""
    rng = random.Random(1)
    kv = PrefixKV(14, 4)  # smaller than the queries' blocks: evictions
    queries = [toks((base, 24), (rng.randint(0, 3) * 100, rng.randint(0, 12)))
               for base in (0, 1000) for _ in range(4)]
    memos: dict[int, Match] = {}
    reused = 0
    for step in range(3000):
        op = rng.random()
        if op < 0.5:
            i = rng.randrange(len(queries))
            limit = rng.choice([len(queries[i]), len(queries[i]) - 1])
            memo = memos.get(i)
            got = kv.reuse(memo, limit) or kv.match(queries[i], limit)
            fresh = kv.match(queries[i], limit)
            assert (got.tokens, got.node, got.used) == (fresh.tokens, fresh.node, fresh.used)
            reused += got is memo
            memos[i] = got
            if rng.random() < 0.3:  # admission's lock and unlock (may split the end node)
                kv.unlock(kv.lock(got.node, got.used), float(step))
        elif op < 0.8:
            q = rng.choice(queries)
            with contextlib.suppress(RuntimeError):
                kv.insert(q[:rng.randint(0, len(q))], float(step))
        elif kv.allocate(rng.randint(1, 6)):  # evicts least recently used leaves
            kv.free(kv.private_blocks)
        check(kv)
    assert reused > 100 and kv.evicted_blocks > 100  # the memo is used, and tested


def test_bad_sizes_raise() -> None:
    with pytest.raises(ValueError):
        PrefixKV(0, 16)
