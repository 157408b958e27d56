"""The pure-Python progress estimator: the specification of the native one.

Knows: the algorithm of the router's trajectory progress estimator, written to be
read: each tracked trajectory's progress (turns and generated tokens), which
trajectories count as finished (``finish``, or idle for ``finish_idle_s``), and per
group and fleet-wide the finished samples with the age-weighted sums of the estimate
(``war.router.policies.progress``'s module docstring gives the formula).
``war.router.policies.progress.ProgressEstimator`` (C++, csrc/progress.cc) must give
exactly this module's results, bit for bit, for every sequence of calls
(tests/router/test_progress_native.py compares them); the router's policy uses the
native one. Does not know token contents, replicas, nor the clock: every time is the
``now`` argument.

Details that decide results and that the native estimator therefore reproduces: the
order of every floating-point operation (weights ``2.0 ** ((end - ref) / half_life)``,
sums updated sample by sample, ``_recompute`` adding the samples oldest first); the
order of the pass over ``by_turns`` in ``remaining`` (a dict's insertion order, a
deleted turn count put back goes last); when sums are recomputed (the reference time
moving past 256 half-lives, ``_HEAVY`` removals, ``max(64, len)`` changes); and the
OrderedDicts' order (a trajectory or group taken out and put back goes last; bounds
drop the oldest first).

Costs: 4-8 microseconds a ``begin`` or ``observe``: hence the native estimator.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from itertools import count

from war.router.policies.progress import Progress, ProgressConfig, Sample


@dataclass
class _Traj:
    group_id: str | None
    turns: int = 0
    tokens: int = 0
    in_flight: int = 0
    since: float = 0.0  # last begin (active) or when it went idle / finished
    counted: bool = False  # its totals are among the finished samples


_HEAVY = 0.25  # a removed sample weighing more than this share of a sum: recompute


class _Samples:
    """Finished samples (key -> ``Sample``, oldest first) with the weighted sums the
    estimate needs, kept as samples come and go, so that an estimate costs a pass over
    the distinct turn counts, not over the samples (a fleet prior holds a thousand).

    A sample's weight is ``2 ** ((end - ref) / half_life)`` for a reference time
    ``ref`` (the ratios of the estimate do not depend on it); ``ref`` moves to the
    newest sample, and every sum is recomputed, when a new sample would outweigh it by
    more than 2**256; the sums are also recomputed after as many changes as there are
    samples, and whenever a removed sample weighs a large share of a sum, which bounds
    the rounding that adding and removing leaves."""

    __slots__ = ("_changes", "_ref", "_turns_left", "by_turns", "half_life", "items", "sum_w",
                 "sum_wk", "sum_wt")

    def __init__(self, half_life: float) -> None:
        self.items: OrderedDict[str, Sample] = OrderedDict()
        self.half_life = half_life
        self._ref: float | None = None
        self._changes = 0
        self.sum_w = 0.0  # sum of weights
        self.sum_wt = 0.0  # sum of w * tokens
        self.sum_wk = 0.0  # sum of w * turns
        self.by_turns: dict[int, list[float]] = {}  # turns -> [count, sum w, sum w * turns]
        self._turns_left: dict[int, float] = {}  # turns done -> remaining turns, until a change

    def __len__(self) -> int:
        return len(self.items)

    def put(self, key: str, sample: Sample) -> None:
        """Adds ``sample`` as the newest (replacing ``key``'s earlier one)."""
        old = self.items.pop(key, None)
        if old is not None:
            self._sub(old)
        self.items[key] = sample
        if self._ref is None or (sample.end - self._ref) / self.half_life > 256.0:
            self._recompute()  # (which moves ``ref`` to the newest sample)
        else:
            self._add(sample)
            self._changed()

    def pop(self, key: str) -> Sample | None:
        sample = self.items.pop(key, None)
        if sample is not None:
            self._sub(sample)
            self._changed()
        return sample

    def pop_oldest(self) -> None:
        _, sample = self.items.popitem(last=False)
        self._sub(sample)
        self._changed()

    def remaining(self, turns_done: int, tokens_done: int, rate_prior_turns: float) -> float:
        """The module docstring's estimate (at least one sample is held)."""
        sample_rate = self.sum_wt / self.sum_wk if self.sum_wk > 0.0 else 0.0
        remaining_turns = self._turns_left.get(turns_done)
        if remaining_turns is None:  # (a pass over the turn counts; kept until a change)
            ahead_w = ahead_wk = 0.0
            for turns, (_, w, wk) in self.by_turns.items():
                if turns > turns_done:
                    ahead_w += w
                    ahead_wk += wk - turns_done * w
            remaining_turns = ahead_wk / ahead_w if ahead_w > 0.0 else 1.0
            self._turns_left[turns_done] = remaining_turns
        c = rate_prior_turns
        rate = ((tokens_done + c * sample_rate) / (turns_done + c) if turns_done + c > 0
                else sample_rate)
        return remaining_turns * rate

    def _weight(self, sample: Sample) -> float:
        assert self._ref is not None, "a weight needs a reference time"
        return float(2.0 ** ((sample.end - self._ref) / self.half_life))

    def _add(self, sample: Sample) -> None:
        self._turns_left.clear()
        w = self._weight(sample)
        self.sum_w += w
        self.sum_wt += w * sample.tokens
        self.sum_wk += w * sample.turns
        bucket = self.by_turns.get(sample.turns)
        if bucket is None:
            self.by_turns[sample.turns] = [1.0, w, w * sample.turns]
        else:
            bucket[0] += 1.0
            bucket[1] += w
            bucket[2] += w * sample.turns

    def _sub(self, sample: Sample) -> None:
        self._turns_left.clear()
        if not self.items:  # the last one left: nothing to subtract from
            self._recompute()
            return
        w = self._weight(sample)
        bucket = self.by_turns[sample.turns]
        if (bucket[0] > 1.0 and w > _HEAVY * bucket[1]) or w > _HEAVY * self.sum_w:
            # Subtracting most of a sum leaves its rounding error as large as what
            # remains (a recent sample taken back, older ones weigh 2**-400): recompute.
            self._recompute()
            return
        self.sum_w -= w
        self.sum_wt -= w * sample.tokens
        self.sum_wk -= w * sample.turns
        if bucket[0] <= 1.0:
            del self.by_turns[sample.turns]  # exactly zero, not a rounding residue
        else:
            bucket[0] -= 1.0
            bucket[1] -= w
            bucket[2] -= w * sample.turns

    def _changed(self) -> None:
        self._changes += 1
        if self._changes > max(64, len(self.items)):
            self._recompute()

    def _recompute(self) -> None:
        """Every sum from the samples, weights relative to the newest (as the module
        docstring's; older samples may underflow to zero, never newer ones)."""
        self._changes = 0
        self.sum_w = self.sum_wt = self.sum_wk = 0.0
        self.by_turns = {}
        self._turns_left.clear()
        if not self.items:
            self._ref = None
            return
        self._ref = max(sample.end for sample in self.items.values())
        for sample in self.items.values():
            self._add(sample)


class ReferenceProgressEstimator:
    """Tracks trajectories' progress and groups' finished samples; estimates the
    remaining work of a trajectory. Every call may expire old state at ``now``.

    The readable specification of ``war.router.policies.progress.ProgressEstimator``
    (native): tests hold the native estimator to this one's results, call by call."""

    def __init__(self, config: ProgressConfig | None = None) -> None:
        self.config = config if config is not None else ProgressConfig()
        # a trajectory is in exactly one of these, each ordered by ``since``
        self._active: OrderedDict[str, _Traj] = OrderedDict()  # requests in flight
        self._idle: OrderedDict[str, _Traj] = OrderedDict()  # none in flight, not counted
        self._done: OrderedDict[str, _Traj] = OrderedDict()  # counted as finished
        self._groups: OrderedDict[str, _Samples] = OrderedDict()
        self._global = _Samples(self.config.half_life_s)
        self._anon = count()

    # ------------------------------------------------------------------ observing

    def begin(self, trajectory_id: str, group_id: str | None, now: float) -> float | None:
        """A request of the trajectory was sent. Returns ``remaining_for`` as it
        stood just before the call (the request's own turn included), so that a
        caller that needs both pays for one lookup."""
        t = self._active.get(trajectory_id)
        if t is None:
            t = self._idle.get(trajectory_id)
            if t is None:
                t = self._done.get(trajectory_id)
        if t is None:
            estimate = self.expected_remaining(group_id, 0, 0)
        else:
            estimate = self.expected_remaining(
                group_id if group_id is not None else t.group_id, t.turns, t.tokens)
        self.expire(now)
        t = self._take(trajectory_id)
        if t is None:
            t = _Traj(group_id)
        elif t.counted:  # it was not finished after all
            self._uncount(trajectory_id, t)
        if group_id is not None:
            t.group_id = group_id
        t.in_flight += 1
        t.since = now
        self._active[trajectory_id] = t
        self._bound()
        return estimate

    def observe(self, trajectory_id: str, group_id: str | None, generated_tokens: int,
                now: float) -> float | None:
        """A turn of the trajectory completed with ``generated_tokens`` new tokens.
        Returns ``remaining_for`` after the call (the work expected of its next turns)."""
        if generated_tokens < 0:
            raise ValueError(f"trajectory {trajectory_id}: generated_tokens < 0")
        self.expire(now)
        t = self._take(trajectory_id)
        if t is None:  # forgotten (or never begun here): start from this turn
            t = _Traj(group_id)
        elif t.counted:
            self._uncount(trajectory_id, t)
        if group_id is not None:
            t.group_id = group_id
        t.turns += 1
        t.tokens += generated_tokens
        self._settle(trajectory_id, t, now)
        # (``_settle`` may have dropped it to stay within bounds: then nothing is known)
        if trajectory_id not in self._active and trajectory_id not in self._idle:
            return self.remaining_for(trajectory_id, group_id)
        return self.expected_remaining(t.group_id, t.turns, t.tokens)

    def abort(self, trajectory_id: str, now: float) -> None:
        """A request of the trajectory failed (no turn was done)."""
        self.expire(now)
        t = self._take(trajectory_id)
        if t is not None:
            self._settle(trajectory_id, t, now)

    def finish(self, trajectory_id: str, now: float) -> None:
        """The trajectory ended: its totals become a finished sample of its group."""
        self.expire(now)
        t = self._take(trajectory_id)
        if t is None:
            return
        t.in_flight = 0
        if not t.counted:
            t.since = now
            self._count(trajectory_id, t)
        self._done[trajectory_id] = t

    def add_sample(self, group_id: str | None, turns: int, tokens: int, now: float,
                   trajectory_id: str | None = None) -> None:
        """Records a finished sample directly (e.g. from an earlier run's records)."""
        if turns < 1 or tokens < 0:
            raise ValueError(f"a sample needs turns >= 1 and tokens >= 0, got {turns}, {tokens}")
        key = trajectory_id if trajectory_id is not None else f"\0sample{next(self._anon)}"
        self._record(key, group_id, Sample(turns, tokens, now))

    # ------------------------------------------------------------------ estimating

    def progress(self, trajectory_id: str) -> Progress | None:
        """The trajectory's progress, if tracked."""
        t = self._find(trajectory_id)
        return None if t is None else Progress(t.group_id, t.turns, t.tokens, t.in_flight)

    def _find(self, trajectory_id: str) -> _Traj | None:
        t = self._active.get(trajectory_id)
        if t is None:
            t = self._idle.get(trajectory_id)
            if t is None:
                t = self._done.get(trajectory_id)
        return t

    def samples(self, group_id: str | None) -> list[Sample]:
        """The group's finished samples (``None``: the fleet-wide ones), oldest first."""
        table = self._global if group_id is None else self._groups.get(group_id)
        return list(table.items.values()) if table else []

    def has_samples(self, group_id: str | None) -> bool:
        """Whether the group (``None``: the fleet) has a finished sample."""
        table = self._global if group_id is None else self._groups.get(group_id)
        return bool(table)

    def expected_remaining(self, group_id: str | None, turns_done: int,
                           tokens_done: int) -> float | None:
        """Expected tokens still to generate by a trajectory of ``group_id`` that has
        done ``turns_done`` turns and ``tokens_done`` tokens (module docstring);
        ``None`` when no finished sample is known."""
        # (``.items`` tested directly: ``len`` of a table is a Python call)
        table = self._groups.get(group_id) if group_id is not None else None
        if table is None or not table.items:
            table = self._global
            if not table.items:
                return None
        return table.remaining(turns_done, tokens_done, self.config.rate_prior_turns)

    def remaining_for(self, trajectory_id: str, group_id: str | None) -> float | None:
        """``expected_remaining`` for a tracked trajectory's own progress (an unknown
        one: nothing done yet)."""
        t = self._find(trajectory_id)
        if t is None:
            return self.expected_remaining(group_id, 0, 0)
        return self.expected_remaining(group_id if group_id is not None else t.group_id,
                                       t.turns, t.tokens)

    def num_tracked(self) -> int:
        return len(self._active) + len(self._idle) + len(self._done)

    # ------------------------------------------------------------------ memory

    def expire(self, now: float) -> None:
        """Counts idle trajectories as finished after ``finish_idle_s`` and forgets
        trajectories not seen for ``trajectory_ttl_s``."""
        cfg = self.config
        idle = self._idle
        while idle:  # (the oldest first; peeking at a value alone is the cheap case)
            t = next(iter(idle.values()))
            if t.since + cfg.finish_idle_s > now:
                break
            tid = next(iter(idle))
            del idle[tid]
            self._count(tid, t)
            self._done[tid] = t
        ttl = cfg.trajectory_ttl_s
        for table in (self._done, self._active):
            while table:
                if next(iter(table.values())).since + ttl >= now:
                    break
                del table[next(iter(table))]

    def _bound(self) -> None:
        cap = self.config.max_trajectories
        if len(self._active) + len(self._idle) + len(self._done) <= cap:
            return
        while self.num_tracked() > cap and self._done:
            self._done.popitem(last=False)
        while self.num_tracked() > cap and self._idle:
            tid, t = self._idle.popitem(last=False)
            self._count(tid, t)  # idle the longest: most likely finished
        while self.num_tracked() > cap and self._active:
            self._active.popitem(last=False)

    # ------------------------------------------------------------------ internals

    def _take(self, trajectory_id: str) -> _Traj | None:
        t = self._active.pop(trajectory_id, None)
        if t is None:
            t = self._idle.pop(trajectory_id, None)
            if t is None:
                t = self._done.pop(trajectory_id, None)
        return t

    def _settle(self, trajectory_id: str, t: _Traj, now: float) -> None:
        """Puts ``t`` back after one of its requests ended."""
        t.in_flight = max(0, t.in_flight - 1)
        t.since = now
        if t.in_flight:
            self._active[trajectory_id] = t
        else:
            self._idle[trajectory_id] = t
        self._bound()

    def _count(self, trajectory_id: str, t: _Traj) -> None:
        t.counted = True
        if t.turns >= 1:
            self._record(trajectory_id, t.group_id, Sample(t.turns, t.tokens, t.since))

    def _uncount(self, trajectory_id: str, t: _Traj) -> None:
        t.counted = False
        if t.group_id is not None:
            group = self._groups.get(t.group_id)
            if group is not None:
                group.pop(trajectory_id)
        self._global.pop(trajectory_id)

    def _record(self, key: str, group_id: str | None, sample: Sample) -> None:
        cfg = self.config
        if group_id is not None:
            group = self._groups.pop(group_id, None)
            if group is None:
                group = _Samples(cfg.half_life_s)
            group.put(key, sample)
            while len(group) > cfg.max_samples_per_group:
                group.pop_oldest()
            self._groups[group_id] = group  # most recently updated last
            while len(self._groups) > cfg.max_groups:
                self._groups.popitem(last=False)
        self._global.put(key, sample)
        while len(self._global) > cfg.max_global_samples:
            self._global.pop_oldest()
