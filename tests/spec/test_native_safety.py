"""The native core's own checks (war.spec._C called directly): what would break memory
safety is refused with an exception, never a crash or a corrupted tree."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from war.spec import _C


def _run(code: str) -> subprocess.CompletedProcess[str]:
    """Runs `code` in a fresh interpreter (a crash fails the test instead of the run)."""
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=120)


def _batch_rest(n: int, depth: int) -> tuple[Any, ...]:
    """propose_batch's arguments after global_tree: tree drafts of up to 64 tokens."""
    a = np.zeros(depth + 1)
    return (np.full(n, 64, np.int32), 64, 1.0, 64.0, 0.0, True, a, a, a, 1.0, False, 0.5, 0.05)


def test_negative_token_ids_are_refused_without_change() -> None:
    # -1 marks an empty slot of a node's child index: such a token corrupted the tree.
    t = _C.SuffixTree(4)
    t.append(0, np.arange(20, dtype=np.int32))
    before = (t.num_nodes, t.num_tokens, t.seq_len(0))
    for bad in ([-1], [5, -1], [-(2**31)]):
        with pytest.raises(ValueError, match="out of range"):
            t.append(0, np.array(bad, np.int32))
        with pytest.raises(ValueError, match="out of range"):
            t.append(1, np.array(bad, np.int32))
    assert (t.num_nodes, t.num_tokens, t.seq_len(0)) == before and not t.contains(1)
    assert not t.append_ints(0, [3, -1])
    t.check_integrity()


def test_max_depth_beyond_the_limit_is_refused() -> None:
    # Each growing sequence holds max_depth pointers: 2**31 - 1 of them is 16 GiB.
    with pytest.raises(ValueError, match="max_depth"):
        _C.SuffixTree(2**31 - 1)
    with pytest.raises(ValueError, match="max_depth"):
        _C.SuffixTree(4097)
    with pytest.raises(ValueError, match="max_depth"):
        _C.SuffixTree(0)
    assert _C.SuffixTree(4096).max_depth == 4096


@pytest.mark.parametrize("where", ["locals", "groups"])
def test_propose_batch_refuses_none_and_other_objects(where: str) -> None:
    r = _run(f"""
        import numpy as np
        from war.spec import _C
        t = _C.SuffixTree(4)
        t.append(0, np.array([1, 2, 3, 1, 2], np.int32))
        a = np.zeros(5)
        for bad in (None, 3, _C.SuffixTree.__new__(_C.SuffixTree)):
            trees = {{"locals": [t], "groups": [t]}}
            trees[{where!r}] = [bad]
            try:
                _C.propose_batch(trees["locals"], np.array([0], np.int64), trees["groups"], None,
                                 np.array([4], np.int32), 4, 1.0, 0.0, 0.1, False, a, a, a, 1.0,
                                 False, 0.5, 0.05)
            except TypeError as e:
                print("TypeError", e)
    """)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("TypeError") == 3, r.stdout


def test_make_drafts_refuses_a_type_without_new() -> None:
    # type(sys.flags) cannot be instantiated: its tp_new is NULL.
    r = _run("""
        import sys
        import numpy as np
        from war.spec import _C
        i32 = np.zeros(1, np.int32)
        try:
            _C.make_drafts(type(sys.flags), ("a", "b", "c", "d", "e", "f"), ("none",),
                           np.zeros(0, np.int32), np.zeros(0, np.int32), np.zeros(0),
                           np.zeros(2, np.int64), np.zeros(1), np.zeros(1, np.int8), i32)
        except TypeError as e:
            print("TypeError", e)
    """)
    assert r.returncode == 0, r.stderr
    assert "TypeError" in r.stdout


def test_make_drafts_releases_a_buffer_of_the_wrong_type() -> None:
    # A refused buffer must be released: else the bytearray stays locked for good.
    b = bytearray(8)  # format 'B' (unsigned): not the int8 sources
    z = np.zeros(0, np.int32)
    make_drafts: Any = _C.make_drafts
    with pytest.raises(ValueError, match="sources has the wrong type"):
        make_drafts(object, ("a", "b", "c", "d", "e", "f"), ("none",), z, z, np.zeros(0),
                    np.zeros(1, np.int64), np.zeros(0), b, z)
    b.append(1)  # BufferError while an export is held
    assert len(b) == 9


