"""Property tests: the native ``war.spec.tree.SuffixTree`` against the pure-Python
reference (``war.spec.reference``), which is the executable form of
docs/suffix-speculation.md.

Random interleavings of appends (random chunk sizes, several sequences growing in turn,
tokens as lists or numpy arrays), seals and removes are replayed on both trees; after
every operation the native integrity check must pass and the two trees must agree on
every node (count and child list, order included), on ``match_len`` and, exactly, on
``speculate`` (and on the native ``speculate_self``, the local source's shortcut, against
the reference's ``speculate`` of the sequence itself). At the end they must agree on the
counts of every observed substring up to depth ``max_depth + 1``; removing every
sequence must leave an empty trie, and replaying the operations must not grow the memory.
``test_memory_returns_to_empty`` checks that the memory goes back to the empty tree's.
"""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from war.spec.reference import (
    MAX_TOKEN,
    Alpha,
    ReferenceSuffixTree,
    empty_result,
    reference_merge,
    reference_propose,
)

tree_mod = pytest.importorskip("war.spec.tree")
SuffixTree: Any = tree_mod.SuffixTree
HAS_SEAL = hasattr(SuffixTree, "seal")

SMALL_TOKENS = st.integers(0, 5)
LARGE_TOKENS = st.sampled_from([0, 1, 2, 3, 1 << 16, 123456789, MAX_TOKEN - 1, MAX_TOKEN])
ALL_SEQ_IDS = [0, 1, 2, 3, 17, 2**40]
SEQ_IDS = st.sampled_from(ALL_SEQ_IDS)
MAX_TOKENS = st.integers(0, 10)
FACTORS = st.sampled_from([0.0, 0.5, 1.0, 2.0])
OFFSETS = st.sampled_from([0.0, 1.0, 2.5])
MIN_PROBS = st.sampled_from([0.0, 0.1, 0.5])
ALPHAS = st.sampled_from([0.0, 0.5, 1.0])
ALPHA_VALUES = st.sampled_from([0.0, 0.25, 0.5, 1.0, 3.0])

Params = tuple[int, float, float, float, bool, Alpha]


def alpha_strategy(max_depth: int) -> st.SearchStrategy[Alpha]:
    """A constant (mostly) or a table of max_depth + 1 values."""
    table = st.lists(ALPHA_VALUES, min_size=max_depth + 1, max_size=max_depth + 1)
    return st.one_of(ALPHAS, ALPHAS, table)


def params_strategy(max_depth: int) -> st.SearchStrategy[Params]:
    return st.tuples(
        MAX_TOKENS, FACTORS, OFFSETS, MIN_PROBS, st.booleans(), alpha_strategy(max_depth)
    )


# ----------------------------------------------------------------------------- scenarios


@dataclass
class Query:
    context: list[int]
    as_numpy: bool
    params: Params


@dataclass
class Op:
    kind: str  # "append" | "remove" | "remove_unknown" | "seal"
    seq_id: int
    tokens: list[int] = field(default_factory=list)
    dtype: str | None = None  # None: pass a list; else a numpy dtype name


@dataclass
class Scenario:
    max_depth: int
    ops: list[Op]
    queries: list[Query]
    observed: list[list[int]]  # every sequence ever built (live or removed)


