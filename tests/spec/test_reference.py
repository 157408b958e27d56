"""Hand-computed cases for the pure-Python reference (docs/suffix-speculation.md).

Every expected value below was worked out by hand from the document, not by running the
reference; float expectations are written as the same double arithmetic the document
prescribes (``count(c) / (count(v) + alpha)``, products top-down, sums in emission order).
"""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from war.spec.reference import (
    MAX_TOKEN,
    ReferenceSuffixTree,
    SpecResult,
    empty_result,
    reference_propose,
)

# D = 4 over s = [1, 2, 3, 1, 2, 4, 1, 2, 3]. Windows s[i:i+4]:
#   i0: 1 2 3 1   i1: 2 3 1 2   i2: 3 1 2 4   i3: 1 2 4 1   i4: 2 4 1 2
#   i5: 4 1 2 3   i6: 1 2 3     i7: 2 3       i8: 3
SEQ = [1, 2, 3, 1, 2, 4, 1, 2, 3]
SEQ_COUNTS: dict[tuple[int, ...], int] = {
    (1,): 3,
    (1, 2): 3,
    (1, 2, 3): 2,
    (1, 2, 3, 1): 1,
    (1, 2, 4): 1,
    (1, 2, 4, 1): 1,
    (2,): 3,
    (2, 3): 2,
    (2, 3, 1): 1,
    (2, 3, 1, 2): 1,
    (2, 4): 1,
    (2, 4, 1): 1,
    (2, 4, 1, 2): 1,
    (3,): 2,
    (3, 1): 1,
    (3, 1, 2): 1,
    (3, 1, 2, 4): 1,
    (4,): 1,
    (4, 1): 1,
    (4, 1, 2): 1,
    (4, 1, 2, 3): 1,
}


def seq_tree() -> ReferenceSuffixTree:
    t = ReferenceSuffixTree(4)
    t.append(0, SEQ)
    return t


def all_paths(t: ReferenceSuffixTree) -> dict[tuple[int, ...], int]:
    """Every node of the trie with its count, found through the child lists."""
    out: dict[tuple[int, ...], int] = {}
    stack: list[tuple[int, ...]] = [()]
    while stack:
        p = stack.pop()
        for tok, cnt in t.children(p):
            out[(*p, tok)] = cnt
            stack.append((*p, tok))
    return out


# ----------------------------------------------------------------------------- counts


def test_counts_match_hand_computation() -> None:
    t = seq_tree()
    assert all_paths(t) == SEQ_COUNTS
    for path, cnt in SEQ_COUNTS.items():
        assert t.count(path) == cnt
    assert t.count(()) == 0
    assert t.count((1, 2, 3, 1, 2)) == 0  # deeper than D
    assert t.count((5,)) == 0
    assert t.count((1, 3)) == 0
    t.check_integrity()


def test_children_order_built_by_appends() -> None:
    t = seq_tree()
    # root: 1 (s0), 2 (s1), 3 (s2) created in that order; 1 -> 2 at s3 (g=0); 2 -> 2 at
    # s4 (g=1, the only count-1 child ahead of it is itself); 4 new at s5; 1 -> 3 at s6
    # (g=0); 2 -> 3 at s7 (g=1); 3 -> 2 at s8 (g=2).
    assert t.children(()) == [(1, 3), (2, 3), (3, 2), (4, 1)]
    assert t.children((1, 2)) == [(3, 2), (4, 1)]
    assert t.children((2,)) == [(3, 2), (4, 1)]
    assert t.children((1, 2, 3)) == [(1, 1)]
    assert t.children((1, 2, 3, 1)) == []  # depth D: no children
    assert t.children((7,)) == []


def test_sequence_bookkeeping() -> None:
    t = ReferenceSuffixTree(3)
    assert t.num_seqs == 0
    assert not t.contains(5)
    t.append(5, [])
    assert t.contains(5)
    assert t.seq_len(5) == 0
    assert t.num_seqs == 1
    t.append(5, [1, 2])
    t.append(7, [3])
    t.append(5, [4])
    assert t.sequence(5) == [1, 2, 4]
    assert t.seq_len(5) == 3
    assert t.sequence(7) == [3]
    assert t.num_seqs == 2
    t.remove(5)
    assert not t.contains(5)
    assert t.num_seqs == 1
    assert t.children(()) == [(3, 1)]


