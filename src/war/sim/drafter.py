"""Drafts for simulated sequences, and what the target model accepts of them.

Knows: the ``Drafter`` contract a simulated replica uses, and two drafters. The
``LiveDrafter`` runs the real ``SuffixSpeculator`` (through the engine's own
``TrajectoryDrafts`` bookkeeping, one per replica as in the engine): it proposes
from the trajectory's tokens, its group's and everyone's history, and a draft token
is accepted when it matches the trace's actual next token (the longest matching root
path, as ``war.spec.replay`` verifies), so acceptance is what the speculator achieves
on the workload. The ``CachedDrafter`` reads the drafts and acceptances a replay
recorded at every position (``war.sim.acceptance``), for runs too large for the live
speculator. Does not know models, costs, time or how many draft tokens to verify
(``SpecPolicy`` decides).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Protocol

import numpy as np
import numpy.typing as npt

from war.engine.drafting import TrajectoryDrafts
from war.sim.acceptance import AcceptanceTable, RecordedTurn
from war.sim.sequence import SimSeq
from war.spec.config import SpecConfig
from war.spec.speculator import SuffixSpeculator
from war.spec.tree import BatchDrafts

FloatArray = npt.NDArray[np.float64]


class Drafter(Protocol):
    """Drafting for one replica. ``propose`` then ``verify`` for each of its
    sequences, within one step."""

    def begin(self, seq: SimSeq) -> None:
        """A turn starts on this replica (its context is ``seq.context``)."""
        ...

    def propose(self, seqs: Sequence[SimSeq], rooms: Sequence[int]) -> list[int]:
        """Drafts for the sequences; returns each one's length (at most ``rooms[i]``)."""
        ...

    def probs(self, i: int) -> FloatArray:
        """Sequence ``i``'s draft of the last ``propose``: its path probabilities in
        index order (as many as its length)."""
        ...

    def verify(self, i: int, k: int) -> int:
        """How many draft tokens are accepted when sequence ``i`` of the last
        ``propose`` verifies the first ``k`` (>= 1) of its draft (in index order);
        ``last_path`` then holds their indices."""
        ...

    @property
    def last_path(self) -> Sequence[int]: ...

    def advance(self, seq: SimSeq, start: int, end: int) -> None:
        """``seq.response[start:end]`` was generated."""
        ...

    def end(self, seq: SimSeq) -> None:
        """The turn is complete; its response joins the history."""
        ...

    def share(self, tokens: Sequence[int], group_id: Hashable | None) -> None:
        """A response completed on another replica (shared history)."""
        ...

    def observe_rl_step(self, rl_step: int) -> None: ...


def accepted_path(token_ids: Sequence[int], parents: Sequence[int], target: Sequence[int],
                  start: int) -> list[int]:
    """Indices of the draft nodes the target accepts: the longest root path whose
    tokens equal ``target[start:]`` (at each level the first matching child)."""
    path: list[int] = []
    node, limit = -1, len(target) - start
    for i, (token, parent) in enumerate(zip(token_ids, parents, strict=True)):
        if len(path) == limit:
            break
        if parent == node and token == target[start + len(path)]:
            path.append(i)
            node = i
    return path


