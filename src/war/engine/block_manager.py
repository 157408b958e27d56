"""Paged KV-cache block accounting with a radix-tree prefix cache over full blocks.

Knows: which of ``num_blocks`` block ids are free, which are held by sequences (and how
many times: reference counts), and which full blocks of already computed token prefixes
are cached in a radix tree whose edges are whole blocks (a tuple of ``block_size``
token ids), so that a new request can reuse every cached block of its longest cached
prefix. It evicts unreferenced cached blocks in least-recently-used order, leaves first.

Does not know: sequences, block tables, the KV tensors themselves, the model or its
weights (after a weight update the engine must call :meth:`BlockManager.clear_cache`),
scheduling or preemption policy. Callers keep their own block tables and follow the
protocol below; the manager checks what it can check cheaply and raises ``ValueError``
(naming the offending block id) for caller mistakes.

States. Every block is in exactly one of:

* *free*: on the free list, reference count 0, not in the tree;
* *held*: reference count >= 1 (cached in the tree or not);
* *cached, unreferenced*: reference count 0 but in the tree.

A cached node is *hot* when its block is held or some child is hot, otherwise *cold*.
Cold nodes are exactly the evictable ones: a cold subtree has no held block, so it can
be evicted leaf by leaf (a parent becomes a leaf, and evictable, once its children are
gone). When callers keep the usual invariant that a sequence holding block ``j`` of a
prefix also holds all earlier blocks of it, every cached unreferenced block is cold;
otherwise an unreferenced ancestor of a held block stays hot (not evictable, not
counted in :attr:`BlockManager.num_free_blocks`) until that block is released.

Protocol (who does what):

1. Admission: ``m = match_prefix(prompt, max_tokens=len(prompt) - 1)`` (read-only),
   ``acquire(m.block_ids)``, then ``allocate(k)`` for the remaining blocks; on
   :class:`OutOfBlocks` call ``release(m.block_ids)`` and retry later. Acquire before
   allocating: matched blocks that were evictable count in ``num_free_blocks`` until
   acquired.
2. After each step: ``table[:n] = publish(tokens, table[:n])`` with ``n`` the number of
   full, computed blocks. Publish finds the already-published prefix of the table by
   itself (scanning back from the end), so repeated calls cost O(new blocks); an
   optional, checked ``start_block`` hint (the count of blocks the caller knows are
   published) is accepted but not needed. When a
   block's content is already cached under another block id, the tree keeps its block
   and publish returns that *canonical* id in its place: the manager takes a reference
   on the canonical block and drops the caller's reference on the duplicate, so the
   caller MUST switch its table to the returned ids (its KV must be read from there).
3. When a sequence finishes or is preempted: ``release(table)``.
4. After a weight update: ``clear_cache()`` (preempt or restart running sequences first:
   their KV is stale, and a ``start_block`` hint claiming blocks that are no longer
   cached is rejected).

LRU uses a logical clock that ticks once per :meth:`BlockManager.release` and
:meth:`BlockManager.publish` call; a cold node's timestamp is the tick at which it
turned cold (its subtree was last in use then). :meth:`BlockManager.match_prefix` does
not touch the tree, so schedulers may call it speculatively (e.g. to size a request)
without perturbing eviction order.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

__all__ = ["BlockManager", "OutOfBlocks", "PrefixCacheStats", "PrefixMatch"]


class OutOfBlocks(RuntimeError):
    """Not enough free or evictable blocks; nothing was changed."""


class PrefixMatch(NamedTuple):
    """The cached blocks of the longest cached whole-block prefix, in prefix order, and
    the number of tokens they hold (``len(block_ids) * block_size``)."""

    block_ids: list[int]
    num_tokens: int


@dataclass(frozen=True, slots=True)
class PrefixCacheStats:
    """Counters since construction (or :meth:`BlockManager.reset_stats`).

    ``queried_tokens`` counts, per lookup, the tokens eligible for a match
    (``min(len(token_ids), max_tokens)``); ``hit_tokens`` the tokens matched;
    ``evictions`` cached blocks evicted to satisfy allocations; ``deduplicated`` blocks
    that publish replaced by an identical canonical block.
    """

    lookups: int = 0
    queried_tokens: int = 0
    hit_tokens: int = 0
    evictions: int = 0
    deduplicated: int = 0

    @property
    def hit_rate(self) -> float:
        """``hit_tokens / queried_tokens`` (0.0 before any query)."""
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


class _Node:
    """One cached block: an edge labelled ``key`` (its tokens) below ``parent``."""

    __slots__ = (
        "block",
        "children",
        "depth",
        "heap_seq",
        "hot_children",
        "key",
        "parent",
        "stamp",
    )

    def __init__(self, block: int, key: tuple[int, ...], parent: _Node | None, depth: int) -> None:
        self.block = block
        self.key = key
        self.parent = parent
        self.depth = depth  # number of blocks from the root: the root is 0
        self.children: dict[tuple[int, ...], _Node] = {}
        self.hot_children = 0  # children that are hot (held, or with a hot child)
        self.stamp = 0  # clock tick at which the node last turned cold
        self.heap_seq = -1  # sequence number of its valid eviction-heap entry, -1: none


_HeapEntry = tuple[int, int, _Node]  # (stamp, push sequence number, node)


class BlockManager:
    """Reference-counted KV blocks with a radix prefix cache (see the module docstring).

    All operations are O(number of blocks named or returned) amortized, plus
    O(log num_blocks) per eviction; :meth:`clear_cache` and :meth:`check_integrity`
    are O(num_blocks).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_cache: bool = True) -> None:
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be a positive int, got {num_blocks!r}")
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        self._num_blocks = num_blocks
        self._block_size = block_size
        self._enabled = bool(enable_prefix_cache)
        self._refcount = [0] * num_blocks
        self._node_of: list[_Node | None] = [None] * num_blocks
        # A stack; reversed so that a fresh manager hands out 0, 1, 2, ...
        self._free = list(range(num_blocks - 1, -1, -1))
        self._root = _Node(-1, (), None, 0)
        self._heap: list[_HeapEntry] = []  # cold leaves, lazily deleted
        self._push_seq = 0
        self._clock = 0
        self._num_used = 0
        self._num_cached = 0
        self._num_cold = 0
        self._lookups = 0
        self._queried_tokens = 0
        self._hit_tokens = 0
        self._evictions = 0
        self._deduplicated = 0

    # ------------------------------------------------------------------ properties

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def enable_prefix_cache(self) -> bool:
        return self._enabled

    @property
    def num_free_blocks(self) -> int:
        """Blocks :meth:`allocate` can provide: free plus evictable (cold cached)."""
        return len(self._free) + self._num_cold

    @property
    def num_evictable_blocks(self) -> int:
        """Cached blocks that are cold (unreferenced, no held descendant)."""
        return self._num_cold

    @property
    def num_used_blocks(self) -> int:
        """Blocks with reference count > 0."""
        return self._num_used

    @property
    def num_cached_blocks(self) -> int:
        """Blocks in the radix tree (held or not)."""
        return self._num_cached

    @property
    def stats(self) -> PrefixCacheStats:
        """A snapshot of the counters."""
        return PrefixCacheStats(
            lookups=self._lookups,
            queried_tokens=self._queried_tokens,
            hit_tokens=self._hit_tokens,
            evictions=self._evictions,
            deduplicated=self._deduplicated,
        )

    def reset_stats(self) -> None:
        """Zero the counters of :attr:`stats`."""
        self._lookups = self._queried_tokens = self._hit_tokens = 0
        self._evictions = self._deduplicated = 0

    def refcount(self, block_id: int) -> int:
        """The reference count of ``block_id``."""
        self._check_id(block_id)
        return self._refcount[block_id]

    def is_cached(self, block_id: int) -> bool:
        """Whether ``block_id`` is in the radix tree."""
        self._check_id(block_id)
        return self._node_of[block_id] is not None

    def is_free(self, block_id: int) -> bool:
        """Whether ``block_id`` is on the free list."""
        self._check_id(block_id)
        return self._refcount[block_id] == 0 and self._node_of[block_id] is None

    # ------------------------------------------------------------------ queries

    def can_allocate(self, n: int) -> bool:
        """Whether :meth:`allocate` of ``n`` blocks would succeed now."""
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of blocks: {n}")
        return n <= self.num_free_blocks

    def match_prefix(self, token_ids: Sequence[int], max_tokens: int | None = None) -> PrefixMatch:
        """The cached blocks of the longest cached prefix of whole blocks of
        ``token_ids[:max_tokens]`` (the engine passes ``len(prompt) - 1`` so that at least
        the last prompt token is recomputed).

        Read-only apart from :attr:`stats`: it takes no reference and does not touch LRU
        order. Call :meth:`acquire` on the result to use it. Empty when the prefix cache
        is disabled.
        """
        limit = len(token_ids)
        if max_tokens is not None:
            if max_tokens < 0:
                raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
            limit = min(limit, max_tokens)
        self._lookups += 1
        self._queried_tokens += limit
        blocks: list[int] = []
        if not self._enabled:
            return PrefixMatch(blocks, 0)
        bs = self._block_size
        node = self._root
        for i in range(limit // bs):
            child = node.children.get(tuple(token_ids[i * bs : (i + 1) * bs]))
            if child is None:
                break
            blocks.append(child.block)
            node = child
        num_tokens = len(blocks) * bs
        self._hit_tokens += num_tokens
        return PrefixMatch(blocks, num_tokens)

    # ------------------------------------------------------------------ references

    def acquire(self, block_ids: Iterable[int]) -> None:
        """Take one reference on each of ``block_ids`` (repeats take several).

        Meant for the blocks of a :meth:`match_prefix` result (cached blocks stop being
        evictable) and also usable to share held blocks (e.g. forking a sequence). A free
        block cannot be acquired (that is :meth:`allocate`'s job). Atomic: on error
        nothing changes. Acquire prefixes root-first (as a match returns them).
        """
        ids = list(block_ids)
        for b in ids:
            self._check_id(b)
            if self._refcount[b] == 0 and self._node_of[b] is None:
                raise ValueError(f"block {b} is free: allocate it instead of acquiring it")
        refcount = self._refcount
        for b in ids:
            refcount[b] += 1
            if refcount[b] > 1:
                continue
            self._num_used += 1
            node = self._node_of[b]
            if node is not None and node.hot_children == 0:
                self._cold_became_hot(node)

    def release(self, block_ids: Iterable[int]) -> None:
        """Drop one reference on each of ``block_ids`` (repeats drop several).

        At reference count 0 a cached block becomes evictable (once it has no held
        descendant) and an uncached one returns to the free list. Releasing a block that
        is not held (free, or cached unreferenced) raises ``ValueError``; the call is
        atomic. Blocks are processed last-first, so releasing a block table costs
        O(len(table)).
        """
        ids = list(block_ids)
        drops: dict[int, int] = {}
        for b in ids:
            self._check_id(b)
            drops[b] = drops.get(b, 0) + 1
            held = self._refcount[b]
            if drops[b] > held:
                if held == 0:
                    what = "free" if self._node_of[b] is None else "cached but not held"
                    raise ValueError(f"cannot release block {b}: it is {what}")
                raise ValueError(f"cannot release block {b} {drops[b]} times: refcount {held}")
        self._clock += 1
        for b in reversed(ids):
            self._drop(b)

    def allocate(self, n: int) -> list[int]:
        """``n`` fresh, uncached blocks with reference count 1, taken from the free list
        first, then by evicting cold cached blocks in LRU order (leaves only). Raises
        :class:`OutOfBlocks` without changing anything when fewer than ``n`` are
        available."""
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of blocks: {n}")
        if n > self.num_free_blocks:
            raise OutOfBlocks(
                f"need {n} blocks, only {len(self._free)} free + {self._num_cold} evictable"
            )
        out: list[int] = []
        free = self._free
        while len(out) < n and free:
            out.append(free.pop())
        while len(out) < n:
            out.append(self._evict_one())
        for b in out:
            assert self._refcount[b] == 0 and self._node_of[b] is None, f"block {b} not free"
            self._refcount[b] = 1
        self._num_used += n
        return out

    # ------------------------------------------------------------------ publishing

    def publish(
        self, token_ids: Sequence[int], block_ids: Sequence[int], start_block: int = 0
    ) -> list[int]:
        """Register the full blocks of a sequence's computed prefix in the radix tree and
        return its block ids with duplicates replaced by canonical ones.

        ``block_ids[i]`` holds tokens ``token_ids[i*bs:(i+1)*bs]``; ``token_ids`` may be
        longer than ``len(block_ids) * block_size`` (the rest is ignored), not shorter.
        Every block must be held by the caller. The already-published prefix of the
        table is found by scanning back from the end for the last cached block; its
        position and parent link are checked (O(1)) but the tokens of published blocks
        are not re-read, so a call costs O(new blocks). For each new block, if the tree
        already has a child with the same tokens under another block id, that canonical
        block is kept: the manager acquires it and releases the caller's duplicate, and
        the returned list names the canonical block. The caller must adopt the returned
        ids. Atomic on error. With the prefix cache disabled this only checks lengths
        and returns a copy of ``block_ids``.

        ``start_block`` is an optional, checked claim that blocks ``[0, start_block)``
        are already published (e.g. a count the caller keeps); the manager does not need
        it, and a smaller value than the truth is harmless. A larger one (blocks claimed
        published that are not cached, e.g. after :meth:`clear_cache`) is a ValueError.
        """
        n = len(block_ids)
        bs = self._block_size
        if not 0 <= start_block <= n:
            raise ValueError(f"start_block {start_block} outside [0, {n}]")
        if len(token_ids) < n * bs:
            raise ValueError(
                f"{len(token_ids)} tokens cannot fill {n} blocks of {bs} tokens "
                f"(blocks {list(block_ids)[:4]}...)"
            )
        result = list(block_ids)
        if not self._enabled:
            return result
        node_of = self._node_of
        start = n
        while start > 0:
            b = result[start - 1]
            self._check_id(b)
            if node_of[b] is not None:
                break
            start -= 1
        if start_block > start:
            raise ValueError(
                f"block {result[start_block - 1]} at position {start_block - 1} is claimed "
                f"published (start_block={start_block}) but is not cached"
            )
        parent = self._root
        if start > 0:
            parent = self._published_node(result, start)
        seen: set[int] = set()
        for i in range(start, n):
            b = result[i]
            if self._refcount[b] == 0:
                raise ValueError(f"cannot publish block {b}: it is not held")
            if b in seen:
                raise ValueError(f"block {b} appears twice in the block table")
            seen.add(b)
        self._clock += 1
        for i in range(start, n):
            b = result[i]
            key = tuple(token_ids[i * bs : (i + 1) * bs])
            child = parent.children.get(key)
            if child is None:
                child = _Node(b, key, parent, parent.depth + 1)
                parent.children[key] = child
                node_of[b] = child
                self._num_cached += 1
                # The new node is hot (b is held); its parent may have been cold.
                self._child_became_hot(parent)
            else:
                canonical = child.block
                assert canonical != b, f"uncached block {b} found in the tree"
                self._refcount[canonical] += 1
                if self._refcount[canonical] == 1:
                    self._num_used += 1
                    if child.hot_children == 0:
                        self._cold_became_hot(child)
                self._drop(b)
                result[i] = canonical
                self._deduplicated += 1
            parent = child
        return result

    def _published_node(self, table: Sequence[int], k: int) -> _Node:
        """The node of ``table[k-1]``, checked to sit at depth ``k`` below ``table[k-2]``."""
        b = table[k - 1]
        node = self._node_of[b]
        assert node is not None, f"block {b} is not cached"
        if self._refcount[b] == 0:
            raise ValueError(f"cannot publish block {b}: it is not held")
        if node.depth != k:
            raise ValueError(
                f"block {b} sits at position {k - 1} of the table but is cached at "
                f"position {node.depth - 1}"
            )
        parent = node.parent
        assert parent is not None, f"cached block {b} has no parent"
        if k > 1 and parent.block != table[k - 2]:
            raise ValueError(
                f"block {b} is cached below block {parent.block}, not below {table[k - 2]}"
            )
        return node

    # ------------------------------------------------------------------ cache control

    def clear_cache(self) -> None:
        """Forget every cached block (after a weight update): unreferenced cached blocks
        become free, held ones become uncached (and are freed on their last release)."""
        for b in range(self._num_blocks):
            node = self._node_of[b]
            if node is None:
                continue
            node.children.clear()
            node.parent = None
            node.heap_seq = -1
            self._node_of[b] = None
            if self._refcount[b] == 0:
                self._free.append(b)
        self._root.children.clear()
        self._heap.clear()
        self._num_cached = 0
        self._num_cold = 0

    # ------------------------------------------------------------------ internals

    def _check_id(self, block_id: int) -> None:
        if not 0 <= block_id < self._num_blocks:
            raise ValueError(f"unknown block id {block_id} (num_blocks={self._num_blocks})")

    def _drop(self, b: int) -> None:
        """Drop one reference on held block ``b``."""
        refcount = self._refcount
        assert refcount[b] > 0, f"block {b} dropped below refcount 0"
        refcount[b] -= 1
        if refcount[b] > 0:
            return
        self._num_used -= 1
        node = self._node_of[b]
        if node is None:
            self._free.append(b)
        elif node.hot_children == 0:
            self._set_cold(node)
            assert node.parent is not None, f"cached block {b} has no parent"
            self._child_became_cold(node.parent)

    def _cold_became_hot(self, node: _Node) -> None:
        """``node`` (cached) just became held while cold."""
        self._num_cold -= 1
        node.heap_seq = -1
        assert node.parent is not None, f"cached block {node.block} has no parent"
        self._child_became_hot(node.parent)

    def _child_became_hot(self, p: _Node) -> None:
        """A child of ``p`` turned hot (or a hot child was added): update ancestors."""
        root = self._root
        while p is not root:
            p.hot_children += 1
            if p.hot_children > 1 or self._refcount[p.block] > 0:
                return
            self._num_cold -= 1  # p was cold and is now hot
            p.heap_seq = -1
            assert p.parent is not None, f"cached block {p.block} has no parent"
            p = p.parent

    def _child_became_cold(self, p: _Node) -> None:
        """A child of ``p`` turned cold: update ancestors."""
        root = self._root
        while p is not root:
            p.hot_children -= 1
            assert p.hot_children >= 0, f"block {p.block} has negative hot children"
            if p.hot_children > 0 or self._refcount[p.block] > 0:
                return
            self._set_cold(p)
            assert p.parent is not None, f"cached block {p.block} has no parent"
            p = p.parent

    def _set_cold(self, node: _Node) -> None:
        self._num_cold += 1
        node.stamp = self._clock
        if not node.children:
            self._push(node)

    def _push(self, node: _Node) -> None:
        self._push_seq += 1
        node.heap_seq = self._push_seq
        heapq.heappush(self._heap, (node.stamp, self._push_seq, node))
        if len(self._heap) > 2 * self._num_cached + 64:
            self._heap = [e for e in self._heap if e[2].heap_seq == e[1]]
            heapq.heapify(self._heap)

    def _evict_one(self) -> int:
        """Remove the least recently used cold leaf from the tree; return its block."""
        heap = self._heap
        while True:
            assert heap, "no evictable block although the cold count is positive"
            _, seq, node = heapq.heappop(heap)
            if node.heap_seq == seq:
                break
        b = node.block
        parent = node.parent
        assert parent is not None and not node.children, f"evicting non-leaf block {b}"
        assert self._refcount[b] == 0 and node.hot_children == 0, f"evicting hot block {b}"
        del parent.children[node.key]
        node.parent = None
        node.heap_seq = -1
        self._node_of[b] = None
        self._num_cached -= 1
        self._num_cold -= 1
        self._evictions += 1
        if (
            parent is not self._root
            and not parent.children
            and parent.hot_children == 0
            and self._refcount[parent.block] == 0
        ):
            self._push(parent)  # its subtree is gone: it is an evictable leaf now
        return b

    # ------------------------------------------------------------------ checking

    def check_integrity(self) -> None:
        """Recount everything from scratch and compare (O(num_blocks log num_blocks)).
        Raises ``AssertionError`` on any inconsistency."""
        nb = self._num_blocks
        refcount = self._refcount
        assert len(refcount) == nb and len(self._node_of) == nb, "per-block arrays resized"
        assert all(r >= 0 for r in refcount), "negative reference count"
        used = sum(1 for r in refcount if r > 0)
        assert used == self._num_used, f"num_used {self._num_used} != recount {used}"

        # Tree: walk from the root, check links, recompute hotness bottom-up.
        in_tree: dict[int, _Node] = {}
        order: list[_Node] = []
        stack = [self._root]
        while stack:
            v = stack.pop()
            for key, c in v.children.items():
                assert c.key == key, f"block {c.block} stored under a different key"
                assert len(key) == self._block_size, f"block {c.block} key has {len(key)} tokens"
                assert c.parent is v, f"block {c.block} has a wrong parent link"
                assert c.depth == v.depth + 1, f"block {c.block} has a wrong depth"
                assert 0 <= c.block < nb, f"tree holds unknown block {c.block}"
                assert c.block not in in_tree, f"block {c.block} appears twice in the tree"
                assert self._node_of[c.block] is c, f"node_of[{c.block}] disagrees with tree"
                in_tree[c.block] = c
                order.append(c)
                stack.append(c)
        assert self._enabled or not in_tree, "prefix cache disabled but tree not empty"
        n_indexed = sum(1 for x in self._node_of if x is not None)
        assert n_indexed == len(in_tree), "node_of names blocks that are not in the tree"
        assert self._num_cached == len(in_tree), (
            f"num_cached {self._num_cached} != recount {len(in_tree)}"
        )
        hot: dict[int, bool] = {}
        for v in reversed(order):  # children before parents
            hc = sum(1 for c in v.children.values() if hot[c.block])
            assert v.hot_children == hc, f"block {v.block} hot_children {v.hot_children} != {hc}"
            hot[v.block] = refcount[v.block] > 0 or hc > 0
        cold_leaves = {b for b, v in in_tree.items() if not hot[b] and not v.children}
        num_cold = sum(1 for h in hot.values() if not h)
        assert num_cold == self._num_cold, f"num_cold {self._num_cold} != recount {num_cold}"
        for b, v in in_tree.items():
            if not hot[b]:
                assert v.stamp <= self._clock, f"block {b} stamped in the future"
                assert all(not hot[c.block] for c in v.children.values()), (
                    f"cold block {b} has a hot child"
                )
            if b not in cold_leaves:
                assert v.heap_seq == -1, f"block {b} is no cold leaf but has a live heap entry"

        # Eviction heap: live entries are exactly the cold leaves, once each.
        live: set[int] = set()
        for stamp, seq, node in self._heap:
            if node.heap_seq != seq:
                continue
            b = node.block
            assert b not in live, f"block {b} has two live heap entries"
            assert b in cold_leaves, f"heap entry for block {b}, which is not a cold leaf"
            assert stamp == node.stamp, f"heap entry for block {b} has a stale stamp"
            live.add(b)
        assert live == cold_leaves, f"cold leaves missing from the heap: {cold_leaves - live}"

        # Free list: exactly the unreferenced, uncached blocks, once each.
        free = set(self._free)
        assert len(free) == len(self._free), "free list holds a block twice"
        expected_free = {b for b in range(nb) if refcount[b] == 0 and b not in in_tree}
        assert free == expected_free, (
            f"free list {sorted(free)} != unreferenced uncached {sorted(expected_free)}"
        )
        # Every block in exactly one state.
        held = {b for b in range(nb) if refcount[b] > 0}
        cached_unref = {b for b in in_tree if refcount[b] == 0}
        assert len(free) + len(held) + len(cached_unref) == nb, "block states do not partition"
