"""Counters of a replica engine.

Knows: what happened over the engine's life (steps, tokens, drafts,
prefix-cache hits, preemptions, step times). Does not know how any of it is
produced; the engine updates it, exporters (``/metrics``) read it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple


class StepRecord(NamedTuple):
    """One step of the engine's timeline (``Engine.timeline``)."""

    time_s: float  # the engine clock when the step ended
    num_seqs: int  # sequences in the forward pass
    num_decoding: int  # of which decoding (the rest prefill chunks)
    num_waiting: int  # queued after the step
    batch_tokens: int
    draft_tokens: int  # draft tokens verified (the speculation budget chosen)
    accepted_tokens: int
    step_s: float


@dataclass
class EngineStats:
    num_steps: int = 0
    num_generated_tokens: int = 0
    num_decode_passes: int = 0  # sequence-steps that produced tokens
    num_draft_tokens: int = 0  # proposed and verified
    num_accepted_tokens: int = 0
    num_prompt_tokens: int = 0
    num_cached_prompt_tokens: int = 0
    num_preemptions: int = 0
    num_finished: int = 0
    num_aborted: int = 0
    total_step_s: float = 0.0
    last_step_s: float = 0.0
    last_batch_tokens: int = 0
    last_num_seqs: int = 0
    last_spec_tokens: int = 0
    total_spec_budget: int = 0  # draft tokens chosen, summed over steps

    @property
    def tokens_per_step(self) -> float:
        """Generated tokens per forward pass of a sequence (1.0 without speculation)."""
        return self.num_generated_tokens / self.num_decode_passes if self.num_decode_passes else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def prefix_hit_rate(self) -> float:
        return (self.num_cached_prompt_tokens / self.num_prompt_tokens
                if self.num_prompt_tokens else 0.0)

    @property
    def mean_step_s(self) -> float:
        return self.total_step_s / self.num_steps if self.num_steps else 0.0

    def as_dict(self) -> dict[str, float]:
        out: dict[str, float] = {k: float(v) for k, v in vars(self).items()}
        out.update(tokens_per_step=self.tokens_per_step, acceptance_rate=self.acceptance_rate,
                   prefix_hit_rate=self.prefix_hit_rate, mean_step_s=self.mean_step_s)
        return out
