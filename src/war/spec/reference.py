"""Pure-Python reference for suffix speculation: the executable specification.

This module implements ``docs/suffix-speculation.md`` literally, and nothing else:

* section 1: an *uncompressed* depth-limited suffix trie with counts, one node per
  token string ``x`` with ``count(x) > 0``; each node keeps its children in an ordered
  list maintained by the exact swap rules of "Child order", plus a token -> child dict
  used only for lookup;
* section 2: path drafts (``tree=False``) and best-first tree drafts (``tree=True``)
  from one match position, with the exact float arithmetic of the document:
  ``p(c | v) = count(c) / (cont(v) + alpha[depth(v)])`` where ``cont(v)`` is the sum of
  the counts of ``v``'s children and ``alpha`` is a number or a table of ``D + 1``
  values, one per depth;
* section 3: the best draft over match lengths ``K, K-1, ..., 1`` with the early break;
* section 4: the choice among weighted sources (:func:`reference_propose`);
* section 6: the merge of the sources' drafts by token path (:func:`reference_merge`).

What it does not know: the path-compressed layout of the native trees, their memory
accounting, batching, threading, or how the trajectory/group/global history trees are
maintained (lead-in tokens, eviction). It is deliberately slow (linear scans of child
lists, brute-force integrity checks) and exists so that property tests can compare the
native implementation against it token for token, count for count and float for float.
"""

from __future__ import annotations

import heapq
import itertools
import math
import operator
from collections.abc import Sequence
from typing import NamedTuple, TypeAlias

__all__ = [
    "MAX_TOKEN",
    "Alpha",
    "ReferenceSuffixTree",
    "SpecResult",
    "empty_result",
    "reference_merge",
    "reference_propose",
]

MAX_TOKEN = 2**31 - 1
"""Largest valid token id (token ids are ints in ``[0, 2**31-1]``)."""

Alpha: TypeAlias = float | Sequence[float]
"""Smoothing: one number for every depth, or a table of ``max_depth + 1`` numbers."""


class SpecResult(NamedTuple):
    """A draft: tokens in emission order, their draft parents (-1 = attached to the
    context), their cumulative probabilities ``p_cum``, the score (sum of ``p_cum`` in
    emission order) and the match length it was drafted from (0 for the empty draft)."""

    token_ids: list[int]
    parents: list[int]
    probs: list[float]
    score: float
    match_len: int


def empty_result() -> SpecResult:
    """The empty draft: no tokens, score 0.0, match_len 0."""
    return SpecResult([], [], [], 0.0, 0)


class _Node:
    """One trie node: the token on the edge from its parent, its count, its children
    as an ordered list (the order the document specifies) and a lookup dict."""

    __slots__ = ("children", "count", "index", "token")

    def __init__(self, token: int, count: int) -> None:
        self.token = token
        self.count = count
        self.children: list[_Node] = []
        self.index: dict[int, _Node] = {}


def _position_of(children: list[_Node], child: _Node) -> int:
    for j, c in enumerate(children):
        if c is child:
            return j
    raise AssertionError("child not in its parent's child list")


def _increment_child(parent: _Node, token: int) -> None:
    """Increment the count of ``parent``'s child for ``token`` (creating it with count 1
    at the end of the list if absent), applying the increment swap rule."""
    child = parent.index.get(token)
    if child is None:
        child = _Node(token, 1)
        parent.children.append(child)
        parent.index[token] = child
        return
    lst = parent.children
    j = _position_of(lst, child)
    k = child.count
    g = min(i for i, c in enumerate(lst) if c.count == k)
    lst[g], lst[j] = lst[j], lst[g]
    child.count = k + 1


def _decrement_child(parent: _Node, child: _Node) -> None:
    """Decrement ``child`` (a child of ``parent``), applying the decrement swap rule and
    unlinking it from ``parent`` if it reaches 0."""
    lst = parent.children
    j = _position_of(lst, child)
    k = child.count
    h = max(i for i, c in enumerate(lst) if c.count == k)
    lst[h], lst[j] = lst[j], lst[h]
    child.count = k - 1
    if child.count == 0:
        if lst[-1] is not child:
            raise AssertionError("a child reaching 0 is not the last entry")
        lst.pop()
        del parent.index[child.token]


