"""A simulated replica's KV memory: private blocks and a radix prefix cache over blocks.

Knows: ``num_blocks`` blocks of ``block_size`` token slots; blocks held privately by
running sequences (a count, per caller); and cached prefixes in a radix tree whose
edges are whole blocks of token ids (children keyed by their first block), each node
with a lock count (running sequences that read it) and the virtual time it was last
released. Cached nodes nobody locks are evicted least recently used first, leaves
first, whenever blocks are needed. Does not know sequences, scheduling or time
beyond the ``now`` it is given.

Protocol: ``match`` (read-only) finds the longest cached whole-block prefix, and
``lock`` pins it (splitting a node so that exactly the matched blocks are pinned);
``allocate`` / ``free`` move private blocks; ``insert`` caches a computed prefix and
returns its node (callers free the private blocks that held those tokens first, so an
insert never needs more memory than it frees). ``reuse(m, limit)`` gives back an
earlier answer ``m`` for the same tokens when nothing it depends on has changed (its
end node still cached, not split, no child added to it): a request that waits at the
head of a queue is matched again at every step, and a context can be 100 k tokens.
A sequence locks one path from the root, so a locked node's ancestors are locked
too and every unlocked node is evictable once its children are gone. Work is per
node on the path, not per token: a multi-turn trajectory adds one or two nodes per
turn.
"""

from __future__ import annotations

import heapq
from itertools import count

Tokens = tuple[int, ...]


class Node:
    __slots__ = ("children", "key", "locks", "parent", "stamp", "version")

    def __init__(self, key: Tokens, parent: Node | None) -> None:
        self.key = key
        self.parent = parent
        self.children: dict[Tokens, Node] = {}
        self.locks = 0
        self.stamp = 0.0
        self.version = 0  # children added so far (a match that ended here may go on)


class Match:
    """``match``'s answer, and what it takes to know it still holds."""

    __slots__ = ("keylen", "kv", "limit", "node", "tokens", "used", "version")

    def __init__(self, kv: PrefixKV, tokens: int, limit: int, node: Node, used: int) -> None:
        self.tokens = tokens  # tokens matched (whole blocks)
        self.node = node  # where the match ends
        self.used = used  # how many of ``node``'s tokens it covers
        self.kv, self.limit = kv, limit
        self.keylen, self.version = len(node.key), node.version