@st.composite
def scenarios(
    draw: st.DrawFn, max_ops: int = 12, max_chunk: int = 8, max_queries: int = 6
) -> Scenario:
    max_depth = draw(st.integers(1, 12))
    tokens = draw(st.sampled_from([SMALL_TOKENS, SMALL_TOKENS, SMALL_TOKENS, LARGE_TOKENS]))
    live: dict[int, list[int]] = {}
    sealed: set[int] = set()
    observed: list[list[int]] = []
    ops: list[Op] = []
    kinds = ["append", "append", "append", "remove"] + (["seal"] if HAS_SEAL else [])
    for _ in range(draw(st.integers(0, max_ops))):
        kind = draw(st.sampled_from(kinds))
        if kind == "append" or not live:
            sid = draw(SEQ_IDS)
            chunk = draw(st.lists(tokens, max_size=max_chunk))
            dtype = draw(st.sampled_from([None, None, "int32", "int64"]))
            ops.append(Op("append", sid, chunk, dtype))
            if sid in sealed:
                continue  # the native tree refuses it; the reference is not told
            if sid not in live:
                live[sid] = []
                observed.append(live[sid])
            live[sid].extend(chunk)
        elif kind == "seal":
            sid = draw(st.sampled_from(sorted(live)))
            ops.append(Op("seal", sid))
            sealed.add(sid)
        else:
            sid = draw(st.sampled_from(sorted(live)))
            ops.append(Op("remove", sid))
            del live[sid]
            sealed.discard(sid)
        unknown = [s for s in ALL_SEQ_IDS if s not in live]
        if unknown and draw(st.integers(0, 9)) == 0:
            ops.append(Op("remove_unknown", draw(st.sampled_from(unknown))))

    queries: list[Query] = []
    for _ in range(draw(st.integers(0, max_queries))):
        source = draw(st.sampled_from(["slice", "slice", "slice", "random"]))
        nonempty = [s for s in observed if s]
        if source == "slice" and nonempty:
            s = draw(st.sampled_from(nonempty))
            end = draw(st.integers(1, len(s)))
            start = draw(st.integers(max(0, end - max_depth - 2), end))
            ctx = list(s[start:end])
            if draw(st.booleans()):
                ctx = [draw(tokens), *ctx]
            if draw(st.integers(0, 3)) == 0:
                ctx.append(draw(tokens))
        else:
            ctx = draw(st.lists(tokens, max_size=max_depth + 2))
        queries.append(Query(ctx, draw(st.booleans()), draw(params_strategy(max_depth))))
    return Scenario(max_depth, ops, queries, observed)


# ----------------------------------------------------------------------------- comparing


def ints(xs: Any) -> list[int]:
    return [int(x) for x in xs]


def spec_of(r: Any) -> tuple[list[int], list[int], list[float], float, int]:
    """A draft (native NamedTuple, native tuple or reference) as plain Python values."""
    tokens, parents, probs, score, match_len = r
    return (ints(tokens), ints(parents), [float(p) for p in probs], float(score), int(match_len))


def native_children(nat: Any, path: Sequence[int]) -> list[tuple[int, int]]:
    return [(int(t), int(c)) for t, c in nat.children(list(path))]


def native_speculate_self(nat: Any, seq_id: int, params: Params) -> Any | None:
    """The native local-source shortcut, where the build has it (else None)."""
    native = getattr(nat, "native", None)
    if native is None or not hasattr(native, "speculate_self"):
        return None
    max_tokens, factor, offset, min_prob, tree, alpha = params
    if hasattr(tree_mod, "alpha_table"):
        table: Any = tree_mod.alpha_table(alpha, nat.max_depth)
    else:
        table = alpha
    return native.speculate_self(seq_id, max_tokens, factor, offset, min_prob, tree, table)


def compare_nodes(nat: Any, ref: ReferenceSuffixTree) -> None:
    """Every node of the reference trie (root included): same count, same child list."""
    stack: list[tuple[int, ...]] = [()]
    while stack:
        path = stack.pop()
        expected = ref.children(path)
        got = native_children(nat, path)
        assert got == expected, f"children{path}: native {got} != reference {expected}"
        got_count = int(nat.count(list(path)))
        assert got_count == ref.count(path), f"count{path}: native {got_count}"
        stack.extend((*path, t) for t, _ in expected)