def _as_tokens(tokens: Sequence[int]) -> list[int]:
    """Token ids as Python ints; ``ValueError`` unless every one is in [0, 2**31-1]."""
    out = [operator.index(t) for t in tokens]
    for t in out:
        if not 0 <= t <= MAX_TOKEN:
            raise ValueError(f"token id {t} outside [0, 2**31-1]")
    return out


class ReferenceSuffixTree:
    """Slow, uncompressed reference of the native ``SuffixTree`` (same public API)."""

    def __init__(self, max_depth: int) -> None:
        max_depth = operator.index(max_depth)
        if max_depth < 1:
            raise ValueError(f"max_depth must be >= 1, got {max_depth}")
        self._max_depth = max_depth
        self._root = _Node(-1, 0)
        self._seqs: dict[int, list[int]] = {}

    # ------------------------------------------------------------------ sequences

    @property
    def max_depth(self) -> int:
        return self._max_depth

    @property
    def num_seqs(self) -> int:
        return len(self._seqs)

    def contains(self, seq_id: int) -> bool:
        return operator.index(seq_id) in self._seqs

    def _get(self, seq_id: int) -> list[int]:
        seq_id = operator.index(seq_id)
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise ValueError(f"unknown seq_id {seq_id}") from None

    def seq_len(self, seq_id: int) -> int:
        return len(self._get(seq_id))

    def sequence(self, seq_id: int) -> list[int]:
        return list(self._get(seq_id))

    def append(self, seq_id: int, tokens: Sequence[int]) -> None:
        """Append ``tokens`` one at a time to sequence ``seq_id`` (created if new, even
        when ``tokens`` is empty)."""
        seq_id = operator.index(seq_id)
        toks = _as_tokens(tokens)  # validate everything before changing anything
        seq = self._seqs.setdefault(seq_id, [])
        d = self._max_depth
        for t in toks:
            n = len(seq)
            seq.append(t)
            for i in range(max(0, n + 1 - d), n + 1):
                parent = self._root
                for u in seq[i:n]:
                    parent = parent.index[u]
                _increment_child(parent, t)

    def remove(self, seq_id: int) -> None:
        """Remove sequence ``seq_id``; ``ValueError`` if it is unknown."""
        seq = self._get(seq_id)
        n = len(seq)
        d = self._max_depth
        for i in range(n):
            v = self._root
            for t in seq[i : min(i + d, n)]:
                c = v.index[t]
                _decrement_child(v, c)
                v = c
        del self._seqs[operator.index(seq_id)]

    # ------------------------------------------------------------------ queries

    def _find(self, path: Sequence[int]) -> _Node | None:
        v = self._root
        for t in path:
            c = v.index.get(t)
            if c is None:
                return None
            v = c
        return v

    def count(self, path: Sequence[int]) -> int:
        """``count(path)``; 0 if absent and for the empty path (the root is not counted)."""
        p = _as_tokens(path)
        if not p:
            return 0
        v = self._find(p)
        return 0 if v is None else v.count

    def children(self, path: Sequence[int]) -> list[tuple[int, int]]:
        """The children of ``path`` as ``(token, count)`` in list order; [] if absent.
        ``children(())`` is the root's child list."""
        v = self._find(_as_tokens(path))
        if v is None:
            return []
        return [(c.token, c.count) for c in v.children]

    def match_len(self, context: Sequence[int]) -> int:
        """K: the largest k <= min(D, len(context)) such that context[-k:] is a path."""
        ctx = _as_tokens(context)
        n = len(ctx)
        for k in range(min(self._max_depth, n), 0, -1):
            if self._find(ctx[n - k :]) is not None:
                return k
        return 0

    # ------------------------------------------------------------------ drafts

    def _alpha_table(self, alpha: Alpha) -> list[float]:
        """``alpha`` as one value per depth ``0..max_depth`` (validated)."""
        if isinstance(alpha, (int, float)):
            table = [float(alpha)] * (self._max_depth + 1)
        else:
            table = [float(a) for a in alpha]
            if len(table) != self._max_depth + 1:
                raise ValueError(
                    f"alpha table must have max_depth + 1 = {self._max_depth + 1} values, "
                    f"got {len(table)}"
                )
        if not all(math.isfinite(a) and a >= 0.0 for a in table):
            raise ValueError(f"alpha values must be finite and >= 0, got {table}")
        return table

    @staticmethod
    def _prob(child: _Node, node: _Node, alpha_d: float) -> float:
        """``p(child | node)`` with ``alpha_d`` the smoothing at ``node``'s depth."""
        cont = 0
        for c in node.children:
            cont += c.count
        return float(child.count) / (float(cont) + alpha_d)

    @staticmethod
    def _score(probs: list[float]) -> float:
        score = 0.0
        for p in probs:  # emission order, plain double additions
            score += p
        return score

    def _path_draft(
        self, pos: _Node, limit: int, min_prob: float, alpha: list[float], k: int
    ) -> SpecResult:
        """Path draft from ``pos``, a node at depth ``k``."""
        tokens: list[int] = []
        parents: list[int] = []
        probs: list[float] = []
        v = pos
        depth = k
        p_cum = 1.0
        for _ in range(limit):
            if not v.children:
                break
            c = v.children[0]
            p_cum = p_cum * self._prob(c, v, alpha[depth])
            if p_cum < min_prob:
                break
            parents.append(len(tokens) - 1)
            tokens.append(c.token)
            probs.append(p_cum)
            v = c
            depth += 1
        return SpecResult(tokens, parents, probs, self._score(probs), k)

    def _tree_draft(
        self, pos: _Node, limit: int, min_prob: float, alpha: list[float], k: int
    ) -> SpecResult:
        """Best-first tree draft from ``pos``, a node at depth ``k``."""
        tokens: list[int] = []
        parents: list[int] = []
        probs: list[float] = []
        # heap entries: (-p_cum, push order, u, depth of u, index of c in u.children,
        # p_cum(u-side), draft parent of c, p_cum of c); push order is unique, so the
        # comparison never reaches the node object.
        heap: list[tuple[float, int, _Node, int, int, float, int, float]] = []
        pushes = 0

        def push(u: _Node, u_depth: int, idx: int, p_u: float, parent: int) -> None:
            nonlocal pushes
            c = u.children[idx]
            p_cum = p_u * self._prob(c, u, alpha[u_depth])
            if p_cum >= min_prob:
                heapq.heappush(heap, (-p_cum, pushes, u, u_depth, idx, p_u, parent, p_cum))
                pushes += 1

        if pos.children:
            push(pos, k, 0, 1.0, -1)
        while len(tokens) < limit and heap:
            _, _, u, u_depth, idx, p_u, pi, p_cum = heapq.heappop(heap)
            c = u.children[idx]
            me = len(tokens)
            tokens.append(c.token)
            parents.append(pi)
            probs.append(p_cum)
            if idx + 1 < len(u.children):
                push(u, u_depth, idx + 1, p_u, pi)  # (a) next sibling, at u's depth
            if c.children:
                push(c, u_depth + 1, 0, p_cum, me)  # (b) first child, at c's depth
        return SpecResult(tokens, parents, probs, self._score(probs), k)

    def speculate(
        self,
        context: Sequence[int],
        max_tokens: int,
        factor: float,
        offset: float,
        min_prob: float,
        tree: bool,
        alpha: Alpha,
    ) -> SpecResult:
        """Section 3: the best draft over match lengths K, K-1, ..., 1. ``alpha``: a number
        (that value at every depth) or ``max_depth + 1`` values, one per depth.

        ``ValueError`` for what the document excludes: a negative or non-finite ``factor``
        or ``alpha`` value, a non-finite ``offset``, a NaN ``min_prob``. A negative
        ``max_tokens`` is allowed and drafts nothing (``L < 0 -> 0``)."""
        if not (math.isfinite(factor) and factor >= 0.0):
            raise ValueError(f"factor must be finite and >= 0, got {factor!r}")
        if not math.isfinite(offset):
            raise ValueError(f"offset must be finite, got {offset!r}")
        if math.isnan(min_prob):
            raise ValueError("min_prob must not be NaN")
        table = self._alpha_table(alpha)
        ctx = _as_tokens(context)
        n = len(ctx)
        big_k = self.match_len(ctx)
        best = empty_result()
        for k in range(big_k, 0, -1):
            limit = min(max_tokens, math.floor(k * factor + offset))
            limit = max(limit, 0)
            if limit <= best.score:
                break
            pos = self._find(ctx[n - k :])
            if pos is None:  # cannot happen: paths are closed under taking suffixes
                raise AssertionError("suffix of a trie path is not a trie path")
            if tree:
                d = self._tree_draft(pos, limit, min_prob, table, k)
            else:
                d = self._path_draft(pos, limit, min_prob, table, k)
            if d.score > best.score:
                best = d
        return best

    # ------------------------------------------------------------------ checking

    def check_integrity(self) -> None:
        """Recompute every count from the stored sequences by brute force and compare
        with the trie; check child lists (count-descending, consistent with the lookup
        dict, no zero counts, depth <= D). Raises ``AssertionError`` on a mismatch."""
        d = self._max_depth
        expected: dict[tuple[int, ...], int] = {}
        for seq in self._seqs.values():
            n = len(seq)
            for i in range(n):
                window = seq[i : min(i + d, n)]
                for m in range(1, len(window) + 1):
                    key = tuple(window[:m])
                    expected[key] = expected.get(key, 0) + 1

        actual: dict[tuple[int, ...], int] = {}
        stack: list[tuple[tuple[int, ...], _Node]] = [((), self._root)]
        while stack:
            path, v = stack.pop()
            if path:
                if path in actual:
                    raise AssertionError(f"path {path} reached twice")
                actual[path] = v.count
                if v.count <= 0:
                    raise AssertionError(f"node {path} has count {v.count}")
                if len(path) > d:
                    raise AssertionError(f"node {path} deeper than max_depth {d}")
            if len(v.index) != len(v.children) or any(
                v.index.get(c.token) is not c for c in v.children
            ):
                raise AssertionError(f"child list and lookup dict of {path} disagree")
            counts = [c.count for c in v.children]
            if any(a < b for a, b in itertools.pairwise(counts)):
                raise AssertionError(f"children of {path} not count-descending: {counts}")
            if path and sum(counts) > v.count:
                raise AssertionError(f"children of {path} sum to more than its count")
            for c in v.children:
                stack.append(((*path, c.token), c))

        if actual != expected:
            missing = {p: c for p, c in expected.items() if actual.get(p) != c}
            extra = {p: c for p, c in actual.items() if expected.get(p) != c}
            raise AssertionError(
                f"trie counts disagree with brute force: expected {missing}, found {extra}"
            )