def test_errors() -> None:
    with pytest.raises(ValueError):
        ReferenceSuffixTree(0)
    t = ReferenceSuffixTree(2)
    with pytest.raises(ValueError):
        t.remove(1)
    with pytest.raises(ValueError):
        t.seq_len(1)
    with pytest.raises(ValueError):
        t.sequence(1)
    t.append(1, [1, 2])
    with pytest.raises(ValueError):
        t.append(1, [3, -1])
    with pytest.raises(ValueError):
        t.append(1, [MAX_TOKEN + 1])
    # nothing of a rejected append is applied
    assert t.sequence(1) == [1, 2]
    assert all_paths(t) == {(1,): 1, (1, 2): 1, (2,): 1}
    t.append(1, [MAX_TOKEN])
    assert t.count((2, MAX_TOKEN)) == 1
    t.check_integrity()
    for bad_path in ([-1], [MAX_TOKEN + 1]):
        with pytest.raises(ValueError):
            t.count(bad_path)
        with pytest.raises(ValueError):
            t.children(bad_path)
        with pytest.raises(ValueError):
            t.match_len(bad_path)
    args = (10, 1.0, 0.0, 0.0, False, 0.0)
    for i, bad in ((2, -0.5), (2, math.inf), (3, math.nan), (4, math.nan), (6, -1.0)):
        params = list(args)
        params[i - 1] = bad
        with pytest.raises(ValueError):
            t.speculate([1], *params)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        t.speculate([1], 10, 1.0, 0.0, 0.0, False, [0.0, 0.0])  # D + 1 = 3 values
    # a negative max_tokens drafts nothing
    assert t.speculate([1], -1, 1.0, 0.0, 0.0, False, 0.0) == empty_result()
    assert t.speculate([1], 10, 1.0, 0.0, 0.0, False, [0.0, 0.0, 0.0]).token_ids == [2]


# ----------------------------------------------------------------------------- child order


def test_increment_swap_rule() -> None:
    t = ReferenceSuffixTree(1)
    t.append(0, [1, 2, 3])
    assert t.children(()) == [(1, 1), (2, 1), (3, 1)]
    t.append(0, [3])  # j=2, k=1, g=0: swap 0<->2
    assert t.children(()) == [(3, 2), (2, 1), (1, 1)]
    t.append(0, [2])  # j=1, k=1, g=1
    assert t.children(()) == [(3, 2), (2, 2), (1, 1)]
    t.append(0, [1])  # j=2, k=1, g=2
    assert t.children(()) == [(3, 2), (2, 2), (1, 2)]
    t.append(0, [1])  # j=2, k=2, g=0: swap 0<->2
    assert t.children(()) == [(1, 3), (2, 2), (3, 2)]
    t.check_integrity()


def test_decrement_swap_rule() -> None:
    t = ReferenceSuffixTree(1)
    t.append(0, [1, 2, 3])
    t.append(1, [1, 2, 3])
    t.append(2, [4, 4])
    assert t.children(()) == [(1, 2), (2, 2), (3, 2), (4, 2)]
    t.remove(0)
    # dec 1: j=0, k=2, h=3 -> [4,2,3,1]; dec 2: j=1, h=2 -> [4,3,2,1]; dec 3: j=1, h=1
    assert t.children(()) == [(4, 2), (3, 1), (2, 1), (1, 1)]
    t.remove(2)
    # dec 4: j=0, k=2, h=0; dec 4: j=0, k=1, h=3 -> [1,3,2,4], 4 reaches 0 and is dropped
    assert t.children(()) == [(1, 1), (3, 1), (2, 1)]
    t.check_integrity()
    t.remove(1)
    assert t.children(()) == []
    assert t.num_seqs == 0


def test_remove_restores_counts() -> None:
    t = ReferenceSuffixTree(3)
    t.append(0, [1, 2, 1, 2, 3])
    before = all_paths(t)
    assert before == {
        (1,): 2,
        (1, 2): 2,
        (1, 2, 1): 1,
        (1, 2, 3): 1,
        (2,): 2,
        (2, 1): 1,
        (2, 1, 2): 1,
        (2, 3): 1,
        (3,): 1,
    }
    assert t.children(()) == [(1, 2), (2, 2), (3, 1)]
    assert t.children((1, 2)) == [(1, 1), (3, 1)]
    t.append(1, [2, 1, 2, 2])
    t.append(0, [])  # no-op on an existing sequence
    assert t.count((2,)) == 5
    assert t.count((2, 1, 2)) == 2
    assert t.count((2, 2)) == 1
    t.remove(1)
    assert all_paths(t) == before
    t.check_integrity()


