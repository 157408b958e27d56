"""A simulated replica: the engine's continuous batching, in virtual time.

Knows: its queue (priority, then arrival) and running sequences, its KV memory
(``PrefixKV``: private blocks and a radix prefix cache with LRU eviction), its
speculation (``Speculation``: a drafter and the engine's load-aware ``SpecPolicy``),
and the cost model that says how long each step takes. One step, as the engine's
scheduler plans it: running sequences in priority order (a decode takes one token, a
prefill a chunk, under ``max_num_batched_tokens``; when blocks run out the
lowest-priority unscheduled sequence is preempted, its computed prefix cached for its
recomputation), then waiting sequences admitted with their longest cached prefix;
then drafts for the decoding sequences, their budget, verification against the trace,
and the step's duration. Does not know routing, trajectories beyond one turn, or the
wall clock: ``start_step(now)`` plans and returns how long until the step ends,
``finish_step(now)`` applies it.

KV holds (``kv_hold_s``) and whole-prompt admission (``admit_whole_prompt``) follow
the engine's scheduler (``war.engine.scheduler``): a finished turn's context stays
pinned for its trajectory's next turn, which goes ahead of a head of the queue that
does not fit; holds give way only to running sequences (before anyone is
preempted), expire, or end with the trajectory (``finish_trajectory``); when they
leave no room for anything waiting, ``start_step`` returns None and the replica
waits for a next turn or for ``hold_expiry``. ``load_weights`` (between RL steps, on
an idle replica) drops every hold and the whole prefix cache, as a weight update does.

Simplifications (docs/sim.md): a prompt is cached when its prefill completes and a
context when its turn ends, as far as its KV is computed (all but the last sampled
token; the engine publishes every computed full block after each step).
``max_coalesced_steps`` > 1 (cluster scale) runs up to that many consecutive steps
in one event while the replica only decodes at most ``coalesce_max_seqs`` sequences
and nobody waits (the long tail of a step), until a turn completes; a request that
arrives meanwhile waits for the end of those steps.
"""

from __future__ import annotations

import heapq
from operator import attrgetter

from war.engine.spec_policy import SpecPolicy
from war.sim.costs import CostModel
from war.sim.drafter import Drafter
from war.sim.fastpath import eligible, lone_steps
from war.sim.kvcache import Node, PrefixKV
from war.sim.sequence import SimSeq
from war.sim.settings import ReplicaConfig, ReplicaStats
from war.sim.speculation import Speculation

__all__ = ["ReplicaConfig", "ReplicaStats", "SimReplica", "kv_blocks"]

_KEY = attrgetter("key")


def kv_blocks(config: ReplicaConfig, cost: CostModel) -> int:
    """A replica's KV blocks: ``num_kv_blocks``, else as many as the cost model's KV
    capacity holds; ValueError when that is unknown or less than one block."""
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    cap = cost.kv_capacity_tokens()
    if cap is None:
        raise ValueError(f"{cost.name} does not know KV capacity: set num_kv_blocks")
    if cap < config.block_size:
        raise ValueError(f"{cost.name}'s KV capacity ({cap} tokens) is less than one "
                         f"block (block_size {config.block_size})")
    return cap // config.block_size


