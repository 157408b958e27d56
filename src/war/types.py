"""Wire types shared by every part of WAR.

Knows: the shape of the values that cross package boundaries. Does not know how
any of them is produced or consumed; it imports nothing from ``war``.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Draft:
    """A draft token tree proposed for one sequence.

    ``token_ids[i]`` follows ``token_ids[parents[i]]`` (``-1``: it follows the
    sequence's last token); ``parents[i] < i``. A chain has ``parents == (-1, 0, 1,
    ...)``. ``probs[i]`` is the estimated probability that the path to token ``i``
    is accepted; ``score`` (their sum) is the expected number of accepted tokens.
    ``source`` names where the draft came from (``"group"``, ``"local"``,
    ``"global"`` or ``"none"`` for the empty draft) and ``match_len`` how many
    context tokens it matched.
    """

    token_ids: tuple[int, ...]
    parents: tuple[int, ...]
    probs: tuple[float, ...]
    score: float
    source: str
    match_len: int

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def is_chain(self) -> bool:
        """True when every token follows the one before it."""
        return all(p == i - 1 for i, p in enumerate(self.parents))


EMPTY_DRAFT = Draft((), (), (), 0.0, "none", 0)


FINISH_REASONS = ("stop", "length", "abort")


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to sample one response.

    * ``temperature``: 0 is greedy (argmax); otherwise logits are divided by it.
    * ``top_p`` (0, 1], ``top_k`` (``0``: off): nucleus and top-k truncation.
    * ``max_tokens``: most tokens to generate (>= 1).
    * ``stop_token_ids``: generation ends after sampling one of them (it is
      included in the output, as the end-of-turn token must be for training).
    * ``stop``: strings; generation ends when the decoded output contains one
      (the engine needs a detokenizer for these; the output is kept up to and
      including the token that completed the string). A plain string is refused
      (it would be its characters): pass ``("...",)``.
    * ``seed``: a per-request random stream (``None``: the engine's own stream).
    * ``logprobs``: return the log-probability of every sampled token under the
      model's unprocessed distribution (``log_softmax`` of the logits); a bool, or
      an int >= 0 as the OpenAI API's (any count but 0 asks for them).

    ``stop_token_ids`` and ``stop`` may be given as any iterable (a list); they are
    kept as tuples, so that the parameters stay hashable and immutable.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 256
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    seed: int | None = None
    logprobs: bool = True

    def __post_init__(self) -> None:
        if not _is_real(self.temperature) or not (0.0 <= self.temperature < math.inf):
            # (an infinite one divides every logit into a uniform draw, or NaN)
            raise ValueError(f"temperature must be a finite number >= 0, "
                             f"got {self.temperature!r}")
        if not _is_real(self.top_p) or not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be a number in (0, 1], got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0, got {self.top_k!r}")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) \
                or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        # object.__setattr__: the dataclass is frozen; a list given is stored as a tuple
        object.__setattr__(self, "stop_token_ids", _as_tuple("stop_token_ids",
                                                             self.stop_token_ids, "ints"))
        for t in self.stop_token_ids:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise ValueError(f"stop_token_ids must be ints >= 0, got {t!r}")
        if isinstance(self.stop, str):
            # iterating it would stop on any of its characters
            raise ValueError(f"stop must be a list or tuple of strings, got the string "
                             f"{self.stop!r} (for one stop string pass ({self.stop!r},))")
        object.__setattr__(self, "stop", _as_tuple("stop", self.stop, "strings"))
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop strings must be non-empty strings, got {s!r}")
        seed = self.seed
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise ValueError(f"seed must be an int or None, got {self.seed!r}")
        lp = self.logprobs
        if not isinstance(lp, int) or (not isinstance(lp, bool) and lp < 0):
            raise ValueError(f"logprobs must be a bool or an int >= 0, got {lp!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _is_real(value: object) -> bool:
    """A real number (numpy's scalars too), not a bool (whose ``True`` would pass as 1)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _as_tuple(name: str, value: Any, items: str) -> tuple[Any, ...]:
    if isinstance(value, tuple):
        return value
    if isinstance(value, (str, bytes, dict)):
        raise ValueError(f"{name} must be a list or tuple of {items}, got {value!r}")
    try:
        return tuple(value)
    except TypeError:
        raise ValueError(f"{name} must be a list or tuple of {items}, got {value!r}") from None


@dataclass(frozen=True, slots=True)
class GenRequest:
    """One generation request to a replica.

    ``prompt_ids`` is the whole context so far (a multi-turn trajectory sends
    its earlier turns again; the replica's prefix cache serves them), or, with
    ``continues``, only the tokens that follow the trajectory's previous request
    on this replica (its prompt and output): the replica prepends what it holds,
    and refuses with ``UnknownTrajectory`` when it holds nothing (send the whole
    context then). The trajectory and group ids let replicas keep one draft tree
    per trajectory and draft from the group's history; ``priority`` orders a
    replica's queue (higher first; e.g. expected remaining work of the trajectory).
    """

    request_id: str
    prompt_ids: tuple[int, ...]
    sampling: SamplingParams = SamplingParams()
    trajectory_id: str | None = None
    group_id: str | None = None
    priority: float = 0.0
    continues: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.request_id, str) or not self.request_id:
            raise ValueError("request_id must be a non-empty string")
        for name in ("trajectory_id", "group_id"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"request {self.request_id}: {name} must be a non-empty "
                                 f"string or None, got {value!r}")
        if not isinstance(self.continues, bool):  # ("no" would continue)
            raise ValueError(f"request {self.request_id}: continues must be a bool, "
                             f"got {self.continues!r}")
        if self.continues and self.trajectory_id is None:
            raise ValueError(f"request {self.request_id}: continues needs a trajectory_id")
        # (a string has a length too, and would be taken for its characters)
        if isinstance(self.prompt_ids, (str, bytes)) or not hasattr(self.prompt_ids, "__len__"):
            raise ValueError(f"request {self.request_id}: prompt_ids must be a sequence of "
                             f"token ids, got {type(self.prompt_ids).__name__}")
        if len(self.prompt_ids) == 0:
            raise ValueError(f"request {self.request_id}: prompt_ids is empty")
        if not isinstance(self.sampling, SamplingParams):
            raise ValueError(f"request {self.request_id}: sampling must be a SamplingParams, "
                             f"got {self.sampling!r}")
        # checked here: the engine orders its queue by -priority once the request is
        # registered, too late to refuse it cleanly
        if not _is_real(self.priority) or not math.isfinite(self.priority):
            raise ValueError(f"request {self.request_id}: priority must be a finite number, "
                             f"got {self.priority!r}")