def test_max_depth_cut() -> None:
    t = ReferenceSuffixTree(2)
    t.append(0, [1, 2, 3])
    assert all_paths(t) == {(1,): 1, (1, 2): 1, (2,): 1, (2, 3): 1, (3,): 1}
    assert t.count((1, 2, 3)) == 0
    assert t.children((1, 2)) == []
    assert t.match_len([1, 2, 3]) == 2
    assert t.match_len([1, 2]) == 2
    # k=2: (1,2) is at depth D, no children; k=1: (2) -> 3 with p = 1/1
    r = t.speculate([1, 2], 10, 1.0, 0.0, 0.0, False, 0.0)
    assert r == SpecResult([3], [-1], [1.0], 1.0, 1)


# ----------------------------------------------------------------------------- match_len


def test_match_len() -> None:
    t = seq_tree()
    assert t.match_len([]) == 0
    assert t.match_len([9]) == 0
    assert t.match_len([1, 2]) == 2
    assert t.match_len([9, 1, 2]) == 2
    assert t.match_len([2, 3, 1, 2]) == 4
    assert t.match_len([5, 2, 3, 1, 2]) == 4  # capped at D
    assert t.match_len([4, 2, 3]) == 2
    assert t.match_len([3, 3]) == 1


# ----------------------------------------------------------------------------- drafts
#
# Nodes of seq_tree() used below (count; children; cont = sum of the children's counts):
#   (1,2): 3; [3:2, 4:1]; cont 3      (1,2,3): 2; [1:1]; cont 1 (i6 ends there)
#   (1,2,4): 1; [1:1]; cont 1         (1,2,3,1), (1,2,4,1): depth D, no children
#   (2): 3; [3:2, 4:1]; cont 3        (2,3): 2; [1:1]; cont 1 (i7 ends there)
#   (3,1,2): 1; [4:1]; cont 1         (2,3,1,2): depth D


def test_probabilities_use_cont_not_count() -> None:
    t = seq_tree()
    assert t.count((2, 3)) == 2
    assert t.children((2, 3)) == [(1, 1)]
    # (2,3) occurs twice but continues once: p(1 | (2,3)) = 1 / (1 + 0)
    r = t.speculate([2, 3], 1, 1.0, 0.0, 0.0, False, 0.0)
    assert r == SpecResult([1], [-1], [1.0], 1.0, 2)
    # with alpha = 1: 1 / (1 + 1); k=1 then tries (3): count 2, cont 1, same 0.5: a tie
    r = t.speculate([2, 3], 1, 1.0, 0.0, 0.0, False, 1.0)
    assert r == SpecResult([1], [-1], [0.5], 0.5, 2)


def test_path_draft_exact() -> None:
    t = seq_tree()
    # k=2 (L=2): (1,2) -> 3 with 2/3; (1,2,3) -> 1 with 1/1; (1,2,3,1) at depth D: stop.
    # k=1: L=1 <= 4/3: break.
    r = t.speculate([1, 2], 10, 1.0, 0.0, 0.0, False, 0.0)
    assert r.token_ids == [3, 1]
    assert r.parents == [-1, 0]
    assert r.probs == [2 / 3, (2 / 3) * 1.0]
    assert r.score == 2 / 3 + (2 / 3) * 1.0
    assert r.match_len == 2


def test_tree_draft_exact() -> None:
    t = seq_tree()
    # k=2, L=3: pop 3 (2/3, push #0). Push sibling 4 (1.0 * 1/3, #1) and child 1 of
    # (1,2,3) (2/3 * 1/1, #2). Pop #2 (token 1, parent 0): (1,2,3,1) has no children.
    # Pop #1 (token 4, parent -1), push child 1 of (1,2,4) (1/3 * 1/1, #3). L reached.
    # k=1: L=2 > 5/3: from (2): [3, 1] scores 4/3, not better.
    r = t.speculate([1, 2], 3, 1.0, 1.0, 0.0, True, 0.0)
    assert r == SpecResult([3, 1, 4], [-1, 0, -1], [2 / 3, 2 / 3, 1 / 3], 2 / 3 + 2 / 3 + 1 / 3, 2)
    # L=4 (factor 2): then #3, token 1 under 4 (parent 2)
    r = t.speculate([1, 2], 10, 2.0, 0.0, 0.0, True, 0.0)
    assert r.token_ids == [3, 1, 4, 1]
    assert r.parents == [-1, 0, -1, 2]
    assert r.probs == [2 / 3, 2 / 3, 1 / 3, 1 / 3]
    assert r.score == 2 / 3 + 2 / 3 + 1 / 3 + 1 / 3
    assert r.match_len == 2
    assert all(p < i for i, p in enumerate(r.parents))


