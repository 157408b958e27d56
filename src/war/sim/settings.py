"""Settings and counters of a simulated replica.

Knows: the engine knobs a simulated replica takes (``ReplicaConfig``, validated on
construction) and what it counts (``ReplicaStats``). Does not know how they are used
(``war.sim.replica``, ``war.sim.speculation``).
"""

from __future__ import annotations

from dataclasses import dataclass

from war.engine.spec_policy import MODES


@dataclass(frozen=True)
class ReplicaConfig:
    """One replica's engine settings (as ``war.engine.config.EngineConfig``);
    ``num_kv_blocks`` ``None``: the cost model's KV capacity; ``spec_interval``: steps
    between the spec policy's decisions (``Speculation``); ``max_coalesced_steps``,
    ``coalesce_max_seqs``: the module docstring (1: every step is an event);
    ``kv_hold_s``, ``admit_whole_prompt``: the engine's KV holds and admission
    (``war.engine.config.EngineConfig``)."""

    block_size: int = 16
    num_kv_blocks: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    spec_mode: str = "auto"
    max_spec_tokens: int = 32
    prefill_token_value: float = 1.0
    spec_interval: int = 1
    max_coalesced_steps: int = 1
    coalesce_max_seqs: int = 4
    kv_hold_s: float = 0.0
    admit_whole_prompt: bool = False

    def __post_init__(self) -> None:
        for f in ("block_size", "max_num_seqs", "max_num_batched_tokens", "spec_interval",
                  "max_coalesced_steps", "coalesce_max_seqs"):
            if getattr(self, f) < 1:
                raise ValueError(f"{f} must be >= 1, got {getattr(self, f)}")
        # (the spec policy refuses it too, but only when a run builds its replicas)
        if not 0 <= self.prefill_token_value < float("inf"):
            raise ValueError(f"prefill_token_value must be >= 0 and finite, "
                             f"got {self.prefill_token_value}")
        if not 0 <= self.kv_hold_s < float("inf"):
            raise ValueError(f"kv_hold_s must be >= 0, got {self.kv_hold_s}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.spec_mode not in MODES:
            raise ValueError(f"spec_mode must be one of {MODES}, got {self.spec_mode!r}")
        if self.max_spec_tokens < 0 or self.max_num_batched_tokens < self.max_spec_tokens + 1:
            raise ValueError("max_num_batched_tokens must leave room for one draft")


@dataclass
class ReplicaStats:
    steps: int = 0
    busy_s: float = 0.0
    passes: int = 0  # sampling passes summed over sequences
    generated: int = 0
    drafted: int = 0  # draft tokens verified
    accepted: int = 0
    prefill_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    preemptions: int = 0
    holds: int = 0  # turns whose context stayed pinned for the trajectory's next turn
    holds_used: int = 0  # next turns admitted onto their held context
    holds_broken: int = 0  # holds released early to make room
    last_drafted: int = 0  # draft tokens of the last event's steps
    last_decodes: int = 0  # decoding sequences summed over the last event's steps