class LiveDrafter:
    """The real suffix speculator (module docstring). ``shared``: a speculator that
    other replicas' drafters use too, so that they draw on one history; ``share`` is
    then a no-op. Each drafter keeps its own trajectories (under ids from
    ``first_id`` on), as each engine does, unless ``trajectories``, the map of a
    drafter over the same speculator, is given: then the replicas keep one tree per
    trajectory between them. The drafts are the same either way (a trajectory's
    tree is built from its tokens, in order, whichever replica appends them); one
    map only spares a replica that a trajectory comes back to the catch-up of
    appending every token since its last turn there, host work that a step's cost
    does not include."""

    def __init__(self, config: SpecConfig, max_idle: int = 4096,
                 shared: SuffixSpeculator | None = None, first_id: int = 0,
                 trajectories: TrajectoryDrafts | None = None) -> None:
        if trajectories is not None and trajectories.spec is not shared:
            raise ValueError("trajectories must map onto the shared speculator")
        self.spec = shared if shared is not None else SuffixSpeculator(config)
        self.shares_history = shared is not None
        self.drafts = (trajectories if trajectories is not None
                       else TrajectoryDrafts(self.spec, max_idle, first_id))
        self.max_spec_tokens = config.max_spec_tokens
        self._last: BatchDrafts | None = None
        self._seqs: Sequence[SimSeq] = ()
        self._path: list[int] = []
        self._off: list[int] = []
        self._lens: list[int] = []

    def begin(self, seq: SimSeq) -> None:
        seq.spec_id = self.drafts.begin(seq.context, seq.traj.traj_id, seq.traj.group_id)

    def propose(self, seqs: Sequence[SimSeq], rooms: Sequence[int]) -> list[int]:
        sids = [s.spec_id for s in seqs]
        assert all(s is not None for s in sids), "propose before begin"
        out = self.drafts.propose([int(s) for s in sids if s is not None], self.max_spec_tokens)
        self._last, self._seqs = out, seqs
        off = self._off = out.offsets.tolist()
        self._lens = [max(0, min(off[i + 1] - off[i], rooms[i])) for i in range(len(seqs))]
        return self._lens

    def probs(self, i: int) -> FloatArray:
        assert self._last is not None
        a = self._off[i]
        return self._last.probs[a:a + self._lens[i]].astype(np.float64)

    def verify(self, i: int, k: int) -> int:
        out, seq = self._last, self._seqs[i]
        assert out is not None
        a = int(out.offsets[i])
        self._path = accepted_path(out.token_ids[a:a + k].tolist(),
                                   out.parents[a:a + k].tolist(), seq.response, seq.generated)
        return len(self._path)

    @property
    def last_path(self) -> Sequence[int]:
        return self._path

    def advance(self, seq: SimSeq, start: int, end: int) -> None:
        if end > start and seq.spec_id is not None:
            self.drafts.extend(seq.spec_id, seq.response[start:end])

    def end(self, seq: SimSeq) -> None:
        if seq.spec_id is not None:
            self.drafts.end(seq.spec_id, seq.traj.traj_id, commit=True)
            seq.spec_id = None

    def share(self, tokens: Sequence[int], group_id: Hashable | None) -> None:
        if not self.shares_history:
            self.spec.add_history(list(tokens), group_id)

    def observe_rl_step(self, rl_step: int) -> None:
        if rl_step > self.spec.rl_step:
            self.spec.observe_step(rl_step)


class CachedDrafter:
    """Drafts and acceptances recorded by a replay (``AcceptanceTable``)."""

    def __init__(self, table: AcceptanceTable) -> None:
        self.table = table
        self._seqs: Sequence[SimSeq] = ()
        self._acc: list[int] = []
        self._lens: list[int] = []
        self._n = 0

    def begin(self, seq: SimSeq) -> None:
        seq.spec_id = 0
        seq.draft = self.table.turn(seq.traj.source, seq.turn)

    def propose(self, seqs: Sequence[SimSeq], rooms: Sequence[int]) -> list[int]:
        lens: list[int] = []
        accs: list[int] = []
        for s, room in zip(seqs, rooms, strict=True):
            t: RecordedTurn = s.draft  # type: ignore[assignment]  # set by begin
            p = s.generated
            if p < len(t.accepted):
                n = t.offsets[p + 1] - t.offsets[p]
                lens.append(n if n <= room else max(room, 0))
                accs.append(t.accepted[p])
            else:
                lens.append(0)
                accs.append(0)
        self._seqs, self._lens, self._acc = seqs, lens, accs
        return lens

    def probs(self, i: int) -> FloatArray:
        s = self._seqs[i]
        t: RecordedTurn = s.draft  # type: ignore[assignment]
        if not self._lens[i]:
            return t.probs[:0]
        a = t.offsets[s.generated]
        return t.probs[a:a + self._lens[i]]

    def verify(self, i: int, k: int) -> int:
        self._n = min(self._acc[i], k)  # chains: a prefix
        return self._n

    @property
    def last_path(self) -> Sequence[int]:
        return range(self._n)

    def advance(self, seq: SimSeq, start: int, end: int) -> None:
        pass

    def end(self, seq: SimSeq) -> None:
        seq.spec_id = None
        seq.draft = None

    def share(self, tokens: Sequence[int], group_id: Hashable | None) -> None:
        pass

    def observe_rl_step(self, rl_step: int) -> None:
        pass
