"""The speculator API: trajectories, grouped history, memory bounds, bad input."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import numpy as np
import pytest

from war.spec import SpecConfig, SuffixSpeculator
from war.types import Draft

# A config that drafts whatever was seen once (no smoothing, no probability floor),
# so tests can predict drafts exactly.
EXACT = SpecConfig(
    max_depth=16, max_spec_tokens=8, factor=8.0, min_prob=0.0, alpha=0.0, local_alpha=0.0,
    global_alpha=0.0, alpha_decay=1.0, lead_in=2, merge_threshold=0.0, merge_min_prob=0.0,
)


_COMBINE = {"value": "best"}


@pytest.fixture(autouse=True, params=["best", "merge"])
def combine(request: pytest.FixtureRequest) -> Iterator[str]:
    """Every test's ``spec()`` runs with both ways of combining sources (with EXACT's
    settings they draft the same in these tests)."""
    _COMBINE["value"] = str(request.param)
    yield _COMBINE["value"]
    _COMBINE["value"] = "best"


def spec(**overrides: object) -> SuffixSpeculator:
    values: dict[str, object] = {"combine": _COMBINE["value"], **overrides}
    return SuffixSpeculator(dataclasses.replace(EXACT, **values))  # type: ignore[arg-type]


def snapshot(s: SuffixSpeculator) -> tuple[int, int, int, int]:
    return (s.num_active, s.history_tokens, s.num_history_entries, s.memory_bytes())


# ------------------------------------------------------------------ lifecycle


def test_default_config_is_valid_and_drafts() -> None:
    s = SuffixSpeculator()
    s.start(1, [5, 6, 7, 8, 9, 5, 6, 7], group_id="t")
    (d,) = s.propose([1])
    assert isinstance(d, Draft)
    assert d.token_ids[:1] == (8,)
    assert d.source == "local"


def test_multi_turn_appends_only_new_tokens() -> None:
    s = spec()
    s.start(1, [1, 2, 3], group_id="a")
    s.extend(1, [4, 5])
    s.new_turn(1, [6, 7])
    s.extend(1, [8])
    assert s.context_len(1) == 8
    # The trajectory's own tree holds each token once: nothing was re-inserted.
    assert s.num_cached_tokens == 8 + s.history_tokens
    # The first response (with its 2-token lead-in) went to the history.
    assert s.num_history_entries == 1
    assert s.history_tokens == 2 + 2


def test_end_response_commits_once_and_new_turn_only_appends() -> None:
    s, t = spec(), spec()  # s ends its response explicitly, t leaves it to new_turn
    for x in (s, t):
        x.start(1, [1, 2, 3], group_id="a")
        x.extend(1, [4, 5])
    s.end_response(1)
    # The response is in the history before the next turn arrives...
    assert (s.num_history_entries, s.history_tokens) == (1, 2 + 2)
    s.start(2, [9, 3], group_id="a")
    assert s.propose([2])[0].source == "group"
    s.finish(2, commit=False)
    s.end_response(1)  # ...once: nothing new was generated since
    assert (s.num_history_entries, s.history_tokens) == (1, 4)
    s.new_turn(1, [6, 7])  # appends only
    t.new_turn(1, [6, 7])  # commits, then appends
    for x in (s, t):
        x.extend(1, [8])
        x.end_response(1)
        x.finish(1)  # nothing left to commit
    assert (s.num_history_entries, s.history_tokens) == (2, 4 + 2 + 1)
    assert snapshot(s)[1:3] == snapshot(t)[1:3]


def test_group_history_is_preferred_and_scoped() -> None:
    s = spec()
    # Task A answered "x y z", task B "p q r" after the same context.
    for tid, group, answer in ((1, "A", [10, 11, 12]), (2, "B", [20, 21, 22])):
        s.start(tid, [1, 2, 3], group_id=group)
        s.extend(tid, answer)
        s.finish(tid)
    s.start(3, [1, 2, 3], group_id="A")
    s.start(4, [1, 2, 3], group_id="B")
    s.start(5, [1, 2, 3], group_id="C")
    da, db, dc = s.propose([3, 4, 5])
    assert da.source == "group" and da.token_ids == (10, 11, 12)
    assert db.source == "group" and db.token_ids == (20, 21, 22)
    # A group without history falls back to everyone's history.
    assert dc.source == "global" and dc.token_ids[0] in (10, 20)


def test_groups_ignored_with_zero_weight() -> None:
    s = spec(group_weight=0.0)
    s.start(1, [1, 2, 3], group_id="A")
    s.extend(1, [10, 11])
    s.finish(1)
    s.start(2, [1, 2, 3], group_id="A")
    (d,) = s.propose([2])
    assert d.source == "global" and d.token_ids == (10, 11)


def test_without_global_history() -> None:
    s = spec(use_global=False)
    s.start(1, [1, 2, 3], group_id="A")
    s.extend(1, [10, 11])
    s.finish(1)
    s.start(2, [1, 2, 3], group_id="B")
    (d,) = s.propose([2])
    assert d == Draft((), (), (), 0.0, "none", 0)
    s.check_integrity()


def test_ungrouped_trajectories_share_global_history() -> None:
    s = spec()
    s.start(1, [1, 2, 3])
    s.extend(1, [10, 11])
    s.finish(1)
    s.start(2, [1, 2, 3])
    (d,) = s.propose([2])
    assert d.source == "global" and d.token_ids == (10, 11)


def test_finish_without_commit_leaves_history_alone() -> None:
    s = spec()
    s.start(1, [1, 2, 3], group_id="A")
    s.extend(1, [10, 11])
    s.finish(1, commit=False)
    assert s.num_history_entries == 0 and s.num_active == 0
    assert 1 not in s


def test_add_history_from_elsewhere() -> None:
    s = spec()
    s.add_history([1, 2, 3, 40, 41], group_id="A")
    s.add_history([], group_id="A")  # nothing to add
    assert s.num_history_entries == 1
    s.start(1, [9, 2, 3], group_id="A")
    (d,) = s.propose([1])
    assert d.token_ids == (40, 41) and d.source == "group"


# ------------------------------------------------------------------ drafting


def test_budgets_cap_and_zero() -> None:
    s = spec()
    s.start(1, [1, 2, 3, 4, 5, 6, 1, 2], group_id="A")
    s.start(2, [1, 2, 3, 4, 5, 6, 1, 2], group_id="A")
    full, capped = s.propose([1, 2], budgets=[8, 2])
    assert full.token_ids == (3, 4, 5, 6, 1, 2)
    assert capped.token_ids == (3, 4)
    (none,) = s.propose([1], budgets=0)
    assert len(none) == 0 and none.source == "none"
    (default,) = s.propose([1])
    assert default == full


def test_batched_equals_single_and_is_deterministic() -> None:
    rng = np.random.default_rng(0)

    def build() -> SuffixSpeculator:
        s = SuffixSpeculator(SpecConfig(max_depth=12))
        for tid in range(6):
            s.start(tid, rng_tokens[tid], group_id=tid % 2)
        return s

    rng_tokens = [rng.integers(0, 6, size=40).astype(np.int32) for _ in range(6)]
    a, b = build(), build()
    ids = list(range(6))
    batch = a.propose(ids)
    assert batch == b.propose(ids)
    assert batch == [a.propose([i])[0] for i in ids]
    for d in batch:
        assert all(p < i for i, p in enumerate(d.parents))


def test_tree_drafts_branch() -> None:
    s = spec(tree=True, max_spec_tokens=4)
    s.start(1, [1, 2, 7, 1, 2, 8, 1, 2, 7, 9, 1, 2], group_id=None)
    (d,) = s.propose([1])
    # After "1 2": 7 twice, 8 once: both branches are proposed.
    assert d.token_ids[0] == 7 and 8 in d.token_ids
    assert d.parents[d.token_ids.index(8)] == -1
    assert not d.is_chain


# ------------------------------------------------------------------ memory bounds


def test_history_window_over_rl_steps() -> None:
    s = spec(history_window_steps=2)
    for step in range(4):
        s.observe_step(step)
        s.start(step, [1, 2, 3], group_id="A")
        s.extend(step, [50 + step, 60 + step])
        s.finish(step)
    # Steps 2 and 3 remain (window of 2 steps).
    assert s.num_history_entries == 2
    s.add_history([1, 2, 3, 70], group_id="A", rl_step=1)  # already outside the window
    assert s.num_history_entries == 2
    s.observe_step(5)
    assert s.num_history_entries == 0 and s.history_tokens == 0
    s.check_integrity()
    with pytest.raises(ValueError, match="backwards"):
        s.observe_step(4)


def test_token_budget_bounds_memory() -> None:
    rng = np.random.default_rng(1)
    bounded = spec(history_token_budget=200, max_depth=32)
    unbounded = spec(max_depth=32)
    peak = 0
    for tid in range(60):
        prompt = rng.integers(0, 50, size=20)
        answer = rng.integers(0, 50, size=30)
        for s in (bounded, unbounded):
            s.start(tid, prompt, group_id=tid % 3)
            s.extend(tid, answer)
            s.finish(tid)
        assert bounded.history_tokens <= 200
        peak = max(peak, bounded.memory_bytes())
    bounded.check_integrity()
    assert unbounded.history_tokens == 60 * 32
    # Memory follows the budget, not the amount of traffic.
    assert peak < unbounded.memory_bytes() / 3
    # Oldest entries went first: the newest response is still drafted.
    bounded.start(999, [*prompt[-2:]], group_id=59 % 3)
    (d,) = bounded.propose([999])
    assert d.token_ids[:3] == tuple(int(t) for t in answer[:3])


def test_budget_smaller_than_one_entry_keeps_history_empty() -> None:
    s = spec(history_token_budget=3)
    s.start(1, [1, 2], group_id="A")
    s.extend(1, [3, 4, 5, 6])
    s.finish(1)
    assert s.history_tokens == 0 and s.num_history_entries == 0
    s.check_integrity()


def test_an_entry_larger_than_the_budget_leaves_the_history_as_it_was() -> None:
    s = spec(history_token_budget=20, lead_in=0)
    s.start(1, [1], group_id="A")
    s.extend(1, [7, 8, 9, 10])
    s.finish(1)
    assert s.history_tokens == 4
    s.start(2, [1], group_id="A")
    s.extend(2, list(range(20, 45)))  # 25 tokens: it could never be held
    s.finish(2)
    assert s.history_tokens == 4 and s.num_history_entries == 1  # the earlier one stays
    s.start(3, [7, 8], group_id="A")
    (d,) = s.propose([3])
    assert d.token_ids[:2] == (9, 10)
    s.check_integrity()


def test_entries_no_tree_holds_are_not_counted() -> None:
    """Without the global history an entry with no group is held nowhere: it must not
    count against the budget (it evicted the group entries that are held)."""
    s = spec(history_token_budget=10, use_global=False, lead_in=0)
    s.start(1, [1], group_id="A")
    s.extend(1, [5, 6, 7])
    s.finish(1)
    for tid in range(2, 6):  # trajectories without a group
        s.start(tid, [1])
        s.extend(tid, [30 + tid, 40 + tid, 50 + tid])
        s.finish(tid)
    assert s.num_history_entries == 1 and s.history_tokens == 3
    s.start(9, [5], group_id="A")
    (d,) = s.propose([9])
    assert d.token_ids[:2] == (6, 7)
    s.check_integrity()


# ------------------------------------------------------------------ bad input


BAD_TOKENS = [
    np.array([1.0, 2.0]),
    np.array([True, False]),
    np.array([[1, 2]]),
    np.array([-1, 2]),
    np.array([2**31], dtype=np.int64),
    [1, 2.5],
    [1, True],
    [1, -3],
    [1, 2**40],
    "123",
    3,
    [[1, 2]],
]


@pytest.mark.parametrize("bad", BAD_TOKENS, ids=repr)
def test_bad_tokens_change_nothing(bad: object) -> None:
    s = spec()
    s.start(1, [1, 2, 3], group_id="A")
    s.extend(1, [4])
    before = snapshot(s), s.context_len(1)
    for call in (
        lambda: s.extend(1, bad),  # type: ignore[arg-type]
        lambda: s.new_turn(1, bad),  # type: ignore[arg-type]
        lambda: s.start(2, bad),  # type: ignore[arg-type]
        lambda: s.add_history(bad),  # type: ignore[arg-type]
    ):
        with pytest.raises(ValueError):
            call()
        assert (snapshot(s), s.context_len(1)) == before
    s.check_integrity()


def test_bad_ids_and_budgets_change_nothing() -> None:
    s = spec()
    s.start(1, [1, 2, 3], group_id="A")
    before = snapshot(s)
    cases = [
        (lambda: s.start(1, [1]), "already started"),
        (lambda: s.extend(7, [1]), "unknown sequence id 7"),
        (lambda: s.new_turn(7, [1]), "unknown sequence id 7"),
        (lambda: s.end_response(7), "unknown sequence id 7"),
        (lambda: s.finish(7), "unknown sequence id 7"),
        (lambda: s.propose([1, 7]), "unknown sequence id 7"),
        (lambda: s.propose([1, 1]), "twice"),
        (lambda: s.propose([1], budgets=-1), "budget"),
        (lambda: s.propose([1], budgets=[1, 2]), "budgets for 1"),
        (lambda: s.propose([1], budgets=[1.5]), "budgets must be ints"),
        (lambda: s.propose([1], budgets=2.5), "budgets must be an int or a sequence"),
        (lambda: s.propose([1], budgets="3"), "budgets must be an int or a sequence"),
        (lambda: s.start(True, [1]), "sequence id"),
        (lambda: s.start(2**64, [1]), "int64"),
        (lambda: s.start(2, [1], group_id=["unhashable"]), "hashable"),
        (lambda: s.start(2, [1], group_id=float("nan")), "NaN"),
        (lambda: s.start(2, [1], group_id=("task", (float("nan"),))), "NaN"),
        (lambda: s.add_history([1, 2], group_id=float("nan")), "NaN"),
        (lambda: s.observe_step(-1), "backwards"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError, match=message):
            call()
        assert snapshot(s) == before
    assert s.context_len(1) == 3


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_depth", 0),
        ("max_spec_tokens", -1),
        ("factor", -1.0),
        ("offset", float("nan")),
        ("min_prob", 1.5),
        ("alpha", -0.1),
        ("alpha_decay", 1.5),
        ("local_alpha", float("inf")),
        ("global_alpha", "1"),
        ("group_weight", -1.0),
        ("tree", 1),
        ("use_global", "yes"),
        ("lead_in", -1),
        ("history_window_steps", 0),
        ("history_token_budget", -5),
        ("max_depth", 2**40),
        ("combine", "mix"),
        ("combine", None),
        ("merge_threshold", 1.5),
        ("merge_threshold", -0.1),
        ("merge_threshold", float("nan")),
        ("merge_min_prob", -0.5),
        ("merge_min_prob", "0.1"),
    ],
)
def test_config_rejects_bad_values(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        SpecConfig(**{field: value})  # type: ignore[arg-type]


def test_alpha_table_decays_with_depth() -> None:
    c = SpecConfig(max_depth=3, alpha=2.0, alpha_decay=0.5, local_alpha=4.0)
    assert c.alpha_table() == (2.0, 1.0, 0.5, 0.25)
    assert c.alpha_table(c.local_alpha) == (4.0, 2.0, 1.0, 0.5)
    assert SpecConfig.tree_preset(min_prob=0.2).tree


def test_combine_settings_and_baseline() -> None:
    assert SpecConfig().combine == "best" and SpecConfig.tree_preset().combine == "best"
    assert (SpecConfig().merge_threshold, SpecConfig.tree_preset().merge_threshold) == (0.36, 0.38)
    for mode in ("path", "tree"):
        assert SpecConfig.baseline(mode).combine == "best"
    SpecConfig(combine="best", merge_threshold=0.0, merge_min_prob=1.0)  # valid


def test_best_and_merge_differ_as_specified() -> None:
    """The group saw 10 11 once, two other tasks 10 12: "best" keeps the global draft
    alone (10 12); "merge" adds up the evidence of both for each path (10 11)."""
    drafts = {}
    for combine in ("best", "merge"):
        s = spec(combine=combine, merge_threshold=0.38, alpha=1.0, global_alpha=1.0)
        for tid, group, answer in ((1, "A", [10, 11]), (2, "B", [10, 12]), (3, "C", [10, 12])):
            s.start(tid, [1, 2, 3], group_id=group)
            s.extend(tid, answer)
            s.finish(tid)
        s.start(4, [1, 2, 3], group_id="A")
        (drafts[combine],) = s.propose([4])
    best, merged = drafts["best"], drafts["merge"]
    # group A: 10 (1/2), 10 11 (1/4); global: 10 (3/4), 10 12 (3/8), 10 11 (3/16)
    assert best.source == "global" and best.token_ids == (10, 12)
    assert best.probs == (0.75, 0.375) and best.match_len == 2
    # merged: 10 -> 1 - (1 - 1/2)(1 - 3/4) = 7/8; 10 11 -> 1 - (3/4)(13/16) = 25/64;
    # 10 12 -> 3/8 < 25/64; the global source has the larger term on 10
    assert merged.source == "global" and merged.token_ids == (10, 11)
    assert merged.probs == (0.875, 0.390625) and merged.score == 1.265625
    assert merged.match_len == 2


@pytest.mark.parametrize("n", [0, 1, 3, 64, 65, 300])
def test_list_and_array_extends_build_the_same_trees(n: int) -> None:
    # A list or tuple of plain ints takes the native path (a separate buffer above
    # 64 tokens); NumPy ints in a list and arrays take the validating path.
    rng = np.random.default_rng(n)
    tokens = rng.integers(0, 7, size=n)
    forms = [tokens.tolist(), tuple(tokens.tolist()), tokens.astype(np.int64),
             [np.int64(t) for t in tokens]]
    results = []
    for form in forms:
        s = spec()
        s.start(1, [1, 2, 3], group_id="A")
        s.extend(1, form)
        s.extend(1, [2**31 - 1, 0])
        s.end_response(1)
        s.start(2, [1, 2], group_id="A")
        s.check_integrity()
        d = s.propose([2])[0]
        results.append((s.context_len(1), snapshot(s), d.token_ids, d.probs))
    assert results[0][0] == n + 5
    assert results[1:] == results[:1] * 3


@pytest.mark.parametrize(
    "bad", [[0] * 70 + [-1], (5,) * 10 + (2**31,), [1, 2, 3, True], (1, 2.0)], ids=repr
)
def test_a_bad_token_late_in_a_list_changes_nothing(bad: list[int] | tuple[int, ...]) -> None:
    s = spec()
    s.start(1, [1, 2, 3], group_id="A")
    before = snapshot(s), s.context_len(1)
    with pytest.raises(ValueError, match="token ids"):
        s.extend(1, bad)
    assert (snapshot(s), s.context_len(1)) == before
    s.check_integrity()


def test_propose_arrays_types_and_agreement_with_propose() -> None:
    rng = np.random.default_rng(3)
    s = spec(tree=True, max_spec_tokens=12, min_prob=0.05)
    for i in range(6):
        s.start(i, rng.integers(0, 5, size=200), group_id=i % 2)
    for i in range(3):
        s.end_response(i)  # nothing generated: no entry
    s.extend(0, rng.integers(0, 5, size=50).tolist())
    s.end_response(0)
    ids = [5, 3, 1, 4]
    out = s.propose_arrays(ids, [12, 0, 5, 12])
    dtypes = [a.dtype for a in out]
    assert dtypes == [np.int32, np.int32, np.float64, np.int64, np.float64, np.int8, np.int32]
    assert all(a.flags.writeable and a.ndim == 1 for a in out)
    assert out.offsets.tolist()[0] == 0 and len(out.offsets) == len(ids) + 1
    assert len(out.scores) == len(out.sources) == len(out.match_lens) == len(ids)
    total = int(out.offsets[-1])
    assert len(out.token_ids) == len(out.parents) == len(out.probs) == total > 0
    assert out.offsets[2] == out.offsets[1]  # budget 0
    drafts = s.propose(ids, [12, 0, 5, 12])
    for d in drafts:  # made natively, they behave as any Draft
        built = Draft(d.token_ids, d.parents, d.probs, d.score, d.source, d.match_len)
        assert type(d) is Draft and d == built and hash(d) == hash(built)
        assert dataclasses.replace(d, score=0.5).score == 0.5
        with pytest.raises(dataclasses.FrozenInstanceError):
            d.score = 1.0  # type: ignore[misc]
    assert drafts[1] == Draft((), (), (), 0.0, "none", 0)
    for i, d in enumerate(drafts):
        a, b = out.offsets[i], out.offsets[i + 1]
        assert d.token_ids == tuple(out.token_ids[a:b].tolist())
        assert d.parents == tuple(out.parents[a:b].tolist())
        assert d.probs == tuple(out.probs[a:b].tolist())
        assert (d.score, d.match_len) == (out.scores[i], out.match_lens[i])
    empty = s.propose_arrays([])
    assert [len(a) for a in empty] == [0, 0, 0, 1, 0, 0, 0]


def test_contains_takes_only_int_ids() -> None:
    s = spec()
    s.start(1, [1, 2, 3])
    assert 1 in s and np.int64(1) in s
    # True and 1.0 hash as 1; a list is unhashable.
    assert True not in s and 1.0 not in s and [1] not in s


def test_propose_refuses_non_sequences_and_duplicates_from_iterators() -> None:
    s = spec()
    s.start(1, [1, 2, 3])
    before = snapshot(s)
    with pytest.raises(ValueError, match="seq_ids"):
        s.propose(1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="sequence 1 appears twice"):
        s.propose(iter([1, 1]))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="budgets must be an int or a sequence"):
        s.propose([1], budgets=np.array(3))  # type: ignore[arg-type]
    assert snapshot(s) == before


def test_finish_commit_must_be_a_bool() -> None:
    s = spec()
    s.start(1, [1, 2, 3], group_id="A")
    s.extend(1, [4, 5])
    before = snapshot(s)
    with pytest.raises(ValueError, match="commit"):
        s.finish(1, commit="no")  # type: ignore[arg-type]
    assert snapshot(s) == before and 1 in s
    s.finish(1, commit=np.bool_(False))
    assert s.num_history_entries == 0


def test_add_history_refuses_negative_rl_steps_and_bytes() -> None:
    s = spec(history_window_steps=2)
    before = snapshot(s)
    with pytest.raises(ValueError, match="rl_step must be >= 0"):
        s.add_history([1, 2, 3], group_id="A", rl_step=-1)
    for bad in (bytearray(b"\x01\x02"), memoryview(b"\x01\x02")):
        with pytest.raises(ValueError, match="sequence of ints"):
            s.add_history(bad)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="sequence of ints"):
            s.start(1, bad)  # type: ignore[arg-type]
    assert snapshot(s) == before and s.num_active == 0


def test_config_stores_numpy_scalars_as_python_values() -> None:
    c = SpecConfig(
        max_depth=np.int64(8), alpha=np.float32(0.5), tree=np.bool_(True),
        combine=np.str_("merge"), history_token_budget=np.uint16(100),
    )
    assert c == SpecConfig(max_depth=8, alpha=0.5, tree=True, combine="merge",
                           history_token_budget=100)
    assert type(c.max_depth) is int and type(c.alpha) is float and type(c.tree) is bool
    assert type(c.history_token_budget) is int and type(c.combine) is str
    SuffixSpeculator(c).start(1, [1, 2])
    with pytest.raises(ValueError, match="max_depth"):
        SpecConfig(max_depth=np.int64(0))