def test_tree_draft_push_order_breaks_ties() -> None:
    t = ReferenceSuffixTree(3)
    t.append(0, [5, 1, 7])
    t.append(1, [5, 2, 8])
    assert t.children((5,)) == [(1, 1), (2, 1)]
    # From (5), cont 2: pop 1 (1/2, #0); push sibling 2 (1/2, #1) and child 7 of (5,1)
    # (1/2 * 1/1, #2): equal, so 2 (pushed first) comes next; it pushes 8 (1/2, #3);
    # then 7 (#2) before 8 (#3).
    r = t.speculate([5], 4, 4.0, 0.0, 0.0, True, 0.0)
    assert r == SpecResult([1, 2, 7, 8], [-1, -1, 0, 1], [0.5, 0.5, 0.5, 0.5], 2.0, 1)


def test_tree_draft_is_best_first() -> None:
    t = ReferenceSuffixTree(3)
    t.append(0, [5, 1, 7])
    t.append(1, [5, 1, 7])
    t.append(2, [5, 2])
    assert t.children((5,)) == [(1, 2), (2, 1)]
    assert t.children((5, 1)) == [(7, 2)]
    # From (5), cont 3: pop 1 (2/3); push sibling 2 (1/3, #1) and child 7 of (5,1)
    # (2/3 * 2/2, #2). The best is 7 (2/3) although it was pushed later; then 2.
    r = t.speculate([5], 3, 3.0, 0.0, 0.0, True, 0.0)
    assert r == SpecResult(
        [1, 7, 2], [-1, 0, -1], [2 / 3, (2 / 3) * 1.0, 1 / 3], 2 / 3 + 2 / 3 + 1 / 3, 1
    )
    # the path draft follows first children only
    r = t.speculate([5], 3, 3.0, 0.0, 0.0, False, 0.0)
    assert r == SpecResult([1, 7], [-1, 0], [2 / 3, 2 / 3], 2 / 3 + 2 / 3, 1)


def test_min_prob_cutoff() -> None:
    t = seq_tree()
    # tree, L=4: the 1/3 sibling is not pushed (1/3 < 0.5); [3, 1] scores 4/3; k=1
    # (L=2) gives [3, 1] from (2) with the same score: the longer match stays.
    assert t.speculate([1, 2], 10, 2.0, 0.0, 0.5, True, 0.0) == SpecResult(
        [3, 1], [-1, 0], [2 / 3, 2 / 3], 2 / 3 + 2 / 3, 2
    )
    # the comparison is p_cum >= min_prob: a p_cum equal to min_prob is kept
    assert t.speculate([1, 2], 10, 2.0, 0.0, 1 / 3, True, 0.0).token_ids == [3, 1, 4, 1]
    assert t.speculate([1, 2], 10, 2.0, 0.0, 0.34, True, 0.0).token_ids == [3, 1]
    assert t.speculate([1, 2], 10, 1.0, 0.0, 2 / 3, False, 0.0).token_ids == [3, 1]
    # path with alpha 1: 2/(3+1) = 0.5, then 0.5 * 1/(1+1) = 0.25 < 0.3: stop
    assert t.speculate([1, 2], 10, 1.0, 0.0, 0.3, False, 1.0) == SpecResult(
        [3], [-1], [0.5], 0.5, 2
    )
    # nothing reaches min_prob at any k: empty
    assert t.speculate([1, 2], 10, 1.0, 0.0, 0.7, True, 0.0) == empty_result()
    assert t.speculate([1, 2], 10, 1.0, 0.0, 0.7, False, 0.0) == empty_result()