def _busy_trees(group_len: int, depth: int = 32) -> tuple[_C.SuffixTree, _C.SuffixTree]:
    rng = np.random.default_rng(0)
    local, group = _C.SuffixTree(depth), _C.SuffixTree(depth)
    local.append(0, rng.integers(0, 4, 20000).astype(np.int32))
    group.append(0, rng.integers(0, 4, group_len).astype(np.int32))
    return local, group


def _mutations(local: _C.SuffixTree, group: _C.SuffixTree) -> list[Callable[[], object]]:
    one = np.array([1], np.int32)
    return [lambda: local.append(0, one), lambda: group.append(1, one),
            lambda: group.append_ints(2, [1]), lambda: group.append_from(3, local, 0, 0, 5),
            lambda: local.seal(0), lambda: group.remove(0)]


@pytest.mark.parametrize("call", ["propose_batch", "speculate"])
def test_trees_read_without_the_gil_refuse_mutation(call: str) -> None:
    # Both read the trees with the GIL released: another thread's append, seal or
    # remove meanwhile would free what they read.
    local, group = _busy_trees(20000 if call == "propose_batch" else 300000)
    n = 20000
    ids, rest = np.zeros(n, np.int64), _batch_rest(n, 32)
    ctx = local.sequence(0)[-32:].copy()
    alpha = np.zeros(33)

    def native() -> object:
        if call == "propose_batch":
            return [bytes(x) for x in _C.propose_batch([local] * n, ids, [group] * n, group,
                                                       *rest)]
        d = group.speculate(ctx, 10**6, 1.0, 10**6, 0.0, True, alpha)
        return [bytes(np.asarray(x)) for x in d[:3]]

    expected = native()
    results: list[object] = []
    started = threading.Event()

    def work() -> None:
        started.set()
        results.append(native())

    worker = threading.Thread(target=work)
    worker.start()
    started.wait()
    time.sleep(0.02)  # the worker enters the call; the GIL comes back inside it
    outcomes = []
    mutations = _mutations(local, group) if call == "propose_batch" else _mutations(group, group)
    for mutate in mutations:
        try:
            mutate()
            outcomes.append("ran")
        except RuntimeError as e:
            assert "in use" in str(e)
            outcomes.append("refused")
    busy = worker.is_alive()
    worker.join()
    if not busy:
        pytest.skip("the native call ended before the mutations were tried")
    assert outcomes == ["refused"] * 6
    assert results[0] == expected
    local.check_integrity()
    group.check_integrity()
    for mutate in mutations:  # no pin is left behind
        mutate()
    group.check_integrity()


def test_propose_batch_keeps_its_trees_alive() -> None:
    # The caller's list may be emptied by another thread while the GIL is released:
    # the trees it held must live until the call returns.
    r = _run("""
        import gc, threading, time
        import numpy as np
        from war.spec import _C
        rng = np.random.default_rng(0)
        n, depth = 300, 32
        seqs = [rng.integers(0, 4, 2000).astype(np.int32) for _ in range(n)]
        def trees():
            out = []
            for s in seqs:
                t = _C.SuffixTree(depth)
                t.append(0, s)
                out.append(t)
            return out
        a = np.zeros(depth + 1)
        rest = (None, np.full(n, 1000, np.int32), 1000, 1.0, 1000.0, 0.0, True, a, a, a, 1.0,
                False, 0.5, 0.05)
        def call(ls):
            return [bytes(x) for x in _C.propose_batch(ls, np.zeros(n, np.int64), ls, *rest)]
        ls = trees()
        expected = call(ls)
        ls = trees()
        out, started = [], threading.Event()
        def work():
            started.set()
            out.append(call(ls))
        worker = threading.Thread(target=work)
        worker.start()
        started.wait()
        time.sleep(0.02)  # the worker enters the call; the GIL comes back inside it
        busy = worker.is_alive()
        ls.clear()  # the worker's call holds the only other references
        gc.collect()
        junk = [np.full(2000, 7, np.int32) for _ in range(2000)]
        worker.join()
        print("skip" if not busy else "same" if out[0] == expected else "different")
    """)
    assert r.returncode == 0, r.stderr
    if r.stdout.strip() == "skip":
        pytest.skip("the native call ended before the list was emptied")
    assert r.stdout.strip() == "same"
