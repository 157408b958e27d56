"""The native tree's Python wrapper: checks, memory accounting, the GIL."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from war.spec import SpecConfig, SuffixSpeculator, SuffixTree
from war.spec.tree import alpha_table, as_tokens


def test_counts_children_and_match() -> None:
    t = SuffixTree(8)
    t.append(0, [1, 2, 3, 1, 2, 4])
    assert t.count([1, 2]) == 2
    assert t.count([]) == 0 and t.count([9]) == 0
    assert t.children([1, 2]) == [(3, 1), (4, 1)]
    assert t.match_len([7, 1, 2]) == 2
    assert t.sequence(0) == [1, 2, 3, 1, 2, 4]
    shallow = SuffixTree(4)
    shallow.append(0, [1, 2, 3, 1, 2, 4])
    # Depth 4 caps a draft after a 2-token match at 2 tokens.
    capped = shallow.speculate([1, 2], max_tokens=4, factor=2.0, min_prob=0.0)
    assert list(capped.token_ids) == [3, 1]
    d = t.speculate([5, 1, 2], max_tokens=4, factor=2.0, min_prob=0.0)
    assert list(d.token_ids) == [3, 1, 2, 4] and d.match_len == 2
    assert d.score == pytest.approx(2.0)
    t.check_integrity()


def test_default_arguments_of_speculate() -> None:
    t = SuffixTree(8)
    t.append(0, [1, 2, 3, 4, 1, 2])
    d = t.speculate([1, 2])  # max_tokens 16, factor 1, offset 0, min_prob 0.1, chain, alpha 0
    assert list(d.token_ids) == [3, 4]  # factor 1: a 2-token match drafts 2 tokens
    assert list(d.parents) == [-1, 0]


def test_seal_remove_and_memory_returns() -> None:
    t = SuffixTree(8)
    empty = t.memory_bytes()
    t.append(1, np.arange(100, dtype=np.int64) % 7)
    t.seal(1)
    with pytest.raises(ValueError, match="sealed"):
        t.append(1, [1])
    t.append(2, [3, 4, 5])
    other = SuffixTree(8)
    other.append_from(9, t, 2, 1, 3)
    assert other.sequence(9) == [4, 5]
    assert t.memory_bytes() > empty
    t.remove(1)
    t.remove(2)
    assert t.num_seqs == 0 and t.num_nodes == 0 and t.num_tokens == 0
    t.check_integrity()
    # An emptied tree gives its pooled buffers back.
    assert t.memory_bytes() == empty


def test_wrapper_rejects_bad_input_without_change() -> None:
    t = SuffixTree(4)
    t.append(0, [1, 2, 3])
    before = (t.num_nodes, t.num_tokens, t.memory_bytes())
    for call, message in [
        (lambda: t.append(0, [1.5]), "ints"),
        (lambda: t.append(0, np.zeros(2, dtype=np.float32)), "integer dtype"),
        (lambda: t.append(0, [2**31]), "out of range"),
        (lambda: t.append("x", [1]), "sequence id"),  # type: ignore[arg-type]
        (lambda: t.remove(5), "unknown sequence id 5"),
        (lambda: t.seal(5), "unknown sequence id 5"),
        (lambda: t.seq_len(5), "unknown"),
        (lambda: t.append_from(1, t, 0, 2, 9), "out of bounds"),
        (lambda: t.append_from(1, t, 7, 0, 1), "unknown"),
        (lambda: t.speculate([1], max_tokens=-1), "max_tokens"),
        (lambda: t.speculate([1], factor=-1.0), "factor"),
        (lambda: t.speculate([1], min_prob=2.0), "min_prob"),
        (lambda: t.speculate([1], offset=float("nan")), "offset"),
        (lambda: t.speculate([1], tree=1), "tree"),  # type: ignore[arg-type]
        (lambda: t.speculate([1], alpha=[0.0, 1.0]), "alpha"),
        (lambda: t.speculate([1], alpha=-1.0), "alpha"),
    ]:
        with pytest.raises(ValueError, match=message):
            call()
        assert (t.num_nodes, t.num_tokens, t.memory_bytes()) == before
    with pytest.raises(ValueError, match="max_depth"):
        SuffixTree(0)


def test_as_tokens_accepts_integer_inputs() -> None:
    assert as_tokens(np.array([1, 2], dtype=np.uint8)).dtype == np.int32
    assert list(as_tokens((np.int64(3), 4))) == [3, 4]
    assert as_tokens([]).size == 0
    assert alpha_table(0.5, 2).tolist() == [0.5, 0.5, 0.5]


def test_batched_propose_releases_the_gil() -> None:
    # One long native call in a worker thread: if it held the GIL, this thread
    # would stall for the whole call.
    rng = np.random.default_rng(0)
    s = SuffixSpeculator(SpecConfig(tree=True, max_spec_tokens=64, factor=8.0, min_prob=0.0))
    ids = list(range(4000))
    for i in ids:
        s.start(i, rng.integers(0, 3, size=300), group_id=i % 4)
    s.finish(0)
    ids.remove(0)
    duration = 0.0

    def work() -> None:
        nonlocal duration
        t0 = time.perf_counter()
        s.propose_arrays(ids)
        duration = time.perf_counter() - t0

    worker = threading.Thread(target=work)
    gaps = []
    worker.start()
    last = time.perf_counter()
    while worker.is_alive():
        now = time.perf_counter()
        gaps.append(now - last)
        last = now
    worker.join()
    if duration < 0.03:
        pytest.skip(f"the batch took only {duration:.3f} s: too short to tell")
    assert max(gaps) < duration / 2, (max(gaps), duration)


def test_drafts_of_rejects_arrays_that_are_not_a_batch() -> None:
    from war.spec.tree import BatchDrafts, drafts_of

    i32 = np.int32
    good = BatchDrafts(np.array([5, 6, 7], i32), np.array([-1, 0, -1], i32),
                       np.array([0.9, 0.5, 0.8]), np.array([0, 2, 3], np.int64),
                       np.array([1.4, 0.8]), np.array([1, 3], np.int8), np.array([4, 2], i32))
    d = drafts_of(good)
    assert [x.token_ids for x in d] == [(5, 6), (7,)]
    assert [x.source for x in d] == ["group", "global"]
    bad = [
        good._replace(token_ids=good.token_ids.astype(np.int64)),  # dtype
        good._replace(parents=good.parents.astype(np.uint32)),
        good._replace(sources=good.sources.astype(np.uint8)),
        good._replace(probs=good.probs.astype(np.float32)),
        good._replace(scores=good.scores.astype(i32)),
        good._replace(parents=good.parents[:2]),  # lengths
        good._replace(offsets=np.array([0, 2, 4], np.int64)),
        good._replace(offsets=np.array([1, 2, 3], np.int64)),
        good._replace(offsets=np.array([0, 3, 2, 3], np.int64)),
        good._replace(offsets=np.array([], np.int64)),
        good._replace(sources=np.array([1, 4], np.int8)),  # unknown source
        good._replace(token_ids=np.array([[5, 6, 7]], i32)),  # 2-D
        good._replace(match_lens=np.array([4, 0, 2, 0], i32)[::2]),  # not contiguous
    ]
    for b in bad:
        with pytest.raises(ValueError):
            drafts_of(b)
    assert drafts_of(good) == d


def test_numbers_beyond_any_float_or_int64_are_value_errors() -> None:
    """Ints too large for a float (or for int64) are bad input like any other: a
    ValueError naming them, not an OverflowError; a budget that large only means "as
    many as the cap allows"; a depth over the native limit is refused before any
    per-depth table is built (it was a multi-GB allocation)."""
    t = SuffixTree(8)
    t.append(0, [1, 2, 3, 1, 2])
    for kwargs in ({"factor": 10**400}, {"offset": -(10**400)}, {"min_prob": 10**400},
                   {"alpha": 10**400}, {"alpha": [10**400] * 9}):
        with pytest.raises(ValueError):
            t.speculate([1, 2], max_tokens=4, **kwargs)  # type: ignore[arg-type]
    for field in ("factor", "alpha", "min_prob"):
        with pytest.raises(ValueError, match=field):
            SpecConfig(**{field: 10**400})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_depth must be <= 4096"):
        SpecConfig(max_depth=2**31 - 1)
    s = SuffixSpeculator(SpecConfig())
    s.start(1, [1, 2, 3, 1, 2], group_id="g")
    capped = s.propose([1], SpecConfig().max_spec_tokens)
    for budget in (2**63, [10**30], np.uint64(2**64 - 1)):
        assert s.propose([1], budget) == capped  # type: ignore[arg-type]


def test_alpha_and_ranges_take_numpy_ints_and_refuse_bools_and_strings() -> None:
    assert alpha_table(np.int64(2), 1).tolist() == [2.0, 2.0]
    assert alpha_table(np.array([1, 2], dtype=np.int16), 1).tolist() == [1.0, 2.0]
    for bad in (["0.5", "0.5"], [True, False], np.array([True, False]), "05"):
        with pytest.raises(ValueError, match="alpha"):
            alpha_table(bad, 1)  # type: ignore[arg-type]
    t = SuffixTree(np.int64(4))  # type: ignore[arg-type]
    t.append(0, [1, 2, 3])
    t.append_from(1, t, 0, np.int64(1), np.int64(3))
    assert t.sequence(1) == [2, 3]
    before = (t.num_nodes, t.num_tokens)
    with pytest.raises(ValueError, match="start must be an int"):
        t.append_from(2, t, 0, False, True)
    with pytest.raises(ValueError, match="end must be an int"):
        t.append_from(2, t, 0, 0, 1.0)  # type: ignore[arg-type]
    assert (t.num_nodes, t.num_tokens) == before and not t.contains(2)