def test_alpha_smoothing() -> None:
    t = seq_tree()
    # k=2: (1,2): 2 / (3 + 1) = 0.5; (1,2,3): 1 / (1 + 1) = 0.5 -> 0.25; score 0.75.
    # k=1: L=1 > 0.75: (2) -> 3 with 2 / (3 + 1) = 0.5, not better.
    r = t.speculate([1, 2], 10, 1.0, 0.0, 0.0, False, 1.0)
    assert r == SpecResult([3, 1], [-1, 0], [0.5, 0.25], 0.75, 2)
    # the same as a table
    assert t.speculate([1, 2], 10, 1.0, 0.0, 0.0, False, [1.0] * 5) == r
    p1 = 2.0 / (3.0 + 0.5)
    p2 = p1 * (1.0 / (1.0 + 0.5))
    r = t.speculate([1, 2], 10, 1.0, 0.0, 0.0, False, 0.5)
    assert r == SpecResult([3, 1], [-1, 0], [p1, p2], p1 + p2, 2)


def test_alpha_table_per_depth() -> None:
    t = seq_tree()
    alpha = [0.0, 0.0, 1.0, 3.0, 0.0]  # depths 0..4
    # path, k=2: (1,2) at depth 2: 2/(3+1) = 0.5; (1,2,3) at depth 3: 1/(1+3) -> 0.125;
    # score 0.625. k=1 (L=1): (2) at depth 1: 2/(3+0) = 2/3 > 0.625: the shorter match wins.
    r = t.speculate([1, 2], 10, 1.0, 0.0, 0.0, False, alpha)
    assert r == SpecResult([3], [-1], [2 / 3], 2 / 3, 1)
    # tree, k=2 (L=4): pop 3 (0.5, #0); sibling 4 at (1,2)'s depth 2: 1/(3+1) = 0.25 (#1);
    # child 1 of (1,2,3) at depth 3: 0.5 * 1/(1+3) = 0.125 (#2). Pop 4; push child 1 of
    # (1,2,4) at depth 3: 0.25 * 1/4 = 0.0625 (#3). Pop #2, then #3: score 0.9375.
    # k=1 (L=2 > 0.9375): pop 3 (2/3); sibling 4 at depth 1: 1/3 (#1); child 1 of (2,3)
    # at depth 2: 2/3 * 1/(1+1) = 1/3 (#2): a tie, the sibling wins. Score 1.0: better.
    r = t.speculate([1, 2], 10, 2.0, 0.0, 0.0, True, alpha)
    assert r == SpecResult([3, 4], [-1, -1], [2 / 3, 1 / 3], 2 / 3 + 1 / 3, 1)
    # L(2) = 3, L(1) = 1 (factor 2, offset -1): k=2 gives [3, 4, 1] (0.875), k=1 only
    # [3] (2/3), so k=2 wins
    r = t.speculate([1, 2], 10, 2.0, -1.0, 0.0, True, alpha)
    assert r == SpecResult([3, 4, 1], [-1, -1, 0], [0.5, 0.25, 0.125], 0.875, 2)
    with pytest.raises(ValueError):
        t.speculate([1, 2], 10, 1.0, 0.0, 0.0, False, [0.0] * 4)
    with pytest.raises(ValueError):
        t.speculate([1, 2], 10, 1.0, 0.0, 0.0, False, -1.0)


def test_factor_offset_limit() -> None:
    t = seq_tree()
    # k=2: L = floor(2 * 0.5) = 1 -> [3] (2/3); k=1: L = floor(0.5) = 0 <= 2/3: break
    assert t.speculate([1, 2], 10, 0.5, 0.0, 0.0, False, 0.0) == SpecResult(
        [3], [-1], [2 / 3], 2 / 3, 2
    )
    # factor 0, offset 1.5: L = 1 at every k; k=1 ties (2/3) and the longer match stays
    assert t.speculate([1, 2], 10, 0.0, 1.5, 0.0, False, 0.0) == SpecResult(
        [3], [-1], [2 / 3], 2 / 3, 2
    )
    # max_tokens caps L
    assert t.speculate([1, 2], 1, 2.0, 2.5, 0.0, True, 0.0).token_ids == [3]
    assert t.speculate([1, 2], 2, 2.0, 2.5, 0.0, True, 0.0).token_ids == [3, 1]
    assert t.speculate([1, 2], 0, 2.0, 2.5, 0.0, True, 0.0) == empty_result()
    # negative L is 0: break at once
    assert t.speculate([1, 2], 10, 1.0, -1.5, 0.0, False, 0.0) == empty_result()
    # floor, not round: 2 * 0.5 + 0.9 = 1.9 -> 1
    assert t.speculate([1, 2], 10, 0.5, 0.9, 0.0, True, 0.0).token_ids == [3]


