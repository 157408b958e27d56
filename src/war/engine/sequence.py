"""The state of one request inside a replica.

Knows: a request's tokens (prompt then output), how many of them have KV in the
cache, its block table, its random stream and its counters. Does not know how
it is scheduled or computed.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from war.types import GenRequest, GenResult


class SeqStatus(enum.Enum):
    WAITING = "waiting"  # queued (new, or preempted and waiting to recompute)
    RUNNING = "running"  # holds KV blocks and takes part in steps
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """One request's mutable state.

    ``token_ids`` holds the prompt then the output. ``num_computed`` tokens have
    their KV in the cache; a decoding sequence has exactly one token without KV
    (the last sampled one), which the next step feeds to the model.
    """

    request: GenRequest
    spec_id: int  # the speculator's id of this request's trajectory
    arrival: int  # admission order, breaks priority ties (earlier first)
    generator: torch.Generator
    arrival_s: float
    token_ids: list[int] = field(default_factory=list)
    num_prompt: int = 0
    num_computed: int = 0
    block_table: list[int] = field(default_factory=list)
    status: SeqStatus = SeqStatus.WAITING
    logprobs: list[float] = field(default_factory=list)
    num_cached_tokens: int = 0
    num_forward_passes: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_preemptions: int = 0
    num_published_blocks: int = 0
    first_scheduled_s: float | None = None
    finish_reason: str | None = None

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.request.prompt_ids)
            self.num_prompt = len(self.token_ids)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def priority(self) -> float:
        return self.request.priority

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - self.num_prompt

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt:]

    @property
    def is_decoding(self) -> bool:
        """True when only the last sampled token lacks KV."""
        return self.num_output > 0 and self.num_computed == self.num_tokens - 1

    @property
    def num_pending(self) -> int:
        """Tokens that still need a forward pass before the next sample."""
        return self.num_tokens - self.num_computed

    def sort_key(self) -> tuple[float, int]:
        """Scheduling order: higher priority first, then earlier arrival."""
        return (-self.priority, self.arrival)

    def result(self, weight_version: int, now_s: float) -> GenResult:
        assert self.finish_reason is not None, f"request {self.request_id} not finished"
        start = self.first_scheduled_s if self.first_scheduled_s is not None else now_s
        return GenResult(
            request_id=self.request_id,
            output_ids=tuple(self.output_ids),
            logprobs=tuple(self.logprobs) if self.request.sampling.logprobs else (),
            finish_reason=self.finish_reason,
            num_prompt_tokens=self.num_prompt,
            num_cached_tokens=self.num_cached_tokens,
            num_forward_passes=self.num_forward_passes,
            num_draft_tokens=self.num_draft_tokens,
            num_accepted_tokens=self.num_accepted_tokens,
            num_preemptions=self.num_preemptions,
            weight_version=weight_version,
            queue_s=max(0.0, start - self.arrival_s),
            total_s=max(0.0, now_s - self.arrival_s),
        )