def compare_observed(
    nat: Any, ref: ReferenceSuffixTree, observed: list[list[int]], max_depth: int
) -> None:
    """Counts (and child lists) of every substring of every sequence seen so far, up to
    depth max_depth + 1, whether or not it is still in the trie."""
    seen: set[tuple[int, ...]] = set()
    for s in observed:
        n = len(s)
        for i in range(n):
            for j in range(i + 1, min(i + max_depth + 1, n) + 1):
                seen.add(tuple(s[i:j]))
    for path in sorted(seen):
        got = int(nat.count(list(path)))
        assert got == ref.count(path), f"count{path}: native {got} != {ref.count(path)}"
        assert native_children(nat, path) == ref.children(path), f"children{path}"


def compare_sequences(nat: Any, ref: ReferenceSuffixTree, ids: Sequence[int]) -> None:
    assert int(nat.num_seqs) == ref.num_seqs
    for sid in ids:
        assert bool(nat.contains(sid)) == ref.contains(sid)
        if ref.contains(sid):
            assert int(nat.seq_len(sid)) == ref.seq_len(sid)
            assert ints(nat.sequence(sid)) == ref.sequence(sid)


def compare_queries(
    nat: Any, ref: ReferenceSuffixTree, queries: list[Query], ids: Sequence[int]
) -> None:
    for q in queries:
        ctx: Any = np.asarray(q.context, dtype=np.int32) if q.as_numpy else q.context
        assert int(nat.match_len(ctx)) == ref.match_len(q.context), f"match_len({q.context})"
        got = spec_of(nat.speculate(ctx, *q.params))
        expected = spec_of(ref.speculate(q.context, *q.params))
        assert got == expected, f"speculate({q}): native {got} != reference {expected}"
    # the local source: a sequence drafting from its own tree
    for q in queries[:2]:
        for sid in ids:
            if not ref.contains(sid):
                continue
            r = native_speculate_self(nat, sid, q.params)
            if r is None:
                return
            expected = spec_of(ref.speculate(ref.sequence(sid), *q.params))
            assert spec_of(r) == expected, f"speculate_self({sid}, {q.params})"


def replay(sc: Scenario, nat: Any, ref: ReferenceSuffixTree | None) -> dict[int, list[int]]:
    """Replays the operations; with ``ref``, compares everything after each one."""
    ids = sorted({op.seq_id for op in sc.ops})
    current: dict[int, list[int]] = {}
    sealed: set[int] = set()

    def check() -> None:
        if ref is not None:
            nat.check_integrity()
            compare_sequences(nat, ref, ids)
            compare_nodes(nat, ref)
            compare_queries(nat, ref, sc.queries, ids)

    check()
    for op in sc.ops:
        if op.kind == "append":
            toks: Any = op.tokens if op.dtype is None else np.asarray(op.tokens, dtype=op.dtype)
            if op.seq_id in sealed:
                with pytest.raises(ValueError):
                    nat.append(op.seq_id, toks)
            else:
                nat.append(op.seq_id, toks)
                if ref is not None:
                    ref.append(op.seq_id, op.tokens)
                current.setdefault(op.seq_id, []).extend(op.tokens)
        elif op.kind == "seal":
            nat.seal(op.seq_id)
            sealed.add(op.seq_id)
        elif op.kind == "remove":
            nat.remove(op.seq_id)
            if ref is not None:
                ref.remove(op.seq_id)
            del current[op.seq_id]
            sealed.discard(op.seq_id)
        else:
            if ref is not None:
                with pytest.raises(ValueError):
                    ref.remove(op.seq_id)
            with pytest.raises(ValueError):
                nat.remove(op.seq_id)
        check()
    return current