def reference_propose(
    sources: Sequence[tuple[str, ReferenceSuffixTree | None, Sequence[int], float]],
    max_tokens: int,
    factor: float,
    offset: float,
    min_prob: float,
    tree: bool,
    alpha: Alpha,
    source_alphas: Sequence[Alpha | None] | None = None,
) -> tuple[str, SpecResult]:
    """Section 4: each source is ``(name, tree or None, context, weight)``, considered in
    order. The highest ``score * weight`` wins, earlier sources winning ties; when no
    weighted score exceeds 0 the result is ``("none", empty_result())``. The winner's
    result is returned as its tree produced it (its ``score`` is not weighted).

    ``source_alphas`` (not in the document; the speculator smooths each source with its
    own table): one entry per source, replacing ``alpha`` for that source where not None.
    """
    if source_alphas is not None and len(source_alphas) != len(sources):
        raise ValueError("source_alphas must have one entry per source")
    best_name = "none"
    best = empty_result()
    best_weighted = 0.0
    for i, (name, src_tree, context, weight) in enumerate(sources):
        if src_tree is None:
            continue
        a = _source_alpha(alpha, source_alphas, i)
        d = src_tree.speculate(context, max_tokens, factor, offset, min_prob, tree, a)
        weighted = d.score * weight
        if weighted > best_weighted:
            best_name, best, best_weighted = name, d, weighted
    return best_name, best


