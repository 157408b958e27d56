"""The discrete-event simulator: a fleet of simulated replicas behind a routing policy.

Knows: virtual time (a heap of events: a trajectory's turn arrives, a replica's step
ends, an idle replica looks for work), the router's side of each request (the same
``RoutingPolicy`` objects the real router uses, asked with ``now`` and the replicas'
views: requests and tokens in flight as the router counts them, KV use and queue
length from load reports refreshed every ``load_report_interval_s``), shared draft
history (a completed response, with its lead-in, goes to the other replicas'
drafters; the live drafters of one run share one history instead), and the
synchronous RL loop (every trajectory of a step starts at once; the next step starts
when the last one ends, plus ``train_s``, with new weights: every replica's holds and
prefix cache are dropped, the draft history kept), and the context limit: a turn
whose context and response would exceed a replica's KV cannot be served, so the
trajectory ends before it (``fitting_turns``), as an agent stops when its context is
full; a trajectory whose first turn does not fit is left out. Both are counted
(``SimResult.truncated`` and ``dropped``), never silently. Does not know the wall
clock: policies and replicas only ever see ``now``; a run is deterministic given its
inputs.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from war.engine.drafting import TrajectoryDrafts
from war.engine.spec_policy import SpecPolicy, SpecPolicyConfig
from war.router.policies import make_policy
from war.router.policies.base import ReplicaView, RoutingPolicy
from war.sim.costs import CostModel
from war.sim.drafter import CachedDrafter, Drafter, LiveDrafter
from war.sim.metrics import (
    SimResult,
    StepMetrics,
    Timeline,
    TurnRecord,
    hold_time,
    kv_token_seconds,
    min_prefill_tokens,
    sequential_time,
    shared_prefix_lens,
    work_time,
)
from war.sim.replica import ReplicaConfig, SimReplica
from war.sim.sequence import SimSeq
from war.sim.workload import SimTrajectory, Tokens, Workload
from war.spec.config import SpecConfig
from war.spec.speculator import SuffixSpeculator
from war.types import GenRequest, GenResult, SamplingParams

_STEP_END, _KICK, _ARRIVE = 0, 1, 2


@dataclass(frozen=True)
class SimConfig:
    """Settings of one simulated run; validated on construction.

    ``policy`` (a name for ``make_policy``, with ``policy_settings``) routes requests
    to ``num_replicas`` replicas configured by ``replica``; ``spec`` is the suffix
    speculator's configuration; ``max_tokens`` each request's generation limit (the
    router counts it in flight; the trace decides the response's real length);
    ``timeline_s`` the width of the timeline's bins (0: no timeline)."""

    num_replicas: int = 4
    policy: str = "war"
    policy_settings: Mapping[str, Any] = field(default_factory=dict)
    replica: ReplicaConfig = field(default_factory=ReplicaConfig)
    spec: SpecConfig = field(default_factory=SpecConfig)
    max_tokens: int = 2048
    share_history: bool = True
    load_report_interval_s: float = 1.0
    train_s: float = 0.0
    timeline_s: float = 0.0

    def __post_init__(self) -> None:
        if self.num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {self.num_replicas}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not self.load_report_interval_s >= 0:  # (inf: the first report only)
            raise ValueError(f"load_report_interval_s must be >= 0, "
                             f"got {self.load_report_interval_s}")
        # (an infinite train_s starts the next RL step never, an infinite bin puts the
        # whole run at time nan)
        for f in ("train_s", "timeline_s"):
            if not 0 <= getattr(self, f) < float("inf"):
                raise ValueError(f"{f} must be >= 0 and finite, got {getattr(self, f)}")
        if self.replica.max_spec_tokens > self.spec.max_spec_tokens:
            raise ValueError("replica.max_spec_tokens exceeds spec.max_spec_tokens")


@dataclass
class _Traj:
    traj: SimTrajectory
    turn: int = 0
    context: Tokens = ()
    replica: int | None = None
    records: list[TurnRecord] = field(default_factory=list)


class Simulator:
    """One run over a workload (module docstring). ``policy`` defaults to
    ``make_policy(config.policy, **config.policy_settings)``; ``make_drafter(i)`` to a
    ``LiveDrafter`` per replica."""

    def __init__(self, config: SimConfig, cost: CostModel, workload: Workload,
                 policy: RoutingPolicy | None = None,
                 make_drafter: Callable[[int], Drafter] | None = None) -> None:
        self.config, self.cost, self.workload = config, cost, workload
        self.policy = policy if policy is not None else make_policy(
            config.policy, **dict(config.policy_settings))
        rc = config.replica
        if make_drafter is not None:
            make = make_drafter
        elif config.share_history:
            # One history for every replica: what forwarding every completed response
            # to every replica gives (with its lead-in, as the router forwards it), in
            # one pair of trees instead of one per replica; and one tree per
            # trajectory between the replicas (the same drafts: LiveDrafter).
            shared = SuffixSpeculator(config.spec)
            trajectories = TrajectoryDrafts(shared, 4096 * config.num_replicas)
            make = lambda _i: LiveDrafter(config.spec, shared=shared,  # noqa: E731
                                          trajectories=trajectories)
        else:
            make = lambda _i: LiveDrafter(config.spec)  # noqa: E731
        width = len(str(config.num_replicas - 1))
        self.replicas = [
            SimReplica(f"r{i:0{width}d}", rc, cost,
                       make(i) if rc.spec_mode != "off" else None,
                       SpecPolicy(SpecPolicyConfig(
                           mode=rc.spec_mode, max_spec_tokens_per_seq=rc.max_spec_tokens,
                           prefill_token_value=rc.prefill_token_value)))
            for i in range(config.num_replicas)]
        self._index = {r.name: i for i, r in enumerate(self.replicas)}
        self._sharing = [(i, r.drafter) for i, r in enumerate(self.replicas)  # use history
                         if r.drafter is not None and not isinstance(r.drafter, CachedDrafter)
                         and not (isinstance(r.drafter, LiveDrafter)
                                  and r.drafter.shares_history)]
        n = config.num_replicas
        self._requests = [0] * n
        self._total_requests = 0
        self._in_flight = [0] * n
        self._reports: list[tuple[int | None, int | None, int]] = [(None, None, 0)] * n
        self._views = [self._view(i) for i in range(n)]
        self._report_time = float("-inf")
        self._events: list[tuple[float, int, int, Any]] = []
        self._seq = 0
        self._kicked = [False] * n
        self._states: dict[int, _Traj] = {}  # id of a live SimSeq -> its trajectory
        self._sampling = SamplingParams(temperature=0.0, max_tokens=config.max_tokens,
                                        logprobs=False)
        self.result = SimResult([], timeline=Timeline(config.timeline_s)
                                if config.timeline_s > 0 else None)
        self.now = 0.0

    # ------------------------------------------------------------------ the run

    def run(self) -> SimResult:
        """Runs every RL step of the workload; returns the metrics."""
        capacity = min(r.kv.capacity_tokens for r in self.replicas)
        for s, step_trajs in enumerate(self.workload.steps):
            if s:
                self._settle()
                self._load_weights()
                self.now += self.config.train_s
            for r in self.replicas:
                if r.drafter is not None:
                    r.drafter.observe_rl_step(s)
            trajs = self._fit(step_trajs, capacity)
            m = StepMetrics(s, self.now, trajectories=len(trajs))
            states = [_Traj(t) for t in trajs]
            for st in states:
                self._push(self.now, _ARRIVE, st)
            self._drain(m, len(states))
            self._close_step(m, states)
            self.result.steps.append(m)
        self.result.preemptions = sum(r.stats.preemptions for r in self.replicas)
        self.result.replica_steps = sum(r.stats.steps for r in self.replicas)
        return self.result

    def _fit(self, trajs: Sequence[SimTrajectory], capacity: int) -> list[SimTrajectory]:
        """The step's trajectories cut to the turns that fit ``capacity`` tokens of KV
        (counted in ``result.truncated``); those without a fitting turn are left out
        (``result.dropped``)."""
        kept = []
        for t in trajs:
            n = fitting_turns(t, capacity)
            if n == 0:
                self.result.dropped += 1
                continue
            if n < len(t.turns):
                self.result.truncated += 1
                t = dataclasses.replace(t, turns=t.turns[:n])
            kept.append(t)
        return kept

    def _settle(self) -> None:
        """Runs what is left after a step's last trajectory: only wake-ups of replicas
        that have nothing to do. The clock stays at the step's end: a wake-up left for
        a hold's expiry may lie after it, and the next step starts at the end."""
        while self._events:
            _, _, kind, payload = heapq.heappop(self._events)
            assert kind == _KICK, "a step ended with work in flight"
            self._kick(payload)
            assert not self.replicas[payload].busy

    def _load_weights(self) -> None:
        """The policy's weights change between RL steps (docs/sim.md): every replica
        drops its holds and its prefix cache, whose KV the old weights computed, as the
        engine's ``load_weights`` does; nothing runs then (synchronous RL). The draft
        history is tokens, not KV, and carries over (SuffixDecoding across RL steps)."""
        for r in self.replicas:
            r.load_weights(self.now)

    def _push(self, t: float, kind: int, payload: Any) -> None:
        self._seq += 1
        heapq.heappush(self._events, (t, self._seq, kind, payload))

    def _drain(self, m: StepMetrics, remaining: int) -> None:
        while remaining:
            t, _, kind, payload = heapq.heappop(self._events)
            assert t >= self.now, "time went backwards"
            self.now = t
            if kind == _ARRIVE:
                self._arrive(payload)
            elif kind == _KICK:
                self._kick(payload)
            else:
                remaining -= self._step_end(payload, m)

    # ------------------------------------------------------------------ routing

    def _view(self, i: int) -> ReplicaView:
        free, total, waiting = self._reports[i]
        return ReplicaView(self.replicas[i].name, True, self._requests[i], self._in_flight[i],
                           free, total, waiting)

    def _refresh_reports(self) -> None:
        if self.now - self._report_time < self.config.load_report_interval_s:
            return
        self._report_time = self.now
        for i, r in enumerate(self.replicas):
            bs = r.kv.block_size
            self._reports[i] = ((r.kv.num_blocks - r.kv_used_blocks) * bs,
                                r.kv.capacity_tokens, len(r.waiting))
            self._views[i] = self._view(i)

    def _arrive(self, st: _Traj) -> None:
        traj, now = st.traj, self.now
        turn = traj.turns[st.turn]
        prompt = st.context + turn.prompt
        request = GenRequest(f"{traj.traj_id}/{st.turn}", prompt, self._sampling,
                             trajectory_id=traj.traj_id, group_id=traj.group_id)
        self._refresh_reports()
        decision = self.policy.select(request, self._views, now)
        i = self._index[decision.replica]
        if st.replica is not None and st.replica != i:
            self.result.migrations += 1
        self.result.policy_migrations += decision.migrated
        priority = decision.priority if decision.priority is not None else request.priority
        self._seq += 1
        seq = SimSeq(request, traj, st.turn, prompt, priority, self._seq)
        self._states[id(seq)] = st
        self._requests[i] += 1
        self._total_requests += 1
        self._in_flight[i] += len(prompt) + self.config.max_tokens
        self._views[i] = self._view(i)
        self.replicas[i].submit(seq)
        self._wake(i)

    def _wake(self, i: int) -> None:
        if not self._kicked[i] and not self.replicas[i].busy:
            self._kicked[i] = True
            self._push(self.now, _KICK, i)

    def _kick(self, i: int) -> None:
        self._kicked[i] = False
        r = self.replicas[i]
        if not r.busy and r.has_work():
            dt = r.start_step(self.now)
            if dt is None:  # held contexts fill its KV: look again when one expires
                self._push(r.hold_expiry, _KICK, i)
            else:
                self._push(self.now + dt, _STEP_END, i)

    def _step_end(self, i: int, m: StepMetrics) -> int:
        r, now = self.replicas[i], self.now
        done = r.finish_step(now)
        ended = 0
        for seq in done:
            ended += self._complete(i, seq, m)
        if self.result.timeline is not None:
            self.result.timeline.record(now, self._total_requests, r.stats.last_drafted,
                                        r.stats.last_decodes)
        r.stats.last_drafted = r.stats.last_decodes = 0
        self._wake(i)
        return ended

    def _complete(self, i: int, seq: SimSeq, m: StepMetrics) -> int:
        st, now, req = self._states.pop(id(seq)), self.now, seq.request
        name = self.replicas[i].name
        result = GenResult(req.request_id, seq.response, (), "stop", seq.num_prompt,
                           seq.cached_prompt, seq.passes, seq.drafted, seq.accepted,
                           seq.preemptions)
        self._requests[i] -= 1
        self._total_requests -= 1
        self._in_flight[i] -= seq.num_prompt + self.config.max_tokens
        self._views[i] = self._view(i)
        self.policy.on_complete(req, result, name, now)
        if self.config.share_history and self._sharing:
            lead = min(self.config.spec.lead_in, len(seq.context))
            tokens = seq.context[len(seq.context) - lead:] + seq.response
            for j, drafter in self._sharing:
                if j != i:
                    drafter.share(tokens, st.traj.group_id)
        turn = st.traj.turns[st.turn]
        st.records.append(TurnRecord(len(st.context), len(turn.prompt), len(seq.response),
                                     seq.passes, seq.drafted, turn.tool_s))
        m.generated += seq.generated
        m.passes += seq.passes
        m.drafted += seq.drafted
        m.accepted += seq.accepted
        m.context_sum += seq.context_sum
        m.prompt_tokens += seq.num_prompt
        m.cached_tokens += seq.cached_prompt
        st.context = seq.context + seq.response
        st.replica = i
        st.turn += 1
        if st.turn < len(st.traj.turns):
            self._push(now + turn.tool_s, _ARRIVE, st)
            return 0
        m.finish_times.append(now - m.start)
        self.replicas[i].finish_trajectory(st.traj.traj_id, now)
        finish = getattr(self.policy, "finish_trajectory", None)
        if finish is not None:
            finish(st.traj.traj_id, now)
        return 1

    # ------------------------------------------------------------------ metrics

    def _close_step(self, m: StepMetrics, states: list[_Traj]) -> None:
        m.end = self.now
        rc = self.config.replica
        r0 = self.replicas[0]
        chunk = rc.max_num_batched_tokens
        trajs = [st.traj for st in states]
        prefill = min_prefill_tokens(trajs)
        # First tokens a trajectory shares with others (a group's prompt, a system prompt
        # every task has): a replica's prefix cache holds them once for all.
        shared = shared_prefix_lens(trajs)
        shared_sum = sum(p * sum(r.passes for r in st.records)
                         for p, st in zip(shared, states, strict=True))
        shared_min = min((p for p in shared if p), default=0)
        m.work_s = work_time(m, prefill, self.cost, r0.kv.capacity_tokens,
                             rc.max_num_seqs, chunk, self.config.num_replicas,
                             shared_sum, shared_min)
        # Between two turns a trajectory's context stays in a KV or is computed again.
        gaps = [(max(0, st.records[j + 1].context - p), st.records[j].tool_s)
                for p, st in zip(shared, states, strict=True)
                for j in range(len(st.records) - 1)]
        m.hold_s = hold_time(m, prefill, self.cost, r0.kv.capacity_tokens, rc.max_num_seqs,
                             chunk, self.config.num_replicas, gaps, shared_sum, shared_min)
        m.longest_s = max((sequential_time(st.records, self.cost, chunk) for st in states),
                          default=0.0)
        kv = sum(kv_token_seconds(st.records, self.cost, chunk, p)
                 for p, st in zip(shared, states, strict=True))
        m.kv_s = kv / (r0.kv.capacity_tokens * self.config.num_replicas)


def fitting_turns(traj: SimTrajectory, capacity: int) -> int:
    """How many of ``traj``'s first turns fit a replica of ``capacity`` KV tokens: each
    turn's whole context (every earlier prompt and response, and its own prompt) plus
    its response must fit."""
    context = 0
    for k, turn in enumerate(traj.turns):
        context += len(turn.prompt) + len(turn.response)
        if context > capacity:
            return k
    return len(traj.turns)
