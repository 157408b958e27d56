"""The engine's side of suffix speculation: one draft tree per trajectory.

Knows: which speculator id belongs to which trajectory, the tokens the
speculator holds for it (so a next turn appends only what is new), which
trajectories are idle between turns (kept up to a bound, least recently used
finished first), and shared history from other replicas. Does not know
models, blocks or verification.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from war.spec.speculator import SuffixSpeculator
from war.spec.tree import BatchDrafts


class TrajectoryDrafts:
    """Maps requests onto the speculator's trajectories. Mutates the speculator."""

    def __init__(self, speculator: SuffixSpeculator, max_idle: int, first_id: int = 0) -> None:
        """``first_id``: where this map's speculator ids start (maps that share one
        speculator, as the simulator's replicas do, use disjoint ranges)."""
        self.spec = speculator
        self.max_idle = max_idle
        self._next_id = first_id
        self._tokens: dict[int, list[int]] = {}  # spec id -> tokens the speculator holds
        self._named: dict[str, int] = {}  # trajectory id -> spec id (active or idle)
        self._busy: set[int] = set()  # spec ids with a request in flight
        self._idle: OrderedDict[str, int] = OrderedDict()  # idle trajectories, LRU first
        self._anonymous: set[int] = set()  # spec ids of one-off requests

    def begin(
        self, prompt_ids: Sequence[int], trajectory_id: str | None, group_id: str | None
    ) -> int:
        """Starts (or continues) a trajectory for a new request; returns its spec id."""
        prompt = list(prompt_ids)
        sid = self._named.get(trajectory_id) if trajectory_id is not None else None
        if sid is not None and sid not in self._busy:
            assert trajectory_id is not None
            self._idle.pop(trajectory_id, None)
            held = self._tokens[sid]
            if len(prompt) >= len(held) and prompt[: len(held)] == held:
                self.spec.new_turn(sid, prompt[len(held):])  # only the new tokens
                held.extend(prompt[len(held):])
                self._busy.add(sid)
                return sid
            self.spec.finish(sid, commit=False)  # the context changed: start again
            del self._tokens[sid]
            del self._named[trajectory_id]
        sid = self._new_id()
        self.spec.start(sid, prompt, group_id=group_id)
        self._tokens[sid] = prompt
        self._busy.add(sid)
        if trajectory_id is not None and trajectory_id not in self._named:
            self._named[trajectory_id] = sid
        else:
            self._anonymous.add(sid)  # one-off, or a concurrent request of a busy trajectory
        return sid

    def held_tokens(self, trajectory_id: str) -> list[int] | None:
        """The tokens held for an idle trajectory (its last prompt and output), or None."""
        sid = self._idle.get(trajectory_id)
        return None if sid is None else self._tokens[sid]

    def extend(self, sid: int, token_ids: Sequence[int]) -> None:
        self.spec.extend(sid, token_ids)
        self._tokens[sid].extend(token_ids)

    def end(self, sid: int, trajectory_id: str | None, commit: bool = True) -> None:
        """The request finished: its response enters the history (``commit``); a
        named trajectory stays for its next turn."""
        self._busy.discard(sid)
        if sid in self._anonymous or trajectory_id is None or not commit:
            self.spec.finish(sid, commit=commit)
            del self._tokens[sid]
            self._anonymous.discard(sid)
            if trajectory_id is not None and self._named.get(trajectory_id) == sid:
                del self._named[trajectory_id]
            return
        self.spec.end_response(sid)  # into the history now; the next turn appends
        self._idle[trajectory_id] = sid
        while len(self._idle) > self.max_idle:
            old_traj, old_sid = self._idle.popitem(last=False)
            self.spec.finish(old_sid, commit=False)  # already committed
            del self._tokens[old_sid]
            del self._named[old_traj]

    def propose(self, sids: Sequence[int], budget: int) -> BatchDrafts:
        return self.spec.propose_arrays(sids, budget)

    def _new_id(self) -> int:
        self._next_id += 1
        return self._next_id

    @property
    def num_idle(self) -> int:
        return len(self._idle)
