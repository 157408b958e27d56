"""Configuration of the suffix speculator.

Knows: the knobs of drafting and of the history's memory bounds, and which
values are valid. Does not know how they are used (see ``speculator.py`` and
docs/suffix-speculation.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import numpy as np

COMBINES = ("best", "merge")
"""Values of ``SpecConfig.combine``."""

MAX_DEPTH = 4096
"""The deepest tree the native core builds (``war.spec.tree.SuffixTree``)."""


@dataclass(frozen=True)
class SpecConfig:
    """Suffix speculation settings; validated on construction.

    The defaults are tuned for chain drafts on real agent traces (customer service
    and coding agents; see ``benchmarks/spec``); ``SpecConfig.tree_preset()`` is the
    tuned tree setting.

    * ``max_depth``: longest substring the trees count (and longest match).
    * ``max_spec_tokens``: most draft tokens per sequence and step; a caller's
      budget can only lower it.
    * ``factor``, ``offset``: a match of ``k`` tokens may draft at most
      ``floor(factor * k + offset)`` tokens (adaptive length).
    * ``min_prob``: a draft token whose estimated probability falls below this
      is not proposed (``combine="best"`` only).
    * ``tree``: propose token trees (best-first by probability) instead of chains.
    * ``combine``: how the sources' drafts combine: ``"best"`` keeps the single
      source with the highest (weighted) score (section 4 of
      docs/suffix-speculation.md); ``"merge"`` merges every source's tree draft by
      token path, a path's value being the noisy-or of the sources' probabilities
      for it (section 6). ``"merge"`` proposes more accepted tokens per step at
      about the same draft length (``benchmarks/spec``: +1-3% tokens/step on both
      trace files and orders, chains and trees) but drafts every source in full,
      1.1-1.6x the batched proposal time of ``"best"``, so it is not the default.
    * ``merge_threshold``: with ``"merge"``, the merged value a draft token needs
      (tuned: 0.36 for chains, 0.38 in ``tree_preset``).
    * ``merge_min_prob``: with ``"merge"``, the ``min_prob`` of each source's tree
      draft before merging.
    * ``alpha``, ``alpha_decay``: smoothing of the probability estimate
      ``count(child) / (continuations(node) + alpha * alpha_decay**depth)`` for
      drafts from the group's history; a larger value distrusts rarely-seen
      continuations, and the decay trusts them more the longer the context they
      follow (the trie depth).
    * ``local_alpha``, ``global_alpha``: the same for drafts from the trajectory
      itself and from everyone's history, which predict less reliably than the
      group's own history.
    * ``group_weight``: multiplier on the score of drafts from the trajectory's
      own group's history; ``> 1`` prefers the group, ``0`` ignores groups.
    * ``use_global``: also draft from the history of all groups.
    * ``lead_in``: context tokens stored before each history response so that
      matches can start at a response's first token.
    * ``history_window_steps``: keep history from this many most recent RL steps
      (``None``: unbounded).
    * ``history_token_budget``: most tokens the history holds; the oldest entries
      are evicted first, and an entry larger than the budget is not added
      (``None``: unbounded).
    """

    max_depth: int = 64
    max_spec_tokens: int = 32
    factor: float = 2.0
    offset: float = 0.0
    min_prob: float = 0.35
    tree: bool = False
    combine: str = "best"
    merge_threshold: float = 0.36
    merge_min_prob: float = 0.05
    alpha: float = 0.8
    alpha_decay: float = 0.85
    local_alpha: float = 2.0
    global_alpha: float = 1.5
    group_weight: float = 1.0
    use_global: bool = True
    lead_in: int = 8
    history_window_steps: int | None = None
    history_token_budget: int | None = None

    def __post_init__(self) -> None:
        # NumPy scalars are accepted and stored as Python values, so that configs
        # compare, hash and serialise alike whatever built them.
        _normalize(self)
        _check_int("max_depth", self.max_depth, 1)
        if self.max_depth > MAX_DEPTH:  # (before any per-depth table is built)
            raise ValueError(f"max_depth must be <= {MAX_DEPTH} (the native trees' limit), "
                             f"got {self.max_depth}")
        _check_int("max_spec_tokens", self.max_spec_tokens, 0)
        _check_int("lead_in", self.lead_in, 0)
        _check_float("factor", self.factor, 0.0)
        _check_float("offset", self.offset, None)
        _check_float("min_prob", self.min_prob, 0.0, 1.0)
        _check_float("alpha", self.alpha, 0.0)
        _check_float("alpha_decay", self.alpha_decay, 0.0, 1.0)
        _check_float("local_alpha", self.local_alpha, 0.0)
        _check_float("global_alpha", self.global_alpha, 0.0)
        _check_float("group_weight", self.group_weight, 0.0)
        if not isinstance(self.combine, str) or self.combine not in COMBINES:
            raise ValueError(f"combine must be one of {COMBINES}, got {self.combine!r}")
        _check_float("merge_threshold", self.merge_threshold, 0.0, 1.0)
        _check_float("merge_min_prob", self.merge_min_prob, 0.0, 1.0)
        if not isinstance(self.tree, bool):
            raise ValueError(f"tree must be a bool, got {self.tree!r}")
        if not isinstance(self.use_global, bool):
            raise ValueError(f"use_global must be a bool, got {self.use_global!r}")
        if self.history_window_steps is not None:
            _check_int("history_window_steps", self.history_window_steps, 1)
        if self.history_token_budget is not None:
            _check_int("history_token_budget", self.history_token_budget, 0)

    @classmethod
    def tree_preset(cls, **overrides: object) -> SpecConfig:
        """Tuned settings for token-tree drafts (a tree verifies more tokens per
        step, so it drafts further and trusts rare continuations more)."""
        values: dict[str, object] = dict(
            tree=True, factor=2.0, max_spec_tokens=32, min_prob=0.1, alpha=0.3,
            alpha_decay=0.8, local_alpha=1.0, global_alpha=0.5, merge_threshold=0.38,
        )
        values.update(overrides)
        return cls(**values)  # type: ignore[arg-type]

    @classmethod
    def for_mode(cls, mode: str, **overrides: object) -> SpecConfig:
        """The tuned configuration of ``mode``: ``"path"`` (chains) or ``"tree"``."""
        if mode == "path":
            return cls(**overrides)  # type: ignore[arg-type]
        if mode == "tree":
            return cls.tree_preset(**overrides)
        raise ValueError(f"unknown mode {mode!r} (expected 'path' or 'tree')")

    @classmethod
    def baseline(cls, mode: str, **overrides: object) -> SpecConfig:
        """SuffixDecoding as published, for side-by-side comparisons: no groups, no
        smoothing, history of bare responses, factor 1 (chains) or 2 (trees), minimum
        token probability 0.1, drafts up to the tree depth, the best single source."""
        if mode not in ("path", "tree"):
            raise ValueError(f"unknown mode {mode!r} (expected 'path' or 'tree')")
        values: dict[str, object] = dict(
            tree=mode == "tree", factor=1.0 if mode == "path" else 2.0, min_prob=0.1,
            max_spec_tokens=64, alpha=0.0, alpha_decay=1.0, local_alpha=0.0,
            global_alpha=0.0, group_weight=0.0, lead_in=0, combine="best",
        )
        values.update(overrides)
        return cls(**values)  # type: ignore[arg-type]

    def alpha_table(self, alpha: float | None = None) -> tuple[float, ...]:
        """Smoothing per trie depth ``0..max_depth``: ``alpha * alpha_decay**depth``
        (``alpha`` defaults to the group's)."""
        a = self.alpha if alpha is None else alpha
        return tuple(a * self.alpha_decay**d for d in range(self.max_depth + 1))


def _normalize(config: SpecConfig) -> None:
    for f in fields(config):
        value = getattr(config, f.name)
        if isinstance(value, np.bool_):
            value = bool(value)
        elif isinstance(value, np.integer):
            value = int(value)
        elif isinstance(value, np.floating):
            value = float(value)
        elif isinstance(value, np.str_):
            value = str(value)
        else:
            continue
        object.__setattr__(config, f.name, value)  # (frozen)


def _check_int(name: str, value: object, low: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name} must be an int, got {value!r}")
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
    if value > 2**31 - 1:
        raise ValueError(f"{name} must fit in int32, got {value}")


def _check_float(name: str, value: object, low: float | None, high: float | None = None) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if isinstance(value, int) and abs(value) > 2**1023:  # (float() would overflow)
        raise ValueError(f"{name} must be finite, got {value!r}")
    v = float(value)
    if not math.isfinite(v):
        raise ValueError(f"{name} must be finite, got {value!r}")
    if low is not None and v < low:
        raise ValueError(f"{name} must be >= {low}, got {value!r}")
    if high is not None and v > high:
        raise ValueError(f"{name} must be <= {high}, got {value!r}")