def _source_alpha(alpha: Alpha, source_alphas: Sequence[Alpha | None] | None,
                  i: int) -> Alpha:
    """Source ``i``'s smoothing: its override, else ``alpha``."""
    if source_alphas is not None and source_alphas[i] is not None:
        return source_alphas[i]  # type: ignore[return-value]
    return alpha


def reference_merge(
    sources: Sequence[tuple[str, ReferenceSuffixTree | None, Sequence[int], float]],
    max_tokens: int,
    factor: float,
    offset: float,
    source_min_prob: float,
    threshold: float,
    tree: bool,
    alpha: Alpha,
    source_alphas: Sequence[Alpha | None] | None = None,
) -> tuple[str, SpecResult]:
    """Section 6: each source is ``(name, tree or None, context, weight)``; sources with
    no tree or a weight ``<= 0`` take no part. Each source drafts its best *tree* draft
    (section 3, ``min_prob = source_min_prob``); the drafts merge by token path, a path's
    value being ``1 - prod_s (1 - min(1, w_s * p_s))`` over the sources that drafted it
    (multiplied in source order). ``tree``: keep up to ``max_tokens`` paths of value
    ``>= threshold``, best first (ties: shorter path, then first seen), each only after
    its parent; else the chain that follows the child of highest value (ties: first seen)
    while it is ``>= threshold``. The draft's ``probs`` are the values, its ``score`` their
    sum; the name and ``match_len`` are those of the source with the largest term on the
    first token (ties: the earlier source); ``("none", empty_result())`` if empty.

    ``source_alphas``: as for :func:`reference_propose`.
    """
    if source_alphas is not None and len(source_alphas) != len(sources):
        raise ValueError("source_alphas must have one entry per source")
    # merged nodes by path, in order of first appearance:
    # path -> [prod, best term, source name, match_len]
    nodes: dict[tuple[int, ...], list[float | str | int]] = {}
    for i, (name, src_tree, context, weight) in enumerate(sources):
        if src_tree is None or not weight > 0.0:
            continue
        a = _source_alpha(alpha, source_alphas, i)
        d = src_tree.speculate(context, max_tokens, factor, offset, source_min_prob, True, a)
        paths: list[tuple[int, ...]] = []
        for tok, par, p in zip(d.token_ids, d.parents, d.probs, strict=True):
            path = (*(paths[par] if par >= 0 else ()), tok)
            paths.append(path)
            node = nodes.setdefault(path, [1.0, -1.0, "none", 0])
            term = min(1.0, weight * p)
            node[0] = float(node[0]) * (1.0 - term)
            if term > float(node[1]):
                node[1], node[2], node[3] = term, name, d.match_len
    value = {path: 1.0 - float(node[0]) for path, node in nodes.items()}
    first_seen = {path: j for j, path in enumerate(nodes)}
    chosen: list[tuple[int, ...]] = []
    if tree:
        ranked = sorted(
            (path for path, v in value.items() if v >= threshold),
            key=lambda path: (-value[path], len(path), first_seen[path]),
        )
        for path in ranked:
            if len(chosen) >= max_tokens:
                break
            if len(path) == 1 or path[:-1] in chosen:
                chosen.append(path)
    else:
        cur: tuple[int, ...] = ()
        while len(chosen) < max_tokens:
            kids = [path for path in nodes if len(path) == len(cur) + 1 and path[:-1] == cur]
            if not kids:
                break
            best = kids[0]
            for path in kids[1:]:
                if value[path] > value[best]:
                    best = path
            if not value[best] >= threshold:
                break
            chosen.append(best)
            cur = best
    if not chosen:
        return "none", empty_result()
    index = {path: j for j, path in enumerate(chosen)}
    probs = [value[path] for path in chosen]
    first = nodes[chosen[0]]
    return str(first[2]), SpecResult(
        [path[-1] for path in chosen],
        [index[path[:-1]] if len(path) > 1 else -1 for path in chosen],
        probs,
        ReferenceSuffixTree._score(probs),
        int(first[3]),
    )
