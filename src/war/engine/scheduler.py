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

Agentic trajectories (``kv_hold_s`` > 0): when a turn of a trajectory finishes,
its context's cached blocks stay held for the trajectory's next turn (which
comes back after a tool call) for up to ``kv_hold_s`` seconds, so that other
requests cannot evict them meanwhile. The next turn takes them over; a waiting
turn whose context is held goes ahead of a head of the queue that does not fit.
A hold ends when taken over, when it expires, when the trajectory is finished
(``release_hold``), when its queued next turn is aborted (as aborting a running
turn lets go of the context it took over), or when a running sequence needs its
blocks (holds give way, soonest expiring first, before anyone is preempted).
A hold expires at ``kv_hold_s`` even when its trajectory's next turn is queued
for room (docs/engine.md: keeping such holds until admitted measured worse under KV
pressure); the context then stays cached but unpinned.
Waiting requests never break a hold, whatever their priority: when held
contexts leave too little room for anything waiting, nothing runs until one is
taken over or expires (``hold_expiry``), as recomputing a long context costs
more than waiting out a tool call (breaking holds for waiting requests was
measured to thrash on long contexts: docs/sim.md). With
``admit_whole_prompt`` a waiting sequence is admitted only when the blocks of its
whole prefill are available beyond what admitted prefills still need, so a long
prompt never preempts running sequences chunk by chunk. Time is the ``now``
passed in.
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

    def __init__(self, blocks: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 kv_hold_s: float = 0.0, admit_whole_prompt: bool = False):
        self.blocks = blocks
        self.block_size = blocks.block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.kv_hold_s = kv_hold_s if blocks.enable_prefix_cache else 0.0
        self.admit_whole_prompt = admit_whole_prompt
        self._waiting: list[tuple[tuple[float, int], Sequence]] = []
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        # trajectory id -> (blocks held for its next turn, expiry time)
        self._holds: dict[str, tuple[list[int], float]] = {}
        self.num_holds = 0  # turns whose context was held
        self.num_holds_used = 0  # next turns that took their held context over
        self.num_holds_broken = 0  # holds released early to make room
        self.blocked = False  # the last plan ran nothing because held contexts fill the KV

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

    def schedule(self, now: float = 0.0) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        self.expire_holds(now)
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
            if n:
                heapq.heappop(self._waiting)
            else:
                got = self._admit_held(budget) if self._holds else None
                if got is None:
                    break
                seq, n = got
            self.running.append(seq)
            scheduled.add(id(seq))
            budget -= n
            out.prefills.append((seq, n))
        self.blocked = out.is_empty and bool(self._waiting) and bool(self._holds)
        return out

    def _admit(self, seq: Sequence, budget: int) -> int:
        """Gives a waiting sequence its cached prefix and blocks for its first
        chunk; returns the chunk length (0: not now, nothing changed)."""
        first = seq.num_preemptions == 0 and seq.num_output == 0
        match = self.blocks.match_prefix(seq.token_ids, max_tokens=seq.num_tokens - 1)
        self.blocks.acquire(match.block_ids)
        n = min(seq.num_tokens - match.num_tokens, budget)
        need = self._blocks_for(match.num_tokens + n) - len(match.block_ids)
        required = need
        if self.admit_whole_prompt:  # the whole prefill, beyond what admitted ones need
            whole = self._blocks_for(seq.num_tokens + 1) - len(match.block_ids)
            required = max(need, whole + self._reserved())
        if not self.blocks.can_allocate(required):
            self.blocks.release(match.block_ids)
            return 0
        tid = seq.request.trajectory_id
        if tid is not None and tid in self._holds:
            self._release_hold(tid)  # the sequence holds what it matched of it now
            self.num_holds_used += 1
        seq.block_table = list(match.block_ids) + self.blocks.allocate(need)
        seq.num_computed = match.num_tokens
        seq.num_published_blocks = len(match.block_ids)
        seq.status = SeqStatus.RUNNING
        if first:
            seq.num_cached_tokens = match.num_tokens
        return n

    def _reserved(self) -> int:
        """Blocks that admitted prefills will still take to reach their first sample."""
        total = 0
        for s in self.running:
            if not s.is_decoding:
                total += max(self._blocks_for(s.num_tokens + 1) - len(s.block_table), 0)
        return total

    def _admit_held(self, budget: int) -> tuple[Sequence, int] | None:
        """Admits the first waiting sequence (in queue order) whose trajectory's
        context is held here, if it fits; returns it and its chunk."""
        holds = self._holds
        for key, seq in sorted((e for e in self._waiting
                                if e[1].request.trajectory_id in holds), key=lambda e: e[0]):
            n = self._admit(seq, budget)
            if n:
                self._waiting.remove((key, seq))
                heapq.heapify(self._waiting)
                return seq, n
        return None

    def _ensure_slots(
        self, seq: Sequence, num_tokens: int, scheduled: set[int], out: SchedulerOutput
    ) -> bool:
        """Allocates blocks so ``seq`` has slots for ``num_tokens`` tokens,
        releasing holds, then preempting lower-priority unscheduled sequences (or
        ``seq`` itself) if blocks run out. Returns False when ``seq`` was preempted."""
        need = self._blocks_for(num_tokens) - len(seq.block_table)
        while need > 0 and not self.blocks.can_allocate(need):
            if self.break_hold():
                continue
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

    def finish(self, seq: Sequence, now: float = 0.0, hold: bool = False) -> None:
        """Releases a finished (or aborted) sequence's blocks; with ``hold`` (a turn
        of a trajectory that finished normally) and ``kv_hold_s`` > 0, its cached
        context stays held for the trajectory's next turn until ``now + kv_hold_s``."""
        if seq.status is SeqStatus.RUNNING:
            self.publish(seq)
            tid = seq.request.trajectory_id
            held = hold and tid is not None and self.kv_hold_s > 0
            kept = seq.num_published_blocks if held else 0
            if kept:
                assert tid is not None
                if tid in self._holds:
                    self._release_hold(tid)
                self._holds[tid] = (seq.block_table[:kept], now + self.kv_hold_s)
                self.num_holds += 1
            self.blocks.release(seq.block_table[kept:])
            self.running.remove(seq)
        elif seq.status is SeqStatus.WAITING:
            # Aborted in the queue: had it been admitted, it would have taken its
            # trajectory's held context over, and an abort then releases it. So the
            # hold ends now rather than at its expiry (its blocks stay in the prefix
            # cache, unreferenced), unless another turn of the trajectory is queued.
            self.remove_waiting(seq)
            tid = seq.request.trajectory_id
            if tid is not None and tid in self._holds and not any(
                    s.request.trajectory_id == tid for _, s in self._waiting):
                self._release_hold(tid)
        seq.block_table = []
        seq.status = SeqStatus.FINISHED

    def preempt_all(self) -> list[Sequence]:
        """Preempts every running sequence and releases every hold (after a weight
        update)."""
        victims = list(self.running)
        for seq in victims:
            self.preempt(seq)
        for tid in list(self._holds):
            self._release_hold(tid)
        return victims

    # ------------------------------------------------------------ holds

    @property
    def num_held(self) -> int:
        """Trajectories whose context is held."""
        return len(self._holds)

    @property
    def hold_expiry(self) -> float | None:
        """When the first hold expires (None: no hold)."""
        return min((h[1] for h in self._holds.values()), default=None)

    def expire_holds(self, now: float) -> None:
        for tid, (_, until) in list(self._holds.items()):
            if until <= now:
                self._release_hold(tid)

    def release_hold(self, trajectory_id: str) -> bool:
        """Ends a trajectory's hold (it finished); False if it had none."""
        if trajectory_id not in self._holds:
            return False
        self._release_hold(trajectory_id)
        return True

    def break_hold(self) -> bool:
        """Releases a hold to make room: the one that expires first (its trajectory
        has been away longest); False if none."""
        holds = self._holds
        if not holds:
            return False
        self._release_hold(min(holds, key=lambda t: holds[t][1]))
        self.num_holds_broken += 1
        return True

    def _release_hold(self, tid: str) -> None:
        blocks, _ = self._holds.pop(tid)
        self.blocks.release(blocks)

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)
