"""Per-position drafts and acceptances of a workload's token streams, from a replay.

Knows: an ``AcceptanceTable``: for every trajectory turn and every position of its
response, the path probabilities of the chain draft the real ``SuffixSpeculator``
proposed there (full budget) and how many of its tokens the trace's actual
continuation accepts; and how to record one (``record_acceptance``) by replaying the
workload's distinct token streams round by round (round ``r``: the streams first
used in RL step ``r``, in lockstep, one token at a time, so that every position is
drafted once; earlier rounds are history, as earlier RL steps would be). Does not
know replicas or time.

Used when the live speculator is too slow (cluster scale): a sequence at position
``p`` that verifies ``k`` draft tokens accepts ``min(accepted[p], k)``. Approximation:
the history a draft sees is the replay's (earlier rounds and the round's finished
turns), not the simulated run's; chains only (``SpecConfig.tree`` must be False).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from war.spec.config import SpecConfig
from war.spec.replay import accepted_len
from war.spec.speculator import SuffixSpeculator
from war.spec.traces import Trajectory

if TYPE_CHECKING:
    from war.sim.workload import SimTrajectory

FloatArray = npt.NDArray[np.float64]


def source_key(traj: Trajectory) -> str:
    """The name of a trace trajectory's token stream (``SimTrajectory.source``)."""
    return f"{traj.file}:{traj.task_id}:{traj.trial}:{traj.source}"


@dataclass
class RecordedTurn:
    """One turn's recorded drafts: at position ``p`` the draft's path probabilities
    are ``probs[offsets[p]:offsets[p + 1]]`` and ``accepted[p]`` of them are accepted."""

    accepted: list[int]  # (positions,)
    offsets: list[int]  # (positions + 1,) into probs
    probs: FloatArray


class AcceptanceTable:
    """Recorded drafts by (source, turn, position)."""

    def __init__(self) -> None:
        self._turns: dict[str, list[RecordedTurn]] = {}
        self.positions = 0
        self.accepted = 0
        self.drafted = 0

    def reserve(self, source: str) -> None:
        """Marks ``source`` as being recorded (``add`` fills it in)."""
        self._turns.setdefault(source, [])

    def add(self, source: str, turns: list[RecordedTurn]) -> None:
        self._turns[source] = turns
        for t in turns:
            self.positions += len(t.accepted)
            self.accepted += sum(t.accepted)
            self.drafted += len(t.probs)

    def __contains__(self, source: object) -> bool:
        return source in self._turns

    def turn(self, source: str, turn: int) -> RecordedTurn:
        return self._turns[source][turn]

    def at(self, source: str, turn: int, pos: int) -> tuple[FloatArray, int]:
        """The draft's path probabilities and its accepted length at ``pos``."""
        t = self._turns[source][turn]
        if pos >= len(t.accepted):
            return t.probs[:0], 0
        return t.probs[t.offsets[pos]:t.offsets[pos + 1]], t.accepted[pos]

    def summary(self) -> dict[str, float]:
        return {"positions": self.positions, "drafted": self.drafted,
                "accepted": self.accepted,
                "acceptance_rate": self.accepted / self.drafted if self.drafted else 0.0}


class _Cursor:
    def __init__(self, sid: int, traj: SimTrajectory) -> None:
        self.sid, self.traj, self.turn, self.pos = sid, traj, 0, 0
        self.response = traj.turns[0].response
        self.acc: list[int] = []
        self.lens: list[int] = []
        self.probs: list[FloatArray] = []
        self.done: list[RecordedTurn] = []

    def close_turn(self) -> None:
        off = np.zeros(len(self.lens) + 1, dtype=np.int64)
        np.cumsum(self.lens, out=off[1:])
        probs = np.concatenate(self.probs) if self.probs else np.zeros(0)
        self.done.append(RecordedTurn(self.acc, off.tolist(), probs.astype(np.float64)))
        self.acc, self.lens, self.probs = [], [], []


def record_acceptance(trajectories: Sequence[SimTrajectory], config: SpecConfig,
                      table: AcceptanceTable | None = None) -> AcceptanceTable:
    """Replays the distinct token streams of ``trajectories`` (the first trajectory of
    each ``source``; module docstring) and records every position. A trajectory's
    round is its RL step; its group is its ``group_id`` less any ``#copy`` suffix.
    Streams already in ``table`` are not recorded again, so ``table`` must hold this
    workload's recording: a stream's drafts depend on the replay's history (the
    workload's earlier rounds and the round's other streams), and one recorded with
    another workload would be replayed as that one saw it."""
    if config.tree:
        raise ValueError("the acceptance table records chain drafts (SpecConfig.tree=False)")
    table = table if table is not None else AcceptanceTable()
    spec = SuffixSpeculator(config)
    rounds: dict[int, list[SimTrajectory]] = {}
    for t in trajectories:
        if t.turns and t.source not in table:
            table.reserve(t.source)
            rounds.setdefault(t.rl_step, []).append(t)
    sid = 0
    for r in sorted(rounds):
        spec.observe_step(max(r, spec.rl_step))
        live = []
        for t in rounds[r]:
            sid += 1
            spec.start(sid, t.turns[0].prompt, group_id=t.group_id.split("#")[0])
            live.append(_Cursor(sid, t))
        while live:
            out = spec.propose_arrays([c.sid for c in live], config.max_spec_tokens)
            off = out.offsets.tolist()
            tokens, parents, probs = out.token_ids, out.parents, out.probs
            still = []
            for i, c in enumerate(live):
                a, b = off[i], off[i + 1]
                c.acc.append(accepted_len(tokens[a:b].tolist(), parents[a:b].tolist(),
                                          c.response, c.pos))
                c.lens.append(b - a)
                c.probs.append(probs[a:b])
                spec.extend(c.sid, c.response[c.pos:c.pos + 1])
                c.pos += 1
                if c.pos == len(c.response):
                    c.close_turn()
                    c.turn += 1
                    if c.turn == len(c.traj.turns):
                        spec.finish(c.sid)
                        table.add(c.traj.source, c.done)
                        continue
                    nxt = c.traj.turns[c.turn]
                    spec.new_turn(c.sid, nxt.prompt)
                    c.response, c.pos = nxt.response, 0
                still.append(c)
            live = still
    return table