def test_shorter_match_wins_when_longest_has_no_children() -> None:
    t = seq_tree()
    # K = 4 = D: (2,3,1,2) has no children (score 0). k=3 (L=3): (3,1,2) -> 4 with 1/1,
    # score 1.0. k=2 (L=2 > 1.0): (1,2) -> [3, 1], 2/3 + 2/3 > 1.0: better.
    # k=1: L=1 <= 4/3, break.
    r = t.speculate([2, 3, 1, 2], 10, 1.0, 0.0, 0.0, False, 0.0)
    assert r == SpecResult([3, 1], [-1, 0], [2 / 3, 2 / 3], 2 / 3 + 2 / 3, 2)
    # with L = 1 everywhere, k=3's [4] (1.0) beats k=2's [3] (2/3)
    r = t.speculate([2, 3, 1, 2], 10, 0.0, 1.0, 0.0, False, 0.0)
    assert r == SpecResult([4], [-1], [1.0], 1.0, 3)


def test_no_match_is_empty() -> None:
    t = seq_tree()
    assert t.speculate([9], 10, 1.0, 0.0, 0.0, True, 0.0) == empty_result()
    assert t.speculate([], 10, 1.0, 0.0, 0.0, False, 0.0) == empty_result()
    assert ReferenceSuffixTree(3).speculate([1], 10, 1.0, 0.0, 0.0, False, 0.0) == (
        SpecResult([], [], [], 0.0, 0)
    )


# ----------------------------------------------------------------------------- propose


def test_propose_choice() -> None:
    a = seq_tree()  # [1,2] -> path [3, 1], score 4/3, match_len 2
    b = ReferenceSuffixTree(2)
    b.append(0, [1, 2, 5])  # [1,2]: k=2 at depth D (empty), k=1: (2) -> 5, score 1.0
    ra = SpecResult([3, 1], [-1, 0], [2 / 3, 2 / 3], 4 / 3, 2)
    rb = SpecResult([5], [-1], [1.0], 1.0, 1)
    args = (10, 1.0, 0.0, 0.0, False, 0.0)
    assert reference_propose(
        [("group", a, [1, 2], 1.0), ("local", b, [1, 2], 1.0), ("global", None, [1, 2], 1.0)],
        *args,
    ) == ("group", ra)
    # tie: the earlier source wins
    assert reference_propose([("group", b, [1, 2], 1.0), ("local", b, [1, 2], 1.0)], *args) == (
        "group",
        rb,
    )
    # 4/3 * 0.5 < 1.0; the winner keeps its unweighted score
    assert reference_propose([("group", a, [1, 2], 0.5), ("local", b, [1, 2], 1.0)], *args) == (
        "local",
        rb,
    )
    assert reference_propose([("group", b, [1, 2], 2.0), ("local", a, [1, 2], 1.0)], *args) == (
        "group",
        rb,
    )
    assert reference_propose(
        [("group", None, [1, 2], 1.0), ("local", b, [1, 2], 1.0), ("global", a, [1, 2], 1.0)],
        *args,
    ) == ("global", ra)
    # no tree / no match / zero weight: "none" with the empty draft
    assert reference_propose([("group", None, [1, 2], 1.0)], *args) == ("none", empty_result())
    assert reference_propose([("group", a, [9], 1.0), ("local", b, [9], 1.0)], *args) == (
        "none",
        empty_result(),
    )
    assert reference_propose([("group", a, [1, 2], 0.0)], *args) == ("none", empty_result())
    # per-source smoothing: with alpha 1, a's draft is [3, 1] at 0.5, 0.25 (score 0.75)
    sources = [("group", a, [1, 2], 1.0), ("local", b, [1, 2], 1.0)]
    assert reference_propose(sources, *args, source_alphas=[1.0, None]) == ("local", rb)
    assert reference_propose(sources, *args, source_alphas=[None, [0.0, 1.0, 1.0]]) == (
        "group",
        ra,
    )
    with pytest.raises(ValueError):
        reference_propose(sources, *args, source_alphas=[None])


