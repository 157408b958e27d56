"""An approximate, multi-replica prefix tree over token ids.

Knows: which token prefixes the router has sent to (or seen completed on) each
replica, and when each replica last touched each of them; it answers "how long a
prefix of these tokens does each replica hold" and evicts, per replica, the least
recently used leaves once the replica holds more than its token budget. Does not
know what a replica's KV cache really holds (replicas evict on their own; this is
the router's guess, as in SGLang's router), nor the clock: every time is the
``now`` argument.

Structure: a radix tree with compressed edges. Each node stores a tuple of tokens
(its edge label), its children keyed by their first token and ``holders``
(replica -> last time that replica touched the node). A replica that holds a node
holds every ancestor of it (inserting touches the whole path; eviction removes only
a replica's leaves), so the prefix a replica holds of a query is the deepest node
on the query's path that it holds. A node nobody holds is removed.

Costs: ``match`` and ``insert`` walk one node per branching point and compare
edges with slice comparisons, so a prompt of thousands of tokens costs a few
C-level tuple compares per node, not a Python step per token; ``extend`` continues
an earlier insert's path (a prompt, then its response) from where it ended, touching
the path's nodes without comparing its tokens again. Eviction pops a
per-replica heap of leaf candidates ordered by last touch (stale entries are
skipped, and the heap is compacted when it grows past twice the replica's nodes).
Eviction works on whole nodes, so a replica may end slightly below its budget.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from itertools import count

_CHUNK = 64  # tokens compared per slice while locating a mismatch


class _Node:
    __slots__ = ("children", "holders", "key", "parent")

    def __init__(self, key: tuple[int, ...], parent: _Node | None) -> None:
        self.key = key
        self.parent = parent
        self.children: dict[int, _Node] = {}
        self.holders: dict[str, float] = {}  # replica -> last touch time


def _common_len(key: tuple[int, ...], tokens: tuple[int, ...], pos: int) -> int:
    """Length of the common prefix of ``key`` and ``tokens[pos:]``."""
    m = min(len(key), len(tokens) - pos)
    if tokens[pos:pos + m] == key[:m]:
        return m
    i = 0
    while i + _CHUNK <= m and tokens[pos + i:pos + i + _CHUNK] == key[i:i + _CHUNK]:
        i += _CHUNK
    while i < m and tokens[pos + i] == key[i]:
        i += 1
    return i


PathEnd = _Node  # where an inserted path ends; opaque to callers (``PrefixTree.extend``)


class PendingEnds:
    """Request id -> the ``PathEnd`` of its prompt, from routing to completion, for
    ``PrefixTree.extend``; at most ``capacity`` (the oldest are forgotten: their
    completion then walks the whole path)."""

    def __init__(self, capacity: int = 65536) -> None:
        self.capacity = capacity
        self._ends: dict[str, PathEnd | None] = {}

    def put(self, request_id: str, end: PathEnd | None) -> None:
        self._ends.pop(request_id, None)
        self._ends[request_id] = end
        if len(self._ends) > self.capacity:
            del self._ends[next(iter(self._ends))]

    def pop(self, request_id: str) -> PathEnd | None:
        return self._ends.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._ends)


class PrefixTree:
    """Token prefixes held by each replica, bounded to ``max_tokens_per_replica``
    tokens per replica (least recently used leaves are evicted first).

    ``match`` is read-only; ``insert``, ``remove_replica`` and ``evict`` mutate.
    """

    def __init__(self, max_tokens_per_replica: int) -> None:
        if isinstance(max_tokens_per_replica, bool) or max_tokens_per_replica < 1:
            raise ValueError(
                f"max_tokens_per_replica must be >= 1, got {max_tokens_per_replica!r}")
        self.max_tokens_per_replica = max_tokens_per_replica
        self._root = _Node((), None)
        self._num_tokens: dict[str, int] = {}
        self._num_nodes: dict[str, int] = {}
        # per replica: (last touch, push order, node) of nodes that were leaves of
        # that replica when pushed; validated when popped
        self._heaps: dict[str, list[tuple[float, int, _Node]]] = {}
        self._seq = count()

    # ------------------------------------------------------------------ queries

    def match(self, tokens: Sequence[int]) -> dict[str, int]:
        """The longest prefix of ``tokens`` that each replica holds (replicas that
        hold none are absent)."""
        toks = tuple(tokens)
        out: dict[str, int] = {}
        node, pos, n = self._root, 0, len(toks)
        while pos < n:
            child = node.children.get(toks[pos])
            if child is None:
                break
            k = _common_len(child.key, toks, pos)
            for replica in child.holders:
                out[replica] = pos + k
            if k < len(child.key):
                break
            node, pos = child, pos + k
        return out

    def num_tokens(self, replica: str) -> int:
        """Tokens of the tree that ``replica`` holds (0 if unknown)."""
        return self._num_tokens.get(replica, 0)

    def replicas(self) -> list[str]:
        """Replicas holding anything, sorted by name."""
        return sorted(r for r, n in self._num_tokens.items() if n > 0)

    # ---------------------------------------------------------------- mutations

    def insert(self, tokens: Sequence[int], replica: str, now: float) -> PathEnd | None:
        """Records that ``replica`` holds ``tokens`` (touched at ``now``), then evicts
        the replica's least recently used leaves while it is over budget. Returns the
        end of the path (for ``extend``; None for no tokens)."""
        toks = tuple(tokens)
        if not toks:
            return None
        return self._insert_from(self._root, toks, replica, now)

    def extend(self, end: PathEnd | None, path: Sequence[int], tokens: Sequence[int],
               replica: str, now: float) -> PathEnd | None:
        """``insert(path + tokens)``, where ``end`` is what ``insert(path)`` returned:
        touches the path's nodes and appends ``tokens`` from ``end`` without comparing
        the path's tokens again. When ``end`` is None or no longer in the tree (every
        replica evicted it since), inserts ``path + tokens`` from the root instead."""
        if end is None:
            return self.insert(tuple(path) + tuple(tokens), replica, now)
        nodes = []
        node = end
        while node is not self._root:
            parent = node.parent
            if parent is None or parent.children.get(node.key[0]) is not node:
                return self.insert(tuple(path) + tuple(tokens), replica, now)  # detached
            nodes.append(node)
            node = parent
        for node in reversed(nodes):
            self._touch(node, replica, now)
        return self._insert_from(end, tuple(tokens), replica, now)

    def _insert_from(self, start: _Node, toks: tuple[int, ...], replica: str,
                     now: float) -> _Node:
        """Inserts ``toks`` below ``start`` (whose path the caller touched), pushes the
        end as a leaf candidate and evicts over budget; returns the end. (The hot
        loop of the router's policies: ``_touch`` is inlined.)"""
        num_tokens, num_nodes = self._num_tokens, self._num_nodes
        node, pos, n = start, 0, len(toks)
        while pos < n:
            first = toks[pos]
            child = node.children.get(first)
            if child is None:
                child = _Node(toks[pos:] if pos else toks, node)
                node.children[first] = child
                pos = n
            else:
                key = child.key
                k = len(key)
                if toks[pos:pos + k] != key:  # the edge does not match whole: split it
                    k = _common_len(key, toks, pos)
                    child = self._split(child, k)
                pos += k
            holders = child.holders
            if replica not in holders:
                num_tokens[replica] = num_tokens.get(replica, 0) + len(child.key)
                num_nodes[replica] = num_nodes.get(replica, 0) + 1
            holders[replica] = now
            node = child
        # the end of the path: a leaf of this replica unless it holds something deeper
        if node is not self._root:
            self._push(replica, node)
        if num_tokens.get(replica, 0) > self.max_tokens_per_replica:
            self.evict(replica, self.max_tokens_per_replica)
        return node

    def evict(self, replica: str, max_tokens: int) -> int:
        """Evicts ``replica``'s least recently used leaves until it holds at most
        ``max_tokens`` tokens; returns the number of tokens evicted."""
        heap = self._heaps.get(replica)
        if heap is None:
            return 0
        before = self._num_tokens[replica]
        while self._num_tokens[replica] > max_tokens and heap:
            t, _, node = heapq.heappop(heap)
            if node.holders.get(replica) != t or not self._is_leaf_of(node, replica):
                continue  # stale: touched since, evicted, or no longer a leaf
            parent = node.parent
            self._drop(node, replica)
            if parent is not None and parent is not self._root \
                    and self._is_leaf_of(parent, replica):
                self._push(replica, parent)
        return before - self._num_tokens[replica]

    def remove_replica(self, replica: str) -> None:
        """Forgets everything ``replica`` holds."""
        stack = [c for c in self._root.children.values() if replica in c.holders]
        while stack:
            node = stack.pop()
            del node.holders[replica]
            if not node.holders:  # its descendants were held by ``replica`` at most
                assert node.parent is not None, "the root is never held"
                del node.parent.children[node.key[0]]
                continue
            stack.extend(c for c in node.children.values() if replica in c.holders)
        self._num_tokens.pop(replica, None)
        self._num_nodes.pop(replica, None)
        self._heaps.pop(replica, None)

    # ---------------------------------------------------------------- internals

    def _touch(self, node: _Node, replica: str, now: float) -> None:
        if replica not in node.holders:
            self._num_tokens[replica] = self._num_tokens.get(replica, 0) + len(node.key)
            self._num_nodes[replica] = self._num_nodes.get(replica, 0) + 1
        node.holders[replica] = now

    def _push(self, replica: str, node: _Node) -> None:
        heap = self._heaps.setdefault(replica, [])
        heapq.heappush(heap, (node.holders[replica], next(self._seq), node))
        if len(heap) > 2 * self._num_nodes.get(replica, 0) + 64:
            self._compact(replica)

    def _compact(self, replica: str) -> None:
        heap = self._heaps[replica]
        seen: set[int] = set()
        kept = []
        for entry in heap:
            t, _, node = entry
            if node.holders.get(replica) == t and id(node) not in seen \
                    and self._is_leaf_of(node, replica):
                seen.add(id(node))
                kept.append(entry)
        heapq.heapify(kept)
        self._heaps[replica] = kept

    @staticmethod
    def _is_leaf_of(node: _Node, replica: str) -> bool:
        return all(replica not in c.holders for c in node.children.values())

    def _split(self, node: _Node, k: int) -> _Node:
        """Splits ``node``'s edge after ``k`` tokens; returns the new upper node."""
        assert 0 < k < len(node.key), f"split at {k} of an edge of {len(node.key)}"
        parent = node.parent
        assert parent is not None, "the root is never split"
        upper = _Node(node.key[:k], parent)
        upper.holders = dict(node.holders)
        parent.children[upper.key[0]] = upper
        node.key = node.key[k:]
        node.parent = upper
        upper.children[node.key[0]] = node
        for replica in upper.holders:  # token counts unchanged; one more node each
            self._num_nodes[replica] += 1
        return upper

    def _drop(self, node: _Node, replica: str) -> None:
        del node.holders[replica]
        self._num_tokens[replica] -= len(node.key)
        self._num_nodes[replica] -= 1
        if not node.holders:
            assert not node.children, "a node nobody holds has no held children"
            assert node.parent is not None, "the root is never held"
            del node.parent.children[node.key[0]]
            node.parent = None

    def check_integrity(self) -> None:
        """Asserts the tree's invariants (expensive; for tests)."""
        tokens: dict[str, int] = {}
        nodes: dict[str, int] = {}
        stack = [self._root]
        while stack:
            node = stack.pop()
            for first, child in node.children.items():
                assert child.key and child.key[0] == first, "child keyed by its first token"
                assert child.parent is node, "parent link"
                assert child.holders, "every non-root node is held by someone"
                assert node is self._root or set(child.holders) <= set(node.holders), \
                    "a replica holding a node holds its parent"
                for replica in child.holders:
                    tokens[replica] = tokens.get(replica, 0) + len(child.key)
                    nodes[replica] = nodes.get(replica, 0) + 1
                stack.append(child)
        assert tokens == {r: n for r, n in self._num_tokens.items() if n or r in tokens}, \
            f"token counts {self._num_tokens} != {tokens}"
        assert nodes == {r: n for r, n in self._num_nodes.items() if n or r in nodes}, \
            f"node counts {self._num_nodes} != {nodes}"
