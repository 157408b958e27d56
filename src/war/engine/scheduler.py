"""Continuous batching: which sequences run this step, with how many tokens.

Knows: the waiting queue (ordered by priority, then arrival), the running
sequences, the token budget of a step, KV blocks (through the block manager)
and preemption. Does not know models, logits, sampling or drafts: the engine
asks for draft slots after scheduling (``reserve``).

A step holds decoding sequences (one pending token each, plus drafts the engine
adds) and prefill chunks (prompts, or the recomputation of preempted
sequences), under ``max_num_batched_tokens``. When KV blocks run out, the
lowest-priority running sequence is preempted: its blocks are released (its
full blocks stay in the prefix cache, so recomputing it is often cheap) and it
goes back to the queue with its tokens and random stream; nothing is dropped.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from war.engine.block_manager import BlockManager
from war.engine.sequence import SeqStatus, Sequence


@dataclass
class SchedulerOutput:
    """One step's plan. ``prefills`` pairs a sequence with its chunk length."""

    decodes: list[Sequence] = field(default_factory=list)
    prefills: list[tuple[Sequence, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return len(self.decodes) + sum(n for _, n in self.prefills)

    @property
    def is_empty(self) -> bool:
        return not self.decodes and not self.prefills


class Scheduler:
    """Plans steps over a block manager. Mutates sequences' block tables."""

    def __init__(self, blocks: BlockManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.blocks = blocks
        self.block_size = blocks.block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self._waiting: list[tuple[tuple[float, int], Sequence]] = []
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    # ------------------------------------------------------------ queue

    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        heapq.heappush(self._waiting, (seq.sort_key(), seq))

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def waiting(self) -> list[Sequence]:
        return [s for _, s in sorted(self._waiting, key=lambda e: e[0])]

    def has_work(self) -> bool:
        return bool(self._waiting or self.running)

    def remove_waiting(self, seq: Sequence) -> None:
        self._waiting = [(k, s) for k, s in self._waiting if s is not seq]
        heapq.heapify(self._waiting)

    # ------------------------------------------------------------ planning

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        self.running.sort(key=Sequence.sort_key)
        scheduled: set[int] = set()
        # Running sequences in priority order: decodes take one token, prefills a chunk.
        for seq in list(self.running):
            if budget <= 0:
                break
            if seq.status is not SeqStatus.RUNNING:
                continue  # preempted earlier in this loop
            n = 1 if seq.is_decoding else min(seq.num_pending, budget)
            if not self._ensure_slots(seq, seq.num_computed + n, scheduled, out):
                continue  # it was preempted itself
            scheduled.add(id(seq))
            budget -= n
            if seq.is_decoding:
                out.decodes.append(seq)
            else:
                out.prefills.append((seq, n))
        # Then admit waiting sequences while the budget and the blocks allow.
        while self._waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self._waiting[0][1]
            n = self._admit(seq, budget)
            if n == 0:
                break
            heapq.heappop(self._waiting)
            self.running.append(seq)
            scheduled.add(id(seq))
            budget -= n
            out.prefills.append((seq, n))
        return out

    def _admit(self, seq: Sequence, budget: int) -> int:
        """Gives a waiting sequence its cached prefix and blocks for its first
        chunk; returns the chunk length (0: not now, nothing changed)."""
        first = seq.num_preemptions == 0 and seq.num_output == 0
        match = self.blocks.match_prefix(seq.token_ids, max_tokens=seq.num_tokens - 1)
        self.blocks.acquire(match.block_ids)
        n = min(seq.num_tokens - match.num_tokens, budget)
        need = self._blocks_for(match.num_tokens + n) - len(match.block_ids)
        if not self.blocks.can_allocate(need):
            self.blocks.release(match.block_ids)
            return 0
        seq.block_table = list(match.block_ids) + self.blocks.allocate(need)
        seq.num_computed = match.num_tokens
        seq.num_published_blocks = len(match.block_ids)
        seq.status = SeqStatus.RUNNING
        if first:
            seq.num_cached_tokens = match.num_tokens
        return n

    def _ensure_slots(
        self, seq: Sequence, num_tokens: int, scheduled: set[int], out: SchedulerOutput
    ) -> bool:
        """Allocates blocks so ``seq`` has slots for ``num_tokens`` tokens,
        preempting lower-priority unscheduled sequences (or ``seq`` itself) if
        blocks run out. Returns False when ``seq`` was preempted."""
        need = self._blocks_for(num_tokens) - len(seq.block_table)
        while need > 0 and not self.blocks.can_allocate(need):
            victim = self._victim(scheduled)
            self.preempt(victim)
            out.preempted.append(victim)
            if victim is seq:
                return False
        if need > 0:
            seq.block_table.extend(self.blocks.allocate(need))
        return True

    def _victim(self, scheduled: set[int]) -> Sequence:
        candidates = [s for s in self.running if id(s) not in scheduled]
        assert candidates, "no sequence to preempt: the cache cannot hold one sequence"
        return max(candidates, key=Sequence.sort_key)

    def reserve(self, seq: Sequence, num_tokens: int) -> int:
        """Allocates slots for up to ``num_tokens`` tokens of ``seq`` (from the
        start) without preempting anyone; returns how many tokens have slots."""
        have = len(seq.block_table) * self.block_size
        if num_tokens <= have:
            return num_tokens
        need = self._blocks_for(num_tokens) - len(seq.block_table)
        got = need
        while got > 0 and not self.blocks.can_allocate(got):
            got -= 1
        if got > 0:
            seq.block_table.extend(self.blocks.allocate(got))
        return min(num_tokens, len(seq.block_table) * self.block_size)

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Releases blocks not needed to hold ``num_tokens`` tokens."""
        keep = self._blocks_for(num_tokens)
        if len(seq.block_table) > keep:
            self.blocks.release(seq.block_table[keep:])
            del seq.block_table[keep:]

    # ------------------------------------------------------------ lifecycle

    def publish(self, seq: Sequence) -> None:
        """Offers the sequence's newly completed full blocks to the prefix cache."""
        full = min(seq.num_computed // self.block_size, len(seq.block_table))
        if full <= seq.num_published_blocks:
            return
        upto = full * self.block_size
        canonical = self.blocks.publish(
            seq.token_ids[:upto], seq.block_table[:full], start_block=seq.num_published_blocks
        )
        seq.block_table[:full] = canonical
        seq.num_published_blocks = full

    def preempt(self, seq: Sequence) -> None:
        """Frees a running sequence's blocks and queues it for recomputation."""
        self.publish(seq)
        self.blocks.release(seq.block_table)
        seq.block_table = []
        seq.num_computed = 0
        seq.num_published_blocks = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.running.remove(seq)
        self.add(seq)

    def finish(self, seq: Sequence) -> None:
        """Releases a finished (or aborted) sequence's blocks."""
        if seq.status is SeqStatus.RUNNING:
            self.publish(seq)
            self.blocks.release(seq.block_table)
            self.running.remove(seq)
        elif seq.status is SeqStatus.WAITING:
            self.remove_waiting(seq)
        seq.block_table = []
        seq.status = SeqStatus.FINISHED

    def preempt_all(self) -> list[Sequence]:
        """Preempts every running sequence (after a weight update)."""
        victims = list(self.running)
        for seq in victims:
            self.preempt(seq)
        return victims

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)
