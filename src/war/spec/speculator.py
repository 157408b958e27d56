"""The suffix speculator: SuffixDecoding over trajectories and a grouped history.

Knows: in-flight trajectories (one growing suffix tree each, across all their
turns), the history of completed responses with their groups and RL steps, the
memory bounds of that history, and how to ask the native trees for drafts in one
batched call. Does not know: models, logits, verification or load (the engine
decides each sequence's draft budget), nor HTTP.

Sources, in order of preference (docs/suffix-speculation.md, section 4; with
``SpecConfig.combine == "merge"`` their drafts are merged instead, section 6):

* ``group``: completed responses of the trajectory's group (its siblings in this
  RL step and the same task in earlier steps);
* ``local``: the trajectory itself (prompt, tool outputs, earlier responses);
* ``global``: completed responses of every group.

Not thread-safe: one engine loop owns a speculator.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from war.spec.config import SpecConfig
from war.spec.tree import (
    BatchDrafts,
    DraftParams,
    MergeParams,
    SuffixTree,
    TokensLike,
    alpha_table,
    append_native,
    as_id,
    as_tokens,
    draft_params,
    drafts_of,
    propose_batch,
)
from war.types import Draft

_LOCAL_ID = 0  # the one sequence id inside a trajectory's own tree


@dataclass
class _Trajectory:
    tree: SuffixTree
    group: Hashable | None
    response_start: int  # where the current response begins in the trajectory


@dataclass(frozen=True)
class _Entry:
    group: Hashable | None
    rl_step: int
    num_tokens: int


class SuffixSpeculator:
    """Proposes drafts for in-flight trajectories from suffix trees.

    Lifecycle of a trajectory: ``start`` (first prompt) -> ``extend`` (tokens
    the model generated) -> ``end_response`` (the response is complete: it enters
    the history) -> ``new_turn`` (tool output and the next chat header appended)
    -> ... -> ``finish``. Completed responses enter the history of the
    trajectory's group and of everyone; ``new_turn`` and ``finish`` commit a
    response that ``end_response`` was not called for.
    """

    def __init__(self, config: SpecConfig | None = None) -> None:
        self.config = config if config is not None else SpecConfig()
        c = self.config
        self._params: DraftParams = draft_params(
            c.max_spec_tokens, c.factor, c.offset, c.min_prob, c.tree, c.alpha_table(),
            c.max_depth,
        )
        self._local_alpha = alpha_table(c.alpha_table(c.local_alpha), c.max_depth)
        self._global_alpha = alpha_table(c.alpha_table(c.global_alpha), c.max_depth)
        self._merge = (
            MergeParams(c.merge_threshold, c.merge_min_prob) if c.combine == "merge" else None
        )
        self._trajs: dict[int, _Trajectory] = {}
        self._groups: dict[Hashable, SuffixTree] = {}
        self._global = SuffixTree(c.max_depth)
        self._empty = SuffixTree(c.max_depth)
        self._entries: OrderedDict[int, _Entry] = OrderedDict()
        self._next_entry = 0
        self._history_tokens = 0
        self._rl_step = 0

    # ------------------------------------------------------------ trajectories

    def start(self, seq_id: int, prompt_ids: TokensLike, group_id: Hashable | None = None) -> None:
        """Starts a trajectory with its first prompt. Mutates."""
        sid = as_id(seq_id)
        if sid in self._trajs:
            raise ValueError(f"sequence {sid} already started")
        _check_group(group_id)
        tokens = as_tokens(prompt_ids, "prompt ids")
        tree = SuffixTree(self.config.max_depth)
        tree.append(_LOCAL_ID, tokens)
        self._trajs[sid] = _Trajectory(tree, group_id, int(tokens.size))

    def extend(self, seq_id: int, token_ids: TokensLike) -> None:
        """Appends tokens the model generated for the current response. Mutates."""
        append_native(self._traj(seq_id).tree.native, _LOCAL_ID, token_ids)

    def end_response(self, seq_id: int) -> None:
        """The current response is complete: it enters the history now, so that
        other trajectories draft from it while this one waits for its tool call.
        Calling it again before more tokens are generated adds nothing. Mutates.
        """
        self._commit(self._traj(seq_id))

    def new_turn(self, seq_id: int, new_prompt_ids: TokensLike) -> None:
        """Appends the next turn's new prompt tokens (ending the current response
        first, as ``end_response`` does, if that was not called).

        Only the new tokens (tool output, user message, chat template) are sent:
        the trajectory's tree already holds everything before them. Mutates.
        """
        traj = self._traj(seq_id)
        tokens = as_tokens(new_prompt_ids, "prompt ids")
        self._commit(traj)
        traj.tree.native.append(_LOCAL_ID, tokens)
        traj.response_start = traj.tree.num_tokens

    def finish(self, seq_id: int, commit: bool = True) -> None:
        """Ends a trajectory; its last response enters the history if ``commit``. Mutates."""
        traj = self._traj(seq_id)
        if not isinstance(commit, (bool, np.bool_)):  # ("no" would commit)
            raise ValueError(f"commit must be a bool, got {commit!r}")
        if commit:
            self._commit(traj)
        del self._trajs[int(seq_id)]

    def __contains__(self, seq_id: object) -> bool:
        if type(seq_id) is not int:
            # (True and 1.0 hash as 1; an unhashable key would raise TypeError)
            if not isinstance(seq_id, (int, np.integer)) or isinstance(seq_id, (bool, np.bool_)):
                return False
            seq_id = int(seq_id)
        return seq_id in self._trajs

    @property
    def num_active(self) -> int:
        return len(self._trajs)

    def context_len(self, seq_id: int) -> int:
        return self._traj(seq_id).tree.seq_len(_LOCAL_ID)

    # ------------------------------------------------------------ history

    def add_history(
        self, token_ids: TokensLike, group_id: Hashable | None = None, rl_step: int | None = None
    ) -> None:
        """Adds a completed response (with any lead-in context) produced elsewhere,
        e.g. on another replica. Mutates."""
        _check_group(group_id)
        tokens = as_tokens(token_ids)
        step = self._rl_step if rl_step is None else as_id(rl_step, "rl_step")
        if step < 0:  # (observe_step never goes below 0)
            raise ValueError(f"rl_step must be >= 0, got {step}")
        window = self.config.history_window_steps
        if tokens.size == 0 or (window is not None and step <= self._rl_step - window):
            return  # nothing to add, or already outside the window
        src = SuffixTree(1)
        src.append(0, tokens)
        self._insert(src, 0, 0, int(tokens.size), group_id, step)

    def observe_step(self, rl_step: int) -> None:
        """Moves to RL step ``rl_step``; history older than the window is evicted. Mutates."""
        step = as_id(rl_step, "rl_step")
        if step < self._rl_step:
            raise ValueError(f"rl_step went backwards: {step} < {self._rl_step}")
        self._rl_step = step
        window = self.config.history_window_steps
        if window is not None:
            stale = [e for e, v in self._entries.items() if v.rl_step <= step - window]
            for entry_id in stale:
                self._evict(entry_id)

    @property
    def rl_step(self) -> int:
        return self._rl_step

    @property
    def history_tokens(self) -> int:
        """Tokens held by the history (each entry once)."""
        return self._history_tokens

    @property
    def num_history_entries(self) -> int:
        return len(self._entries)

    def _commit(self, traj: _Trajectory) -> None:
        end = traj.tree.num_tokens
        if end == traj.response_start:
            return
        start = max(0, traj.response_start - self.config.lead_in)
        self._insert(traj.tree, _LOCAL_ID, start, end, traj.group, self._rl_step)
        traj.response_start = end

    def _insert(
        self, src: SuffixTree, src_id: int, start: int, end: int, group: Hashable | None,
        rl_step: int,
    ) -> None:
        if group is None and not self.config.use_global:
            return  # no tree would hold it: counted, it would evict entries that are held
        budget = self.config.history_token_budget
        if budget is not None and end - start > budget:
            return  # it could never be held: inserted, it would evict the whole history
        entry_id = self._next_entry
        self._next_entry += 1
        if group is not None:
            tree = self._groups.get(group)
            if tree is None:
                tree = self._groups[group] = SuffixTree(self.config.max_depth)
            tree.append_from(entry_id, src, src_id, start, end)
            tree.seal(entry_id)
        if self.config.use_global:
            self._global.append_from(entry_id, src, src_id, start, end)
            self._global.seal(entry_id)
        self._entries[entry_id] = _Entry(group, rl_step, end - start)
        self._history_tokens += end - start
        if budget is not None:
            while self._history_tokens > budget and self._entries:
                self._evict(next(iter(self._entries)))

    def _evict(self, entry_id: int) -> None:
        entry = self._entries.pop(entry_id)
        self._history_tokens -= entry.num_tokens
        if entry.group is not None:
            tree = self._groups[entry.group]
            tree.remove(entry_id)
            if tree.num_seqs == 0:
                del self._groups[entry.group]
        if self.config.use_global:
            self._global.remove(entry_id)

    # ------------------------------------------------------------ drafting

    def propose(
        self, seq_ids: Sequence[int], budgets: Sequence[int] | int | None = None
    ) -> list[Draft]:
        """Drafts for each sequence (one native call for the batch). Reads only.

        ``budgets``: most draft tokens per sequence (an int for all, or one per
        sequence); ``None`` means ``config.max_spec_tokens``. A budget of 0 gives
        the empty draft.
        """
        return drafts_of(self.propose_arrays(seq_ids, budgets))

    def propose_arrays(
        self, seq_ids: Sequence[int], budgets: Sequence[int] | int | None = None
    ) -> BatchDrafts:
        """Like ``propose``, as concatenated arrays (for engines). Reads only."""
        try:
            trajs = [self._traj(s) for s in seq_ids]
        except TypeError:  # (_traj raises only ValueError)
            raise ValueError(
                f"seq_ids must be a sequence of ints, got {type(seq_ids).__name__}"
            ) from None
        if len({id(t) for t in trajs}) != len(trajs):
            # (from the trajectories: seq_ids may be an iterator, already consumed)
            seen: set[int] = set()
            for t in trajs:
                if id(t) in seen:
                    sid = next(k for k, v in self._trajs.items() if v is t)
                    raise ValueError(f"sequence {sid} appears twice in one batch")
                seen.add(id(t))
        budget_arr = self._budgets(budgets, len(trajs))
        groups = [
            self._groups.get(t.group, self._empty) if t.group is not None else self._empty
            for t in trajs
        ]
        return propose_batch(
            [t.tree for t in trajs],
            [_LOCAL_ID] * len(trajs),
            groups,
            self._global if self.config.use_global else None,
            budget_arr,
            self._params,
            self._local_alpha,
            self._global_alpha,
            self.config.group_weight,
            self._merge,
        )

    def _budgets(self, budgets: Sequence[int] | int | None, n: int) -> np.ndarray:
        cap = self.config.max_spec_tokens
        if budgets is None:
            return np.full(n, cap, dtype=np.int32)
        if isinstance(budgets, (int, np.integer)) and not isinstance(budgets, bool):
            values = [int(budgets)] * n
        else:
            if isinstance(budgets, (str, bytes, bool)) or not isinstance(budgets, Iterable) or (
                isinstance(budgets, np.ndarray) and budgets.ndim != 1
            ):
                raise ValueError(f"budgets must be an int or a sequence of ints, got {budgets!r}")
            values = []
            for b in budgets:
                if not isinstance(b, (int, np.integer)) or isinstance(b, (bool, np.bool_)):
                    raise ValueError(f"budgets must be ints, got {b!r}")
                values.append(int(b))
            if len(values) != n:
                raise ValueError(f"got {len(values)} budgets for {n} sequences")
        for v in values:
            if v < 0:
                raise ValueError(f"budget must be >= 0, got {v}")
        # (capped as Python ints: a budget beyond int64 is just "no limit but the cap")
        return np.asarray([min(v, cap) for v in values], dtype=np.int32)

    # ------------------------------------------------------------ accounting

    def memory_bytes(self) -> int:
        """Bytes held by every tree (trajectories, groups, global)."""
        total = self._global.memory_bytes() + self._empty.memory_bytes()
        total += sum(t.tree.memory_bytes() for t in self._trajs.values())
        total += sum(g.memory_bytes() for g in self._groups.values())
        return total

    @property
    def num_cached_tokens(self) -> int:
        """Tokens cached: in-flight trajectories plus history entries (each once)."""
        return self._history_tokens + sum(t.tree.num_tokens for t in self._trajs.values())

    def check_integrity(self) -> None:
        """Checks every tree and the history's bookkeeping. Slow; for tests."""
        for t in self._trajs.values():
            t.tree.check_integrity()
        for g in self._groups.values():
            g.check_integrity()
        self._global.check_integrity()
        total = sum(e.num_tokens for e in self._entries.values())
        if total != self._history_tokens:
            raise RuntimeError(f"history tokens {self._history_tokens} != entries' {total}")
        if self.config.use_global and self._global.num_seqs != len(self._entries):
            raise RuntimeError("global history out of step with the entry list")
        per_group: dict[Hashable, int] = {}
        for e in self._entries.values():
            if e.group is not None:
                per_group[e.group] = per_group.get(e.group, 0) + 1
        if {g: t.num_seqs for g, t in self._groups.items()} != per_group:
            raise RuntimeError("group histories out of step with the entry list")

    def _traj(self, seq_id: object) -> _Trajectory:
        traj = self._trajs.get(seq_id) if type(seq_id) is int else None
        if traj is None:
            sid = as_id(seq_id)
            traj = self._trajs.get(sid)
            if traj is None:
                raise ValueError(f"unknown sequence id {sid}")
        return traj


def _check_group(group_id: object) -> None:
    if group_id is None:
        return
    try:
        hash(group_id)
    except TypeError:
        raise ValueError(f"group id must be hashable, got {type(group_id).__name__}") from None
    if _holds_nan(group_id):
        # NaN is not equal to itself: each NaN object would be a group of its own, and a
        # sample of the same task would silently draft without its siblings' history
        raise ValueError(f"group id must not be or hold NaN, got {group_id!r}")


def _holds_nan(value: object) -> bool:
    if isinstance(value, float | complex):
        return value != value
    if isinstance(value, tuple | frozenset):
        return any(_holds_nan(v) for v in value)
    return False