def run_scenario(sc: Scenario) -> None:
    nat = SuffixTree(sc.max_depth)
    ref = ReferenceSuffixTree(sc.max_depth)
    empty_memory = int(nat.memory_bytes())
    empty_nodes = int(nat.num_nodes)
    current = replay(sc, nat, ref)
    compare_observed(nat, ref, sc.observed, sc.max_depth)

    # removing everything leaves an empty tree
    for sid in list(current):
        nat.remove(sid)
        ref.remove(sid)
        nat.check_integrity()
        compare_nodes(nat, ref)
    compare_observed(nat, ref, sc.observed, sc.max_depth)
    assert native_children(nat, []) == []
    assert int(nat.num_seqs) == 0
    assert int(nat.num_nodes) == empty_nodes

    # ... and nothing leaks: doing it all again ends with exactly the same memory
    # (whether that is about the empty tree's: test_memory_returns_to_empty)
    memory = int(nat.memory_bytes())
    assert memory >= empty_memory
    for sid in replay(sc, nat, None):
        nat.remove(sid)
    nat.check_integrity()
    assert int(nat.memory_bytes()) == memory


# ----------------------------------------------------------------------------- tests


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sc=scenarios())
def test_native_matches_reference(sc: Scenario) -> None:
    run_scenario(sc)


@pytest.mark.slow
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sc=scenarios(max_ops=30, max_chunk=20, max_queries=8))
def test_native_matches_reference_heavy(sc: Scenario) -> None:
    run_scenario(sc)


@st.composite
def repetitive(draw: st.DrawFn) -> tuple[int, list[list[int]], Params]:
    max_depth = draw(st.integers(1, 12))
    seqs = draw(st.lists(st.lists(st.integers(0, 2), max_size=40), min_size=1, max_size=3))
    return max_depth, seqs, draw(params_strategy(max_depth))


@settings(max_examples=150, deadline=None)
@given(case=repetitive())
def test_repetitive_sequences_speculate(case: tuple[int, list[list[int]], Params]) -> None:
    """Long, highly repetitive sequences (deep chains, many ties); every suffix of every
    sequence as a context."""
    max_depth, seqs, params = case
    nat = SuffixTree(max_depth)
    ref = ReferenceSuffixTree(max_depth)
    for i, s in enumerate(seqs):
        nat.append(i, s)
        ref.append(i, s)
    nat.check_integrity()
    compare_nodes(nat, ref)
    for s in seqs:
        for end in range(len(s) + 1):
            ctx = s[max(0, end - max_depth - 1) : end]
            assert int(nat.match_len(ctx)) == ref.match_len(ctx)
            assert spec_of(nat.speculate(ctx, *params)) == spec_of(ref.speculate(ctx, *params))
    for i in range(len(seqs)):
        r = native_speculate_self(nat, i, params)
        if r is not None:
            assert spec_of(r) == spec_of(ref.speculate(seqs[i], *params))
    nat.remove(0)
    ref.remove(0)
    nat.check_integrity()
    compare_nodes(nat, ref)


# Hand-computed examples of tests/spec/test_reference.py, over a grid of parameters.
EXAMPLES: list[tuple[int, list[list[int]]]] = [
    (4, [[1, 2, 3, 1, 2, 4, 1, 2, 3]]),
    (3, [[5, 1, 7], [5, 1, 7], [5, 2]]),
    (3, [[5, 1, 7], [5, 2, 8]]),
    (3, [[1, 2, 1, 2, 3], [2, 1, 2, 2]]),
    (1, [[1, 2, 3], [1, 2, 3], [4, 4]]),
    (2, [[1, 2, 3], [1, 2, 5]]),
]