class SimReplica:
    """One simulated replica (module docstring)."""

    def __init__(self, name: str, config: ReplicaConfig, cost: CostModel,
                 drafter: Drafter | None, policy: SpecPolicy) -> None:
        self.name, self.config, self.cost = name, config, cost
        self.spec = Speculation(drafter, policy, config.spec_mode, config.max_spec_tokens,
                                config.spec_interval)
        self.drafter = self.spec.drafter
        self.kv = PrefixKV(kv_blocks(config, cost), config.block_size)
        self.waiting: list[tuple[tuple[float, int], SimSeq]] = []
        self.running: list[SimSeq] = []
        self.stats = ReplicaStats()
        self.busy = False
        self._prefills: list[tuple[SimSeq, int]] = []
        self._decodes: list[tuple[SimSeq, int, int]] = []
        self._done: list[SimSeq] = []  # turns completed by coalesced steps
        self._preempted: set[int] = set()  # ids preempted while planning this step
        self._step_no = 0
        self._holds: dict[str, tuple[Node, float]] = {}  # trajectory -> (pinned, until)
        self._hold_next = float("inf")  # earliest expiry of a hold

    def submit(self, seq: SimSeq) -> None:
        if seq.nprompt + seq.rlen > self.kv.capacity_tokens:
            raise ValueError(f"{seq.request.request_id}: {seq.nprompt} + {seq.rlen} tokens "
                             f"exceed replica {self.name}'s KV")
        heapq.heappush(self.waiting, (seq.key, seq))

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def kv_used_blocks(self) -> int:
        """Blocks held by running sequences (private or pinned in the cache)."""
        return self.kv.private_blocks + self.kv.locked_blocks

    # ------------------------------------------------------------------ planning

    def start_step(self, now: float) -> float | None:
        """Plans the next step (or steps, when coalescing) at ``now``; returns how long
        until it ends, or None when nothing can run before a held context is taken up
        or expires (``hold_expiry``). The replica must have work."""
        dt = self._plan(now)
        if dt is None:
            return None
        cfg = self.config
        steps = 1
        lone = eligible(self)
        while (steps < cfg.max_coalesced_steps and not self.waiting and not self._prefills
               and len(self.running) <= cfg.coalesce_max_seqs
               and len(self._decodes) == len(self.running)):
            done = self._apply(now + dt)
            if done:
                self._done = done
                break
            if lone and len(self.running) == 1:
                dt, steps, complete = lone_steps(self, now, dt, steps)
                if complete:
                    self._done = list(self.running)
                    break
                if steps >= cfg.max_coalesced_steps:
                    break
            more = self._plan(now + dt)
            if more is None:
                break
            dt += more
            steps += 1
        self.busy = True
        return dt

    def _plan(self, now: float) -> float | None:
        cfg, kv = self.config, self.kv
        bs = cfg.block_size
        budget = cfg.max_num_batched_tokens
        running = self.running
        running.sort(key=_KEY)
        self._step_no += 1
        mark = self._step_no
        preempted = self._preempted
        preempted.clear()
        if now >= self._hold_next:
            self._expire(now)
        prefills: list[tuple[SimSeq, int]] = []
        decodes: list[SimSeq] = []
        context = 0
        for seq in list(running):
            if budget <= 0:
                break
            if preempted and id(seq) in preempted:
                continue  # preempted earlier in this loop
            g, c = seq.generated, seq.computed
            ntok = seq.nprompt + g
            dec = g > 0 and c >= ntok - 1
            n = 1 if dec else min((ntok if g == 0 else ntok - 1) - c, budget)
            want = -(-(c + n) // bs) - seq.cached // bs - seq.private
            if want > 0:
                if kv.allocate(want):
                    seq.private += want
                elif not self._ensure(seq, c + n, mark, now):
                    continue
            seq.mark = mark
            budget -= n
            context += c + n
            if dec:
                decodes.append(seq)
            else:
                prefills.append((seq, n))
        while self.waiting and budget > 0 and len(running) < cfg.max_num_seqs:
            seq = self.waiting[0][1]
            n = self._admit(seq, budget, now)
            if n:
                heapq.heappop(self.waiting)
            elif self._holds:
                # A trajectory whose context is held here goes ahead of a head that
                # does not fit; else the head waits for room (module docstring).
                got = self._admit_held(budget, now)
                if got is None:
                    break
                seq, n = got
            else:
                break
            running.append(seq)
            seq.mark = mark
            budget -= n
            context += seq.computed + n
            prefills.append((seq, n))
        if not prefills and not decodes:
            if self._holds:
                return None  # held contexts fill the KV: wait for their turns or expiry
            head = self.waiting[0][1] if self.waiting else None
            raise RuntimeError(f"replica {self.name} cannot schedule anything "
                               f"(head of queue: {head.request.request_id if head else None})")
        base = cfg.max_num_batched_tokens - budget
        ks, accs = self.spec.plan(decodes, base, context, budget, kv)
        drafted = sum(ks)
        batch, ctx = base + drafted, context + drafted
        dt = self.cost.step_time(len(prefills) + len(decodes), batch, ctx, drafted)
        self.spec.observe_step(batch, ctx, dt)
        self._prefills = prefills
        self._decodes = list(zip(decodes, ks, accs, strict=True))
        st = self.stats
        st.steps += 1
        st.busy_s += dt
        st.last_drafted += drafted
        st.last_decodes += len(decodes)
        return dt

    def _ensure(self, seq: SimSeq, slots: int, mark: int, now: float) -> bool:
        """Private blocks for ``slots`` tokens of ``seq``, preempting the lowest-priority
        sequences not scheduled in step ``mark`` if needed; False if ``seq`` itself was
        preempted."""
        bs = self.config.block_size
        want = -(-slots // bs) - seq.cached // bs - seq.private
        while want > 0 and not self.kv.allocate(want):
            if self._break_hold(now):
                continue
            victim = max((s for s in self.running if s.mark != mark), key=_KEY)
            self.preempt(victim, now)
            if victim is seq:
                return False
        if want > 0:
            seq.private += want
        return True

    def _admit(self, seq: SimSeq, budget: int, now: float) -> int:
        """Gives a waiting sequence its cached prefix and blocks for its first chunk;
        returns the chunk's length (0: not now, nothing changed). With
        ``admit_whole_prompt``, only if the blocks of its whole prefill are available
        beyond what admitted prefills still need."""
        bs = self.config.block_size
        target = seq.prefill_target
        m = seq.match = (self.kv.reuse(seq.match, target - 1)
                         or self.kv.match(seq.tokens(seq.num_tokens), target - 1))
        matched = m.tokens
        locked = self.kv.lock(m.node, m.used)
        n = min(target - matched, budget)
        want = -(-(matched + n) // bs) - matched // bs
        if self.config.admit_whole_prompt:
            whole = -(-(target + 1) // bs) - matched // bs
            if whole > self.kv.available_blocks - self._reserved():
                self.kv.unlock(locked, now)
                return 0
        if not self.kv.allocate(want):
            self.kv.unlock(locked, now)
            return 0
        tid = seq.request.trajectory_id
        if tid is not None and tid in self._holds:
            self._release_hold(tid, now)  # the sequence pins what it matched of it
            self.stats.holds_used += 1
        seq.node, seq.cached, seq.computed, seq.private = locked, matched, matched, want
        if not seq.started:
            seq.started = True
            seq.cached_prompt = matched
            self.stats.prompt_tokens += seq.nprompt
            self.stats.cached_tokens += matched
            if self.drafter is not None:
                self.drafter.begin(seq)
        return n

    def _reserved(self) -> int:
        """Blocks that running prefills will still take to reach their targets."""
        bs, total = self.config.block_size, 0
        for s in self.running:
            if s.computed < s.prefill_target:
                total += max(-(-(s.prefill_target + 1) // bs) - s.cached // bs - s.private, 0)
        return total

    def _admit_held(self, budget: int, now: float) -> tuple[SimSeq, int] | None:
        """Admits the first waiting sequence (in queue order) whose trajectory's
        context is held here, if it fits; returns it and its chunk."""
        holds = self._holds
        for key, seq in sorted(e for e in self.waiting if e[1].request.trajectory_id in holds):
            n = self._admit(seq, budget, now)
            if n:
                self.waiting.remove((key, seq))
                heapq.heapify(self.waiting)
                return seq, n
        return None

    # ------------------------------------------------------------------ holds

    def _hold(self, seq: SimSeq, node: Node, now: float) -> None:
        """Pins a finished turn's cached context for its trajectory's next turn."""
        tid = seq.request.trajectory_id
        if tid is None:
            return
        if tid in self._holds:
            self._release_hold(tid, now)
        until = now + self.config.kv_hold_s
        self._holds[tid] = (self.kv.lock(node, len(node.key)), until)
        self._hold_next = min(self._hold_next, until)
        self.stats.holds += 1

    def _release_hold(self, tid: str, now: float) -> None:
        node, _ = self._holds.pop(tid)
        self.kv.unlock(node, now)
        if not self._holds:
            self._hold_next = float("inf")

    def _expire(self, now: float) -> None:
        for tid, (_, until) in list(self._holds.items()):
            if until <= now:
                self._release_hold(tid, now)
        self._hold_next = min((h[1] for h in self._holds.values()), default=float("inf"))

    def _break_hold(self, now: float) -> bool:
        """Releases a hold to make room for a running sequence: the one that expires
        first (its trajectory has been away longest); False if none."""
        holds = self._holds
        if not holds:
            return False
        self._release_hold(min(holds, key=lambda t: holds[t][1]), now)
        self.stats.holds_broken += 1
        return True

    @property
    def hold_expiry(self) -> float:
        """When the first hold expires (inf: none)."""
        return self._hold_next

    def finish_trajectory(self, trajectory_id: str, now: float) -> None:
        """The trajectory ended: its held context (if any) is released."""
        if trajectory_id in self._holds:
            self._release_hold(trajectory_id, now)

    def load_weights(self, now: float) -> None:
        """New policy weights (an RL step boundary): KV computed with the old ones is
        stale, so every hold is released and the prefix cache emptied, as the engine's
        ``load_weights`` does (it preempts what runs and clears its cache). In
        synchronous RL nothing runs then: the replica must be idle. The drafter keeps
        its history: tokens, not KV."""
        assert not (self.busy or self.running or self.waiting), (
            f"replica {self.name}: new weights while requests are in flight")
        for tid in list(self._holds):
            self._release_hold(tid, now)
        kv = self.kv
        assert kv.private_blocks == 0 and kv.locked_blocks == 0, "KV in use on an idle replica"
        # A new cache, not the old one emptied: no earlier match (``PrefixKV.reuse``)
        # can be taken for one of the new cache.
        self.kv = PrefixKV(kv.num_blocks, kv.block_size)

    # ------------------------------------------------------------------ applying

    def finish_step(self, now: float) -> list[SimSeq]:
        """Applies the planned step(s) at their end ``now``; returns the turns they
        completed (their KV released to the cache)."""
        done = self._done + self._apply(now)
        self._done = []
        for seq in done:
            self.running.remove(seq)
            # What was computed: the last sampled token is never fed back, so its KV
            # does not exist (the engine publishes the computed whole blocks).
            self._release(seq, seq.computed, now, hold=self.config.kv_hold_s > 0)
            if self.drafter is not None:
                self.drafter.end(seq)
        self.busy = False
        return done

    def _apply(self, now: float) -> list[SimSeq]:
        """Applies the planned step; returns the turns it completed."""
        st, kv, drafter = self.stats, self.kv, self.drafter
        bs = self.config.block_size
        done: list[SimSeq] = []
        for seq, n in self._prefills:
            seq.computed += n
            st.prefill_tokens += n
            if seq.generated == 0 and seq.computed == seq.nprompt:
                self._cache(seq, now)
                self._decodes.append((seq, 0, 0))  # the step samples its first token
        generated = drafted = accepted = 0
        for seq, k, acc in self._decodes:
            g0 = seq.generated
            ntok = seq.nprompt + g0
            e = min(acc + 1, seq.rlen - g0)
            seq.context_sum += ntok
            seq.generated = g = g0 + e
            ntok += e
            seq.computed = ntok - 1
            seq.passes += 1
            seq.drafted += k
            seq.accepted += acc
            generated += e
            drafted += k
            accepted += acc
            if drafter is not None:
                drafter.advance(seq, g0, g)
            keep = -(-ntok // bs) - seq.cached // bs
            if seq.private > keep:
                kv.free(seq.private - keep)
                seq.private = keep
            if g == seq.rlen:
                done.append(seq)
        st.passes += len(self._decodes)
        st.generated += generated
        st.drafted += drafted
        st.accepted += accepted
        self._prefills, self._decodes = [], []
        return done

    def _cache(self, seq: SimSeq, now: float) -> None:
        """Caches the computed prefix of a running sequence and pins it instead."""
        kv, bs = self.kv, self.config.block_size
        kv.free(seq.private)
        node = kv.insert(seq.tokens(seq.computed), now)
        locked = kv.lock(node, len(node.key))
        if seq.node is not None:
            kv.unlock(seq.node, now)
        seq.node, seq.cached = locked, seq.computed - seq.computed % bs
        seq.private = -(-seq.computed // bs) - seq.cached // bs
        ok = kv.allocate(seq.private)
        assert ok, "caching a prefix never needs more blocks than it frees"

    def _release(self, seq: SimSeq, tokens: int, now: float, hold: bool = False) -> None:
        self.kv.free(seq.private)
        node = self.kv.insert(seq.tokens(tokens), now)
        if hold:
            self._hold(seq, node, now)
        if seq.node is not None:
            self.kv.unlock(seq.node, now)
        seq.node, seq.cached, seq.private = None, 0, 0

    def preempt(self, seq: SimSeq, now: float) -> None:
        """Frees a running sequence's KV (its computed prefix stays cached) and queues it
        again for recomputation."""
        self.running.remove(seq)
        self._preempted.add(id(seq))
        self._release(seq, seq.computed, now)
        seq.computed = 0
        seq.preemptions += 1
        self.stats.preemptions += 1
        heapq.heappush(self.waiting, (seq.key, seq))