class UnknownTrajectory(ValueError):
    """A continuing request's trajectory is not held by the replica (evicted, or
    its earlier turns ran elsewhere): resend the whole context."""


@dataclass(frozen=True, slots=True)
class GenResult:
    """The outcome of one ``GenRequest``.

    ``logprobs[i]`` belongs to ``output_ids[i]`` (empty when not asked for).
    ``num_cached_tokens``: prompt tokens served from the prefix cache.
    ``num_forward_passes``: decoding steps this request took part in after its
    prefill (tokens/step = ``len(output_ids) / num_forward_passes``).
    ``num_draft_tokens`` / ``num_accepted_tokens``: speculation proposed/accepted.
    ``weight_version``: the weights that produced the output.
    """

    request_id: str
    output_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: str
    num_prompt_tokens: int
    num_cached_tokens: int = 0
    num_forward_passes: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_preemptions: int = 0
    weight_version: int = 0
    queue_s: float = 0.0
    total_s: float = 0.0

    def __post_init__(self) -> None:
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(f"unknown finish reason {self.finish_reason!r}")


@dataclass(frozen=True, slots=True)
class ReplicaLoad:
    """A replica's load as a router sees it."""

    num_running: int
    num_waiting: int
    tokens_in_flight: int
    kv_blocks_used: int
    kv_blocks_total: int
    block_size: int
    spec_tokens_per_seq: float = 0.0
    weight_version: int = 0

    @property
    def kv_free_tokens(self) -> int:
        return (self.kv_blocks_total - self.kv_blocks_used) * self.block_size