class PrefixKV:
    """KV blocks of one replica (module docstring)."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks, block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.root = Node((), None)
        self.root.locks = 1  # never evicted
        self.cached_blocks = 0
        self.locked_blocks = 0
        self.private_blocks = 0
        self.evicted_blocks = 0
        self._heap: list[tuple[float, int, Node]] = []
        self._seq = count()

    # ------------------------------------------------------------------ queries

    @property
    def capacity_tokens(self) -> int:
        """Tokens the cache holds when full."""
        return self.num_blocks * self.block_size

    @property
    def used_blocks(self) -> int:
        return self.cached_blocks + self.private_blocks

    @property
    def available_blocks(self) -> int:
        """Free blocks plus cached blocks nobody locks (evictable)."""
        return self.num_blocks - self.private_blocks - self.locked_blocks

    def match(self, tokens: Tokens, limit: int | None = None) -> Match:
        """The longest cached whole-block prefix of ``tokens[:limit]`` (``Match``: tokens
        matched, the node where it ends, how many of that node's tokens it covers)."""
        bs = self.block_size
        n = len(tokens) if limit is None else min(limit, len(tokens))
        n -= n % bs
        node, pos, used = self.root, 0, 0
        while pos < n:
            child = node.children.get(tokens[pos:pos + bs])
            if child is None:
                break
            m = common_prefix_len(child.key, tokens, pos, n)
            m -= m % bs
            node, pos, used = child, pos + m, m
            if m < len(child.key):
                break
        return Match(self, pos, n, node, used)

    def reuse(self, memo: Match | None, limit: int) -> Match | None:
        """``memo`` (an earlier ``match`` of the same tokens, at least ``limit`` of
        them) if it still holds for ``limit``, else None; costs no pass over the
        tokens."""
        if memo is None or memo.kv is not self or memo.limit != limit - limit % self.block_size:
            return None
        node = memo.node
        if ((node.parent is not None or node is self.root) and len(node.key) == memo.keylen
                and node.version == memo.version):
            return memo
        return None

    # ------------------------------------------------------------------ pinning

    def lock(self, node: Node, used: int) -> Node:
        """Pins the path to ``node``'s first ``used`` tokens (``match``'s answer);
        returns the node that ends the pinned path."""
        if node is not self.root and used < len(node.key):
            node = self._split(node, used)
        n: Node | None = node
        while n is not None and n is not self.root:
            if n.locks == 0:
                self.locked_blocks += len(n.key) // self.block_size
            n.locks += 1
            n = n.parent
        return node

    def unlock(self, node: Node, now: float) -> None:
        """Releases a path pinned by ``lock``."""
        n: Node | None = node
        while n is not None and n is not self.root:
            n.locks -= 1
            assert n.locks >= 0, "unlock without lock"
            if n.locks == 0:
                self.locked_blocks -= len(n.key) // self.block_size
                n.stamp = now
                if not n.children:
                    self._push(n)
            n = n.parent

    # ------------------------------------------------------------------ memory

    def allocate(self, n: int) -> bool:
        """Takes ``n`` private blocks, evicting if needed; False (nothing changed) if
        they are not available."""
        if n <= 0:
            return True
        if n > self.available_blocks:
            return False
        self._make_room(n)
        self.private_blocks += n
        return True

    def free(self, n: int) -> None:
        assert 0 <= n <= self.private_blocks, f"free {n} of {self.private_blocks}"
        self.private_blocks -= n

    def insert(self, tokens: Tokens, now: float) -> Node:
        """Caches the whole blocks of ``tokens`` (touched at ``now``); returns the node
        that ends them (not locked)."""
        bs = self.block_size
        n = len(tokens) - len(tokens) % bs
        node, pos = self.root, 0
        while pos < n:
            child = node.children.get(tokens[pos:pos + bs])
            if child is None:
                new = n - pos
                node.locks += 1  # keep the parent through any eviction (no block counted)
                try:
                    self._make_room(new // bs)
                finally:
                    node.locks -= 1
                    if node.locks == 0 and not node.children:
                        self._push(node)  # eviction may have dropped its heap entry
                child = Node(tokens[pos:n], node)
                node.children[child.key[:bs]] = child
                node.version += 1
                self.cached_blocks += new // bs
                child.stamp = now
                self._push(child)
                return child
            m = common_prefix_len(child.key, tokens, pos, n)
            m -= m % bs
            if m < len(child.key):
                child = self._split(child, m)
            if now > child.stamp:
                child.stamp = now
                if child.locks == 0 and not child.children:
                    self._push(child)  # its older heap entry is stale now
            node, pos = child, pos + m
        return node

    def _make_room(self, n: int) -> None:
        while self.num_blocks - self.used_blocks < n:
            if not self._evict_one():
                raise RuntimeError("KV accounting: no evictable block left")

    def _evict_one(self) -> bool:
        while self._heap:
            stamp, _, node = heapq.heappop(self._heap)
            if node.locks or node.children or node.parent is None or node.stamp != stamp:
                continue  # stale entry
            parent = node.parent
            del parent.children[node.key[:self.block_size]]
            node.parent = None
            blocks = len(node.key) // self.block_size
            self.cached_blocks -= blocks
            self.evicted_blocks += blocks
            if parent is not self.root and parent.locks == 0 and not parent.children:
                self._push(parent)
            return True
        return False

    def _push(self, node: Node) -> None:
        heapq.heappush(self._heap, (node.stamp, next(self._seq), node))

    def _split(self, node: Node, k: int) -> Node:
        """Splits ``node``'s edge after ``k`` tokens (whole blocks); returns the upper
        part, which keeps the locks, the stamp and the place under the parent."""
        bs = self.block_size
        assert 0 < k < len(node.key) and k % bs == 0, "split inside a block"
        parent = node.parent
        assert parent is not None
        upper = Node(node.key[:k], parent)
        upper.locks, upper.stamp = node.locks, node.stamp
        parent.children[upper.key[:bs]] = upper
        parent.version += 1
        node.key = node.key[k:]
        node.parent = upper
        upper.children[node.key[:bs]] = node
        return upper


def common_prefix_len(key: Tokens, tokens: Tokens, pos: int, end: int) -> int:
    """Length of the common prefix of ``key`` and ``tokens[pos:end]``."""
    m = min(len(key), end - pos)
    if tokens[pos:pos + m] == key[:m]:
        return m
    lo, hi = 0, m  # invariant: the first lo tokens agree, the first hi do not all agree
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if tokens[pos:pos + mid] == key[:mid]:
            lo = mid
        else:
            hi = mid
    return lo