@pytest.mark.parametrize(("max_depth", "seqs"), EXAMPLES)
def test_examples_parameter_grid(max_depth: int, seqs: list[list[int]]) -> None:
    nat = SuffixTree(max_depth)
    ref = ReferenceSuffixTree(max_depth)
    for i, s in enumerate(seqs):
        nat.append(i, s)
        ref.append(i, s)
    compare_nodes(nat, ref)
    contexts = {tuple(s[i:j]) for s in seqs for i in range(len(s)) for j in range(i, len(s) + 1)}
    table = [0.0, 0.0, 1.0, 3.0, 0.0, 0.5][: max_depth + 1]
    for ctx in sorted(contexts):
        for max_tokens in (0, 2, 10):
            for factor in (0.0, 0.5, 1.0, 2.0):
                for offset in (0.0, 1.0, 2.5):
                    for min_prob in (0.0, 0.1, 0.5):
                        for tree in (False, True):
                            for alpha in (0.0, 0.5, 1.0, table):
                                p: Params = (max_tokens, factor, offset, min_prob, tree, alpha)
                                assert spec_of(nat.speculate(ctx, *p)) == spec_of(
                                    ref.speculate(ctx, *p)
                                ), (ctx, p)
    for i in range(len(seqs)):
        nat.remove(i)
        ref.remove(i)
        nat.check_integrity()
        compare_nodes(nat, ref)


# ----------------------------------------------------------------------------- sources

PROPOSE_BATCH_ARGS = [
    "locals_",
    "local_ids",
    "groups",
    "global_tree",
    "budgets",
    "params",
    "local_alpha",
    "global_alpha",
    "group_weight",
    "merge",
]


@dataclass
class Batch:
    max_depth: int
    history: list[list[int]]  # the global tree's sequences
    groups: list[list[list[int]]]  # each group tree's sequences (maybe none)
    items: list[tuple[list[list[int]], int, int, bool]]  # chunks, group, budget, sealed
    params: Params
    local_alpha: Alpha
    global_alpha: Alpha
    group_weight: float
    use_global: bool
    merge: tuple[float, float] | None = None  # (threshold, source min_prob); None: best


MERGES = st.one_of(
    st.none(),
    st.tuples(
        st.sampled_from([0.05, 0.2, 0.36, 0.5, 0.75, 1.0]),
        st.sampled_from([0.0, 0.05, 0.1, 0.3]),
    ),
)


@st.composite
def batches(draw: st.DrawFn, merge: st.SearchStrategy[tuple[float, float] | None] = MERGES,
            max_budget: int = 10) -> Batch:
    max_depth = draw(st.integers(1, 8))
    tok = st.integers(0, 3)
    history = draw(st.lists(st.lists(tok, max_size=25), max_size=4))
    groups = draw(
        st.lists(st.lists(st.lists(tok, max_size=25), max_size=3), min_size=1, max_size=3)
    )
    pool = [s for s in history + [s for g in groups for s in g] if s]
    items = []
    for _ in range(draw(st.integers(1, 4))):
        seq: list[int] = []
        if pool and draw(st.booleans()):
            s = draw(st.sampled_from(pool))
            end = draw(st.integers(0, len(s)))
            seq = s[draw(st.integers(0, end)) : end]
        seq = draw(st.lists(tok, max_size=4)) + seq + draw(st.lists(tok, max_size=1))
        cut = sorted(draw(st.lists(st.integers(0, len(seq)), max_size=2)))
        chunks = [seq[a:b] for a, b in zip([0, *cut], [*cut, len(seq)], strict=True)]
        group = draw(st.integers(0, len(groups) - 1))
        budget = draw(st.integers(1, max_budget)) if draw(st.integers(0, 7)) else 0
        items.append((chunks, group, budget, draw(st.booleans())))
    return Batch(
        max_depth,
        history,
        groups,
        items,
        draw(params_strategy(max_depth).filter(lambda p: p[0] > 0)),
        draw(alpha_strategy(max_depth)),
        draw(alpha_strategy(max_depth)),
        draw(st.sampled_from([0.0, 0.5, 1.0, 2.0])),
        draw(st.booleans()),
        draw(merge),
    )


def build(max_depth: int, seqs: list[list[int]]) -> tuple[Any, ReferenceSuffixTree]:
    nat = SuffixTree(max_depth)
    ref = ReferenceSuffixTree(max_depth)
    for i, s in enumerate(seqs):
        nat.append(i, s)
        ref.append(i, s)
    return nat, ref


