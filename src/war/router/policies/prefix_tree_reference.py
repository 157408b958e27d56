"""The pure-Python prefix tree: the specification of the native one.

Knows: the algorithm of the router's multi-replica prefix tree, written to be read:
which token prefixes the router has sent to (or seen completed on) each replica,
when each replica last touched each of them, "how long a prefix of these tokens
does each replica hold", and per-replica eviction of the least recently used leaves
beyond a token budget. ``war.router.policies.prefix_tree.PrefixTree`` (C++,
csrc/prefix_tree.cc) must give exactly this module's results for every sequence of
operations (tests/router/test_prefix_tree_native.py compares them); the policies
use the native tree. Does not know what a replica's KV cache really holds, nor the
clock: every time is the ``now`` argument.

Structure: a radix tree with compressed edges. Each node stores a tuple of tokens
(its edge label), its children keyed by their first token and ``holders``
(replica -> last time that replica touched the node). A replica that holds a node
holds every ancestor of it (inserting touches the whole path; eviction removes only
a replica's leaves), so the prefix a replica holds of a query is the deepest node
on the query's path that it holds. A node nobody holds is removed.

Eviction pops a per-replica heap (``heapq``) of leaf candidates ordered by (last
touch, push order); stale entries are skipped, and the heap is compacted when it
grows past twice the replica's nodes plus 64. Details that decide ties between
equal touch times, and that the native tree therefore reproduces: compaction keeps
the first valid entry of a node in the heap's list order, and an ``evict`` keeps
popping the list it started with even when a push inside it compacted the
replica's heap into a new list. Eviction works on whole nodes, so a replica may end
slightly below its budget.

Costs: ``match`` and ``insert`` walk one node per branching point and compare edges
with slice comparisons; ``extend`` continues an earlier insert's path from where it
ended. Tens of microseconds per routed request: hence the native tree.
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


PathEnd = _Node  # where an inserted path ends; opaque to callers (``extend``)


class ReferencePrefixTree:
    """Token prefixes held by each replica, bounded to ``max_tokens_per_replica``
    tokens per replica (least recently used leaves are evicted first).

    The readable specification of ``war.router.policies.prefix_tree.PrefixTree``
    (native): tests hold the native tree to this one's results, operation by
    operation. ``match`` is read-only; ``insert``, ``extend``, ``remove_replica``
    and ``evict`` mutate.
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

    # ------------------------------------------------------------ introspection

    def dump(self) -> tuple[list[tuple[tuple[int, ...], tuple[tuple[str, float], ...]]],
                            dict[str, int], dict[str, int]]:
        """(every path with its holders in the order they came, sorted by path; the
        per-replica token counts; the per-replica node counts), for tests."""
        paths = []
        stack: list[tuple[tuple[int, ...], _Node]] = [((), self._root)]
        while stack:
            prefix, node = stack.pop()
            for child in node.children.values():
                path = prefix + child.key
                paths.append((path, tuple(child.holders.items())))
                stack.append((path, child))
        return sorted(paths), dict(self._num_tokens), dict(self._num_nodes)

    def heap_entries(self, replica: str) -> list[tuple[float, int]]:
        """``replica``'s heap of leaf candidates as (touch time, push order), in list
        order, for tests."""
        return [(t, seq) for t, seq, _ in self._heaps.get(replica, [])]

    def heap_size(self, replica: str) -> int:
        """Entries in ``replica``'s heap of leaf candidates."""
        return len(self._heaps.get(replica, []))

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
