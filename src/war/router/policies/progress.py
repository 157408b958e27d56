"""Trajectory progress: how much work a trajectory probably has left.

Knows: each tracked trajectory's progress (turns and generated tokens seen through
the router), which trajectories have finished, and per group (GRPO samples of one
task; WAR's rollout uses the task id, so a group recurs in later RL steps) the
totals of its finished samples, weighted down exponentially with age so earlier
steps count less than the current one. Does not know token
contents, replicas, the clock (every time is ``now``), nor the end of an episode
for certain: a trajectory counts as finished when ``finish`` is called, or when it
has been idle (no request in flight) for ``finish_idle_s``; if it comes back it is
taken out of its group's finished samples again.

The estimate (``expected_remaining``), for a trajectory that has done ``k`` turns
and generated ``d`` tokens, from finished samples ``i`` with ``K_i`` turns, ``T_i``
generated tokens, finished at ``t_i``, weight ``w_i = 0.5 ** ((t_newest - t_i) /
half_life_s)`` (an age-based weight at any later ``now`` differs by a common factor,
which cancels in the ratios below, so the estimate needs no clock)::

    remaining_turns = sum_{K_i > k} w_i (K_i - k) / sum_{K_i > k} w_i
                      (1 when no sample ran more than k turns: the turn being sent)
    sample_rate     = sum_i w_i T_i / sum_i w_i K_i           tokens per turn
    rate            = (d + c * sample_rate) / (k + c)         c = rate_prior_turns
    remaining       = remaining_turns * rate                  tokens

``remaining_turns`` is the mean residual number of turns of the samples that got
at least as far; ``rate`` shrinks the trajectory's own tokens-per-turn towards its
siblings', by ``c`` pseudo-turns. The samples are the group's when it has any, else
every group's (the fleet prior); with none at all the estimate is ``None`` (the
caller keeps its own default).

``ProgressEstimator`` is C++ (csrc/progress.cc, bound as ``_progress``; this is the
only module that imports it), a thin subclass here adding the default config. Its
specification is the pure-Python ``progress_reference.ReferenceProgressEstimator``,
which it matches bit for bit, call by call (the same floating-point operations in
the same order, the same orders of every table), so the war policy and the
simulator decide as they did with the Python estimator. The estimate keeps weighted
sums as samples come and go, so it costs a pass over the distinct turn counts (and
is cached per turn count until the next change); ``begin`` and ``observe`` take
0.3-0.5 us each (the reference: 4-8 us). Inputs: ids are ``str`` (else TypeError),
group ids ``str`` or ``None``; turn and token counts are ints within int64 (the
reference's are unbounded: a total past 2**63 - 1 raises OverflowError); times are
numbers, read as floats. A call that raises leaves the estimator unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from war.router.policies._progress import ProgressEstimator as _NativeEstimator


@dataclass(frozen=True)
class ProgressConfig:
    """Settings of ``ProgressEstimator``; validated on construction.

    * ``finish_idle_s``: a trajectory with no request in flight for this long counts
      as finished (agent loops call tools between turns; set it above the slowest
      tool call you expect).
    * ``trajectory_ttl_s``: a trajectory not seen for this long is forgotten (its
      finished sample stays); at least ``finish_idle_s``.
    * ``max_trajectories``: trajectories tracked at most (finished ones are forgotten
      first, then idle ones, then the least recently active).
    * ``half_life_s``: age at which a finished sample weighs half (earlier RL steps
      of the same group fade out).
    * ``max_samples_per_group``: finished samples kept per group (newest kept).
    * ``max_groups``: groups kept (least recently updated dropped).
    * ``max_global_samples``: finished samples kept for the fleet-wide prior.
    * ``rate_prior_turns``: pseudo-turns of the siblings' tokens per turn mixed into
      a trajectory's own rate (``c`` in the module docstring).
    """

    finish_idle_s: float = 60.0
    trajectory_ttl_s: float = 1800.0
    max_trajectories: int = 100_000
    half_life_s: float = 1800.0
    max_samples_per_group: int = 64
    max_groups: int = 10_000
    max_global_samples: int = 1024
    rate_prior_turns: float = 2.0

    def __post_init__(self) -> None:
        if not self.finish_idle_s > 0:
            raise ValueError(f"finish_idle_s must be > 0, got {self.finish_idle_s}")
        if not self.trajectory_ttl_s >= self.finish_idle_s:
            raise ValueError(f"trajectory_ttl_s ({self.trajectory_ttl_s}) must be >= "
                             f"finish_idle_s ({self.finish_idle_s})")
        if not self.half_life_s > 0:
            raise ValueError(f"half_life_s must be > 0, got {self.half_life_s}")
        for name in ("max_trajectories", "max_samples_per_group", "max_groups",
                     "max_global_samples"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.rate_prior_turns >= 0:
            raise ValueError(f"rate_prior_turns must be >= 0, got {self.rate_prior_turns}")


class Sample(NamedTuple):
    """A finished trajectory: its turns, generated tokens and end time."""

    turns: int
    tokens: int
    end: float


class Progress(NamedTuple):
    """What a trajectory has done so far."""

    group_id: str | None
    turns: int
    tokens: int
    in_flight: int


class ProgressEstimator(_NativeEstimator):
    """Tracks trajectories' progress and groups' finished samples; estimates the
    remaining work of a trajectory. Every call may expire old state at ``now``.

    Methods (all native; the reference documents each): ``begin(trajectory_id,
    group_id, now)`` returns ``remaining_for`` as it stood just before the call;
    ``observe(trajectory_id, group_id, generated_tokens, now)`` returns it after the
    call; ``abort``, ``finish``, ``add_sample(group_id, turns, tokens, now,
    trajectory_id=None)``, ``progress``, ``samples``, ``has_samples``,
    ``expected_remaining(group_id, turns_done, tokens_done)``, ``remaining_for``,
    ``num_tracked``, ``expire(now)``; ``config`` is the ``ProgressConfig``."""

    def __init__(self, config: ProgressConfig | None = None) -> None:
        super().__init__(config if config is not None else ProgressConfig(), Sample, Progress)

    @property
    def _groups(self) -> dict[str, list[Sample]]:
        """Group id -> its samples, least recently updated first (for tests)."""
        return {group: self.samples(group) for group in self.group_ids()}