def check_batch(b: Batch) -> None:
    """The native batched proposal against ``reference_propose`` (section 4, with its
    early cut-offs) or, with ``b.merge``, ``reference_merge`` (section 6)."""
    propose_batch = getattr(tree_mod, "propose_batch", None)
    if propose_batch is None or list(inspect.signature(propose_batch).parameters) != (
        PROPOSE_BATCH_ARGS
    ):
        pytest.skip("war.spec.tree.propose_batch is missing or its signature changed")
    d = b.max_depth
    global_nat, global_ref = build(d, b.history)
    group_trees = [build(d, g) for g in b.groups]
    local_id = 7
    locals_nat, locals_ref = [], []
    for chunks, _, _, sealed in b.items:
        nat, ref = SuffixTree(d), ReferenceSuffixTree(d)
        for c in chunks:
            nat.append(local_id, c)
            ref.append(local_id, c)
        if sealed and HAS_SEAL:
            nat.seal(local_id)
        locals_nat.append(nat)
        locals_ref.append(ref)
    max_tokens, factor, offset, min_prob, tree, alpha = b.params
    out = propose_batch(
        locals_nat,
        [local_id] * len(b.items),
        [group_trees[g][0] for _, g, _, _ in b.items],
        global_nat if b.use_global else None,
        np.asarray([budget for _, _, budget, _ in b.items], dtype=np.int32),
        tree_mod.draft_params(max_tokens, factor, offset, min_prob, tree, alpha, d),
        tree_mod.alpha_table(b.local_alpha, d),
        tree_mod.alpha_table(b.global_alpha, d),
        b.group_weight,
        None if b.merge is None else tree_mod.MergeParams(*b.merge),
    )
    for i, (_, g, budget, _) in enumerate(b.items):
        ref = locals_ref[i]
        ctx = ref.sequence(local_id)
        group_ref = group_trees[g][1]
        sources = [
            ("group", group_ref, ctx, b.group_weight),
            ("local", ref, ctx, 1.0),
            ("global", global_ref if b.use_global else None, ctx, 1.0),
        ]
        source_alphas = [alpha, b.local_alpha, b.global_alpha]
        if b.merge is None:
            name, expected = reference_propose(
                sources, min(max_tokens, budget), factor, offset, min_prob, tree, alpha,
                source_alphas=source_alphas,
            )
        else:
            threshold, source_min_prob = b.merge
            name, expected = reference_merge(
                sources, min(max_tokens, budget), factor, offset, source_min_prob, threshold,
                tree, alpha, source_alphas=source_alphas,
            )
        lo, hi = int(out.offsets[i]), int(out.offsets[i + 1])
        got = (
            ints(out.token_ids[lo:hi]),
            ints(out.parents[lo:hi]),
            [float(p) for p in out.probs[lo:hi]],
            float(out.scores[i]),
            int(out.match_lens[i]),
        )
        got_name = tree_mod.SOURCE_NAMES[int(out.sources[i])]
        assert (got_name, got) == (name, spec_of(expected)), f"item {i}"
        if b.merge is not None:
            # a merged draft: parents precede children, values within [threshold, 1],
            # never more tokens than the budget, chains when not a tree
            assert len(got[0]) <= min(max_tokens, budget)
            assert all(-1 <= p < j for j, p in enumerate(got[1]))
            assert all(b.merge[0] <= v <= 1.0 for v in got[2])
            if not tree:
                assert got[1] == list(range(-1, len(got[1]) - 1))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(b=batches())
def test_propose_batch_matches_reference(b: Batch) -> None:
    """The native batched choice or merge of group, local and global drafts against the
    reference (best and merge, mixed)."""
    check_batch(b)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(b=batches(merge=MERGES.filter(lambda m: m is not None), max_budget=3))