def test_local_source_matches_its_own_sequence() -> None:
    t = ReferenceSuffixTree(3)
    t.append(0, [1, 2, 3, 1, 2])
    own = t.sequence(0)
    assert t.match_len(own) == 3  # K = min(D, len)
    # k=3: (3,1,2) at depth D, empty. k=2: (1,2) occurs twice but continues once
    # (the trajectory's own current position): 3 with 1/1; (1,2,3) at depth D: stop.
    # k=1: L=1 <= 1.0, break.
    assert t.count((1, 2)) == 2
    assert reference_propose([("local", t, own, 1.0)], 10, 1.0, 0.0, 0.0, False, 0.0) == (
        "local",
        SpecResult([3], [-1], [1.0], 1.0, 2),
    )


# ----------------------------------------------------------------------------- integrity


def test_check_integrity_detects_corruption() -> None:
    t = seq_tree()
    t.check_integrity()
    node = t._root.index[1]
    node.count += 1
    with pytest.raises(AssertionError):
        t.check_integrity()
    node.count -= 1
    t.check_integrity()
    lst = t._root.children
    lst[0], lst[3] = lst[3], lst[0]  # breaks count-descending order
    with pytest.raises(AssertionError):
        t.check_integrity()


ops_strategy = st.lists(
    st.one_of(
        st.tuples(
            st.just("append"),
            st.integers(0, 3),
            st.lists(st.integers(0, 4), max_size=8),
        ),
        st.tuples(st.just("remove"), st.integers(0, 3), st.just([])),
    ),
    max_size=25,
)


@settings(max_examples=150, deadline=None)
@given(max_depth=st.integers(1, 6), ops=ops_strategy)
def test_integrity_under_random_ops(max_depth: int, ops: list[tuple[str, int, list[int]]]) -> None:
    t = ReferenceSuffixTree(max_depth)
    model: dict[int, list[int]] = {}
    for op, sid, toks in ops:
        if op == "append":
            t.append(sid, toks)
            model.setdefault(sid, []).extend(toks)
        elif sid in model:
            t.remove(sid)
            del model[sid]
        else:
            with pytest.raises(ValueError):
                t.remove(sid)
        t.check_integrity()
        assert t.num_seqs == len(model)
        for k, v in model.items():
            assert t.sequence(k) == v
    for sid in list(model):
        t.remove(sid)
        t.check_integrity()
    assert t.children(()) == []


@settings(max_examples=100, deadline=None)
@given(
    max_depth=st.integers(1, 6),
    seqs=st.lists(st.lists(st.integers(0, 3), max_size=10), min_size=1, max_size=4),
    context=st.lists(st.integers(0, 3), max_size=8),
    max_tokens=st.integers(0, 8),
    tree=st.booleans(),
)
def test_draft_invariants(
    max_depth: int, seqs: list[list[int]], context: list[int], max_tokens: int, tree: bool
) -> None:
    t = ReferenceSuffixTree(max_depth)
    for i, s in enumerate(seqs):
        t.append(i, s)
    k = t.match_len(context)
    assert k <= min(max_depth, len(context))
    assert k == 0 or t.count(context[len(context) - k :]) > 0
    if k < min(max_depth, len(context)):
        assert t.count(context[len(context) - k - 1 :]) == 0
    r = t.speculate(context, max_tokens, 1.0, 0.0, 0.0, tree, 0.0)
    n = len(r.token_ids)
    assert len(r.parents) == n == len(r.probs)
    assert n <= max_tokens
    assert all(-1 <= p < i for i, p in enumerate(r.parents))
    assert all(0.0 < p <= 1.0 for p in r.probs)
    assert (n == 0) == (r.match_len == 0) == (r.score == 0.0)
    if n:
        assert 1 <= r.match_len <= k
        # every draft token string hangs off the matched suffix in the trie
        ctx = context[len(context) - r.match_len :]
        for i in range(n):
            chain = []
            j = i
            while j != -1:
                chain.append(r.token_ids[j])
                j = r.parents[j]
            assert t.count([*ctx, *reversed(chain)]) > 0
        if not tree:
            assert r.parents == list(range(-1, n - 1))
            assert all(a >= b for a, b in itertools.pairwise(r.probs))
