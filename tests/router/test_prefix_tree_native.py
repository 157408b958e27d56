"""The native prefix tree against its specification, the pure-Python reference.

Random operation sequences (small vocabularies so prefixes are shared, small budgets
so splits and evictions are frequent, equal and out-of-order times so ties decide
evictions) must give the same answers, the same trees (paths, holders in order,
counts) and the same heaps (entries in list order) after every operation. Also:
bad input raises and leaves the tree as it was.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from war.router.policies.prefix_tree import PathEnd, PrefixTree, plain_token_ids
from war.router.policies.prefix_tree_reference import ReferencePrefixTree

REPLICAS = ("a", "b", "c")


class CountingReference(ReferencePrefixTree):
    """The reference, counting compactions that happen inside an ``evict`` (the case
    where ``evict`` goes on popping the list the compaction replaced)."""

    def __init__(self, budget: int) -> None:
        super().__init__(budget)
        self.evicting = 0
        self.compactions_in_evict = 0

    def evict(self, replica: str, max_tokens: int) -> int:
        self.evicting += 1
        try:
            return super().evict(replica, max_tokens)
        finally:
            self.evicting -= 1

    def _compact(self, replica: str) -> None:
        if self.evicting:
            self.compactions_in_evict += 1
        super()._compact(replica)


class Pair:
    """A native tree and a reference tree driven by the same operations."""

    def __init__(self, budget: int) -> None:
        self.native = PrefixTree(budget)
        self.ref = CountingReference(budget)
        # (native end, reference end, the tokens inserted, replica)
        self.ends: list[tuple[PathEnd | None, Any, tuple[int, ...], str]] = []
        self.other_native = PrefixTree(budget)  # foreign handles
        self.other_ref = ReferencePrefixTree(budget)

    def check(self) -> None:
        self.native.check_integrity()
        self.ref.check_integrity()
        assert self.native.dump() == self.ref.dump()
        for r in (*REPLICAS, "zz"):
            assert self.native.heap_entries(r) == self.ref.heap_entries(r), r
            assert self.native.heap_size(r) == self.ref.heap_size(r)
            assert self.native.num_tokens(r) == self.ref.num_tokens(r)
        assert self.native.replicas() == self.ref.replicas()

    def insert(self, tokens: tuple[int, ...], replica: str, now: float) -> None:
        n = self.native.insert(tokens, replica, now)
        r = self.ref.insert(tokens, replica, now)
        assert (n is None) == (r is None)
        self.ends.append((n, r, tokens, replica))

    def extend(self, k: int, path: tuple[int, ...] | None, tokens: tuple[int, ...],
               replica: str | None, now: float, how: str) -> None:
        n_end, r_end, inserted, where = self.ends[k % len(self.ends)]
        if how == "none":
            n_end, r_end = None, None
        elif how == "foreign":
            n_end = self.other_native.insert(inserted or (0,), where, now)
            r_end = self.other_ref.insert(inserted or (0,), where, now)
        if path is None:
            path = inserted
        replica = where if replica is None else replica
        n = self.native.extend(n_end, path, tokens, replica, now)
        r = self.ref.extend(r_end, path, tokens, replica, now)
        assert (n is None) == (r is None)
        self.ends.append((n, r, path + tokens, replica))

    def match(self, tokens: tuple[int, ...]) -> None:
        n, r = self.native.match(tokens), self.ref.match(tokens)
        assert list(n.items()) == list(r.items())  # the same order, too

    def evict(self, replica: str, max_tokens: int) -> None:
        assert self.native.evict(replica, max_tokens) == self.ref.evict(replica, max_tokens)

    def remove(self, replica: str) -> None:
        self.native.remove_replica(replica)
        self.ref.remove_replica(replica)


def _random_ops(pair: Pair, rng: random.Random, steps: int, vocab: int, max_len: int,
                probes: list[tuple[int, ...]]) -> None:
    now = 0.0

    def toks(lo: int = 0) -> tuple[int, ...]:
        return tuple(rng.randrange(vocab) for _ in range(rng.randint(lo, max_len)))

    for _ in range(steps):
        step = rng.random()
        if step < 0.5:
            now += rng.choice((0.0, 0.0, 1.0, 0.5))  # ties are common
        elif step < 0.55:
            now = float(rng.randrange(8))  # and time may go back
        replica = rng.choice(REPLICAS)
        op = rng.random()
        if op < 0.4:
            pair.insert(toks(), replica, now)
        elif op < 0.7 and pair.ends:
            how = rng.choice(("end", "end", "end", "none", "foreign"))
            path = toks() if rng.random() < 0.1 else None  # a path that is not end's
            other = replica if rng.random() < 0.2 else None
            pair.extend(rng.randrange(len(pair.ends)), path, toks(), other, now, how)
        elif op < 0.8:
            pair.match(toks())
        elif op < 0.9:
            pair.evict(replica, rng.randrange(0, 30))
        elif op < 0.93:
            pair.remove(replica)
        else:
            for probe in probes:
                pair.match(probe)
        pair.check()


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_native_tree_equals_reference(data: st.DataObject) -> None:
    budget = data.draw(st.integers(1, 40), label="budget")
    pair = Pair(budget)
    tokens = st.lists(st.integers(0, 3), max_size=12).map(tuple)
    times = st.sampled_from([0.0, 1.0, 1.0, 2.0, 2.5, 3.0])
    for _ in range(data.draw(st.integers(1, 40), label="steps")):
        op = data.draw(st.sampled_from(
            ["insert", "insert", "extend", "extend", "match", "evict", "remove", "counts"]))
        replica = data.draw(st.sampled_from(REPLICAS))
        now = data.draw(times)
        if op == "insert":
            pair.insert(data.draw(tokens), replica, now)
        elif op == "extend" and pair.ends:
            k = data.draw(st.integers(0, len(pair.ends) - 1))
            how = data.draw(st.sampled_from(["end", "end", "none", "foreign"]))
            pair.extend(k, None, data.draw(tokens), None, now, how)
        elif op == "match":
            pair.match(data.draw(tokens))
        elif op == "evict":
            pair.evict(replica, data.draw(st.integers(-1, 40)))
        elif op == "remove":
            pair.remove(replica)
        pair.check()


@pytest.mark.parametrize("seed", range(6))
def test_native_tree_equals_reference_long_runs(seed: int) -> None:
    """Long runs, where heaps grow big enough to be compacted."""
    rng = random.Random(seed)
    for budget in (3, 12, 40):
        pair = Pair(budget)
        _random_ops(pair, rng, 700, vocab=3 if seed % 2 else 5, max_len=10,
                    probes=[(0, 1, 2), (1, 1), (2,), (0, 0, 0, 0)])


@pytest.mark.parametrize("touches", range(64, 76))
def test_compaction_inside_an_eviction(touches: int) -> None:
    """Repeated touches of one path fill a's heap up to its limit; a long insert then
    evicts several leaves, which lowers the limit, and pushing a parent that became a
    leaf compacts the heap mid-eviction (for some of these numbers of touches): the
    reference goes on popping the old list."""
    pair = Pair(10)
    for j in range(3):
        pair.insert((20 + j,), "a", 0.0)
    pair.insert((7, 8), "a", 0.0)
    pair.insert((7, 8, 9), "a", 0.0)  # [7, 8] -> [9]
    for i in range(touches):
        pair.insert((0, 1, 2), "a", 1.0 + i // 3)
    pair.insert((5,) * 8, "a", 100.0)
    pair.check()
    for i in range(5):
        pair.insert((5, 6, i), "a", 100.0)
        pair.insert((4, 4, i), "b", 100.0)
        pair.check()
    if touches == 70:
        assert pair.ref.compactions_in_evict > 0


def test_long_prompts_and_big_fanout_match_the_reference() -> None:
    rng = random.Random(1)
    pair = Pair(20_000)
    system = tuple(rng.randrange(50_000) for _ in range(300))
    for i in range(400):  # hundreds of children under the shared system prompt
        prompt = system + tuple(rng.randrange(50_000) for _ in range(rng.randint(1, 60)))
        pair.insert(prompt, REPLICAS[i % 3], float(i))
        if i % 7 == 0:
            pair.extend(len(pair.ends) - 1, None, (1, 2, 3), None, float(i), "end")
        if i % 50 == 0:
            pair.check()
        pair.match((*prompt[:-1], -1))
    pair.evict("a", 5000)
    pair.remove("b")
    pair.check()
    for i in range(0, 400, 3):  # shrink the fanout again
        pair.evict(REPLICAS[i % 3], 4000 - 10 * i)
    pair.check()


def test_handles() -> None:
    t = PrefixTree(100)
    end = t.insert([1, 2, 3, 4], "a", 0.0)
    assert isinstance(end, PathEnd)
    t.insert([1, 2, 9], "a", 1.0)  # splits the end's edge: the end stays the lower half
    t.extend(end, [1, 2, 3, 4], [5], "a", 2.0)
    assert t.match([1, 2, 3, 4, 5]) == {"a": 5}
    t.remove_replica("a")
    t.insert([7, 7], "a", 3.0)  # may reuse the freed slots
    t.extend(end, [1, 2], [3], "a", 4.0)  # detached: inserts the path from the root
    assert t.match([1, 2, 3, 4]) == {"a": 3}
    assert t.extend(None, [], [], "a", 5.0) is None
    with pytest.raises(TypeError, match="PathEnd"):
        t.extend(object(), [1], [2], "a", 6.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        PathEnd()
    t.check_integrity()


def test_inputs() -> None:
    t = PrefixTree(50)
    t.insert((1, 2, 3), "a", 0.0)
    t.insert([True, 2, 5], "b", 1)  # bools are ints, ints are times
    t.insert(iter([4, 5]), "a", 2.0)
    t.insert(range(6, 9), "a", 2.0)
    t.insert([-(2**31), 2**31 - 1], "c", 2.0)
    ref = ReferencePrefixTree(50)
    ref.insert((1, 2, 3), "a", 0.0)
    ref.insert([1, 2, 5], "b", 1.0)
    ref.insert([4, 5], "a", 2.0)
    ref.insert(range(6, 9), "a", 2.0)
    ref.insert([-(2**31), 2**31 - 1], "c", 2.0)
    assert t.dump() == ref.dump()
    assert t.max_tokens_per_replica == 50
    np = pytest.importorskip("numpy")
    assert t.match(np.array([1, 2, 3], dtype=np.int64)) == {"a": 3, "b": 2}


def test_bad_input_raises_and_leaves_the_tree_unchanged() -> None:
    for budget in (0, -5, True, False):
        with pytest.raises(ValueError, match="max_tokens_per_replica must be >= 1"):
            PrefixTree(budget)
    with pytest.raises(TypeError, match="max_tokens_per_replica"):
        PrefixTree("10")  # type: ignore[arg-type]
    t = PrefixTree(10)
    end = t.insert([1, 2, 3], "a", 0.0)
    t.insert([1, 2, 4, 5], "b", 1.0)
    before = t.dump(), [t.heap_entries(r) for r in "ab"]
    bad: list[tuple[type[Exception], str, Any]] = [
        (ValueError, "int32", lambda: t.insert([1, 2**31], "a", 2.0)),
        (ValueError, "int32", lambda: t.insert([1, -(2**31) - 1], "a", 2.0)),
        (ValueError, "int32", lambda: t.insert([1, 2**70], "a", 2.0)),
        (TypeError, "ints", lambda: t.insert([1, 2.0], "a", 2.0)),
        (TypeError, "ints", lambda: t.insert([1, "2"], "a", 2.0)),
        (TypeError, "ints", lambda: t.insert([1, None], "a", 2.0)),
        (TypeError, "iterable", lambda: t.insert(5, "a", 2.0)),
        (TypeError, "iterable", lambda: t.insert(None, "a", 2.0)),
        (TypeError, "replica", lambda: t.insert([1], 3, 2.0)),
        (TypeError, "now", lambda: t.insert([1], "a", "later")),
        (ValueError, "NaN", lambda: t.insert([1], "a", float("nan"))),
        (ValueError, "int32", lambda: t.extend(end, [1, 2, 3], [4, 2**40], "a", 2.0)),
        (ValueError, "int32", lambda: t.extend(None, [2**40], [4], "a", 2.0)),
        (TypeError, "ints", lambda: t.extend(end, [1, 2, 3], [4.5], "a", 2.0)),
        (TypeError, "replica", lambda: t.extend(end, [1, 2, 3], [4], None, 2.0)),
        (ValueError, "NaN", lambda: t.extend(end, [1, 2, 3], [4], "a", float("nan"))),
        (ValueError, "int32", lambda: t.match([1, 2**31])),
        (TypeError, "ints", lambda: t.match([1, 2.5])),
        (TypeError, "max_tokens", lambda: t.evict("a", "0")),
    ]
    for exc, message, call in bad:
        with pytest.raises(exc, match=message):
            call()
        assert (t.dump(), [t.heap_entries(r) for r in "ab"]) == before
        t.check_integrity()
    def failing() -> Any:
        yield 1
        raise KeyError("from the iterator")

    with pytest.raises(KeyError, match="from the iterator"):  # not masked
        t.insert(failing(), "a", 2.0)
    assert (t.dump(), [t.heap_entries(r) for r in "ab"]) == before
    # a list whose items change while they are read is read from a snapshot
    class Evil:
        def __init__(self, victim: list[object]) -> None:
            self.victim = victim

        def __index__(self) -> int:
            self.victim.clear()
            return 7

    victim: list[object] = [1, 2]
    victim.append(Evil(victim))
    victim.append(3)
    t.insert(victim, "c", 3.0)
    assert t.match([1, 2, 7, 3]) == {"c": 4, "a": 2, "b": 2}
    t.check_integrity()


def test_python_code_run_while_reading_tokens_may_use_the_tree() -> None:
    """A token whose ``__index__`` calls the tree (re-entry, or another thread while
    Python code runs): each call reads its tokens into its own buffer and looks at the
    tree only once they are read."""
    t = PrefixTree(8)

    class Sneaky:
        def __init__(self, action: Any) -> None:
            self.action = action

        def __index__(self) -> int:
            self.action()
            return 9

    end = t.insert([1, 2, 3], "a", 0.0)
    # the handle's node leaves the tree while the output is read: a full insert
    t.extend(end, [1, 2, 3], [4, Sneaky(lambda: t.remove_replica("a"))], "a", 1.0)
    assert t.match([1, 2, 3, 4, 9]) == {"a": 5}
    t.check_integrity()
    # a nested insert and match while a match reads its tokens
    got = t.match([1, 2, Sneaky(lambda: (t.insert(list(range(20, 25)), "b", 2.0),
                                         t.match([20, 21])))])
    assert got == {"a": 2}
    assert t.num_tokens("b") == 5
    t.check_integrity()


def test_lookups_of_unknown_replicas() -> None:
    t = PrefixTree(10)
    assert t.num_tokens("x") == 0 and t.evict("x", 0) == 0 and t.heap_entries("x") == []
    t.remove_replica("x")
    assert t.replicas() == [] and t.match([1]) == {}
    t.check_integrity()


_token_like = st.one_of(
    st.integers(-3, 3), st.integers(2**30 - 2, 2**30 + 2), st.integers(-2**40, 2**40),
    st.booleans(), st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=2),
    st.none())


@settings(max_examples=300, deadline=None)
@given(st.lists(_token_like, max_size=12), st.booleans())
def test_plain_token_ids_is_exactly_its_specification(items: list[Any], as_tuple: bool) -> None:
    seq: list[Any] | tuple[Any, ...] = tuple(items) if as_tuple else items
    expected = all(type(x) is int and 0 <= x < 2**30 for x in items)
    assert plain_token_ids(seq) is expected


def test_plain_token_ids_takes_only_lists_and_tuples() -> None:
    assert plain_token_ids([0, 1, 2**30 - 1]) and plain_token_ids(()) and plain_token_ids([])
    for other in (None, "abc", b"ab", range(3), iter([1]), {1: 2}, {1}, 7):
        assert plain_token_ids(other) is False