def test_propose_batch_merge_small_budgets(b: Batch) -> None:
    """The merge alone with budgets 0 to 3 (the cut at the budget, ties near the top)."""
    check_batch(b)


def test_propose_batch_merge_examples() -> None:
    """Hand-checked merges: noisy-or of two sources, ties, threshold, chain vs tree."""
    d = 4
    group_nat, group_ref = build(d, [[1, 2, 3, 4], [1, 2, 3, 5]])
    global_nat, global_ref = build(d, [[1, 2, 3, 4], [1, 2, 6, 7]])
    local_nat, local_ref = build(d, [[9, 1, 2]])
    for tree, threshold, budget in itertools.product((False, True), (0.2, 0.5, 0.8), (0, 1, 4)):
        b_tree = tree_mod.draft_params(8, 2.0, 0.0, 0.9, tree, 0.0, d)
        out = tree_mod.propose_batch(
            [local_nat], [0], [group_nat], global_nat, np.asarray([budget], dtype=np.int32),
            b_tree, tree_mod.alpha_table(0.0, d), tree_mod.alpha_table(0.0, d), 1.0,
            tree_mod.MergeParams(threshold, 0.0),
        )
        name, expected = reference_merge(
            [("group", group_ref, [9, 1, 2], 1.0), ("local", local_ref, [9, 1, 2], 1.0),
             ("global", global_ref, [9, 1, 2], 1.0)],
            budget, 2.0, 0.0, 0.0, threshold, tree, 0.0,
        )
        got = (ints(out.token_ids), ints(out.parents), [float(p) for p in out.probs],
               float(out.scores[0]), int(out.match_lens[0]))
        assert (tree_mod.SOURCE_NAMES[int(out.sources[0])], got) == (name, spec_of(expected))
        # group: 3 (p 1), then 4 or 5 (0.5 each); global: 3 and 6 (0.5 each), then 4, 7
        # (0.5 each). Merged: 3 -> 1 - 0 * 0.5 = 1.0 (group's term the largest),
        # 3 4 -> 1 - 0.5 * 0.5 = 0.75, 3 5 -> 0.5, 6 -> 0.5, 6 7 -> 0.5.
        if budget == 0:
            assert name == "none" and expected == empty_result()
            continue
        assert name == "group" and expected.match_len == 2
        if tree:
            want = [((3,), 1.0), ((3, 4), 0.75), ((6,), 0.5), ((3, 5), 0.5), ((6, 7), 0.5)]
        else:
            want = [((3,), 1.0), ((3, 4), 0.75)]
        want = [w for w in want if w[1] >= threshold][:budget]
        assert expected.probs == [v for _, v in want]
        assert expected.token_ids == [p[-1] for p, _ in want]


# ----------------------------------------------------------------------------- memory


def random_sequences(seed: int, n: int, length: int, vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, size=length).tolist() for _ in range(n)]


@pytest.mark.parametrize(
    ("max_depth", "seqs", "slack"),
    [
        (8, [[0] * 8 + [1]], 2048),
        (3, [[1, 2, 3, 1, 2, 4, 1, 2, 3], [5, 1, 7]], 2048),
        (12, random_sequences(0, 4, 1000, 50), 16 * 1024),
    ],
    ids=["chain", "small", "large"],
)
def test_memory_returns_to_empty(max_depth: int, seqs: list[list[int]], slack: int) -> None:
    """After every sequence is removed, memory_bytes() is about the new tree's again:
    containers may keep some capacity (``slack``), but nothing that grows with the number
    of nodes or tokens once held."""
    t = SuffixTree(max_depth)
    empty = int(t.memory_bytes())
    for i, s in enumerate(seqs):
        t.append(i, s)
    full = int(t.memory_bytes())
    assert full > empty
    for i in range(len(seqs)):
        t.remove(i)
    t.check_integrity()
    assert int(t.num_nodes) == int(SuffixTree(max_depth).num_nodes)
    after = int(t.memory_bytes())
    assert after <= empty + slack, (
        f"memory_bytes: {empty} new, {full} full, {after} after removing everything"
    )


def test_errors_agree() -> None:
    for bad in (0, -1):
        with pytest.raises(ValueError):
            SuffixTree(bad)
        with pytest.raises(ValueError):
            ReferenceSuffixTree(bad)
    nat = SuffixTree(3)
    ref = ReferenceSuffixTree(3)
    for t in (nat, ref):
        with pytest.raises(ValueError):
            t.remove(5)
        with pytest.raises(ValueError):
            t.append(1, [1, -1])
        with pytest.raises(ValueError):
            t.append(1, [MAX_TOKEN + 1])
        assert not t.contains(1)
        with pytest.raises(ValueError):
            t.speculate([1], 10, 1.0, 0.0, 0.0, False, [0.0] * 3)  # table too short
        t.append(5, [])
        assert t.contains(5)
        assert int(t.seq_len(5)) == 0
        assert int(t.num_seqs) == 1
        t.remove(5)
        assert not t.contains(5)
        assert int(t.count([])) == 0
        t.check_integrity()


@st.composite
def repetitive_trees(draw: st.DrawFn) -> tuple[int, list[list[int]], list[Params]]:
    """Sequences over two or three tokens built from repeated blocks: many match lengths
    of a context occur exactly as often as the next longer one (section 3's skip)."""
    max_depth = draw(st.integers(2, 14))
    alphabet = st.integers(0, draw(st.integers(1, 2)))
    seqs = []
    for _ in range(draw(st.integers(1, 4))):
        block = draw(st.lists(alphabet, min_size=1, max_size=6))
        tail = draw(st.lists(alphabet, max_size=4))
        seqs.append(block * draw(st.integers(1, 6)) + tail)
    params = []
    for _ in range(draw(st.integers(1, 4))):
        a = draw(st.sampled_from([0.0, 0.3, 1.0, 2.5]))
        decay = draw(st.sampled_from([1.0, 0.85, 0.5, 0.0]))
        if draw(st.integers(0, 4)) == 0:  # growing with depth: the skip must stay off
            alpha: Alpha = [a * 0.5 + 0.1 * d for d in range(max_depth + 1)]
        else:
            alpha = [a * decay**d for d in range(max_depth + 1)]
        params.append((draw(st.integers(0, 2 * max_depth)),
                       draw(st.sampled_from([0.5, 1.0, 2.0, 4.0])),
                       draw(st.sampled_from([0.0, 1.0])),
                       draw(st.sampled_from([0.0, 0.05, 0.2])), draw(st.booleans()), alpha))
    return max_depth, seqs, params


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(repetitive_trees())
def test_match_lengths_with_the_same_occurrences_skip_exactly(
    case: tuple[int, list[list[int]], list[Params]],
) -> None:
    """The native trees skip a match length whose string occurs as often as a longer
    one already tried (docs section 3); the reference tries every match length. Their
    drafts agree exactly, from every suffix of every sequence, and for each sequence
    drafting from its own tree."""
    max_depth, seqs, params = case
    nat = tree_mod.SuffixTree(max_depth)
    ref = ReferenceSuffixTree(max_depth)
    for sid, s in enumerate(seqs):
        nat.append(sid, s)
        ref.append(sid, s)
    contexts = {tuple(s[:end]) for s in seqs for end in range(1, len(s) + 1)}
    for p in params:
        for ctx in sorted(contexts):
            got = spec_of(nat.speculate(list(ctx), *p))
            expected = spec_of(ref.speculate(list(ctx), *p))
            assert got == expected, f"speculate({ctx}, {p})"
        for sid in range(len(seqs)):
            r = native_speculate_self(nat, sid, p)
            assert r is not None
            assert spec_of(r) == spec_of(ref.speculate(ref.sequence(sid), *p)), (sid, p)
