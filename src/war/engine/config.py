"""Configuration of a replica engine.

Knows: the knobs of memory, batching and speculation of one replica and which
values are valid. Does not know how they are used (see ``engine.py``,
``scheduler.py``) and does no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from war.spec.config import SpecConfig

SPEC_MODES = ("auto", "always", "off")
DTYPES = ("float32", "bfloat16", "float16", "float64")


@dataclass(frozen=True)
class EngineConfig:
    """Settings of one replica; validated on construction.

    * ``block_size``: token slots per KV block.
    * ``num_kv_blocks``: blocks in the paged KV cache; ``None`` derives it from
      ``kv_cache_bytes`` and the model's shape.
    * ``max_num_seqs``: most sequences in one step.
    * ``max_num_batched_tokens``: most tokens in one forward pass (prefill chunks,
      decoded tokens and draft tokens together); longer prompts are prefilled in
      chunks.
    * ``max_model_len``: longest sequence (prompt + output); ``None``: the
      model's ``max_position_embeddings``.
    * ``enable_prefix_cache``: reuse KV of cached prefixes (radix tree over blocks).
    * ``spec_mode``: ``auto`` (load-aware budget, the default), ``always`` (verify
      every draft) or ``off``.
    * ``spec``: the suffix speculator's settings; ``spec.max_spec_tokens`` caps a
      sequence's draft.
    * ``max_idle_trajectories``: trajectories whose draft trees are kept between
      turns (least recently used ones are finished beyond this).
    * ``kv_hold_s``: how long a finished turn's KV stays held for its trajectory's
      next turn (the agent's tool call in between), so other requests cannot evict
      it; 0: not held (``scheduler.py``). ``finish_trajectory`` ends a hold early.
    * ``admit_whole_prompt``: admit a waiting request only when its whole prefill
      fits the free KV, instead of its first chunk (long prompts then never preempt
      running sequences chunk by chunk).
    * ``dtype``, ``device``: of weights, activations and KV.
    * ``seed``: of the engine's random stream (requests without their own seed).
    """

    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_bytes: int = 256 * 1024 * 1024
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    enable_prefix_cache: bool = True
    spec_mode: str = "auto"
    spec: SpecConfig = field(default_factory=SpecConfig)
    max_idle_trajectories: int = 4096
    kv_hold_s: float = 0.0
    admit_whole_prompt: bool = False
    dtype: str = "float32"
    device: str = "cpu"
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens",
                     "kv_cache_bytes", "max_idle_trajectories"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if self.num_kv_blocks is not None and (
            isinstance(self.num_kv_blocks, bool) or not isinstance(self.num_kv_blocks, int)
            or self.num_kv_blocks < 1
        ):
            raise ValueError(f"num_kv_blocks must be an int >= 1, got {self.num_kv_blocks!r}")
        if isinstance(self.kv_hold_s, bool) or not isinstance(self.kv_hold_s, (int, float)) \
                or not 0 <= self.kv_hold_s < float("inf"):
            raise ValueError(f"kv_hold_s must be a number >= 0, got {self.kv_hold_s!r}")
        if self.max_model_len is not None and (
            isinstance(self.max_model_len, bool) or not isinstance(self.max_model_len, int)
            or self.max_model_len < 2
        ):
            raise ValueError(f"max_model_len must be an int >= 2, got {self.max_model_len!r}")
        for name in ("enable_prefix_cache", "admit_whole_prompt"):
            if not isinstance(getattr(self, name), bool):  # ("no" would be true)
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if not isinstance(self.spec, SpecConfig):
            raise ValueError(f"spec must be a SpecConfig, got {self.spec!r}")
        if self.spec_mode not in SPEC_MODES:
            raise ValueError(f"spec_mode must be one of {SPEC_MODES}, got {self.spec_mode!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        # (whether this machine has the device is the loader's to say: war.engine.loader
        # .torch_device; a config does no I/O)
        if not isinstance(self.device, str) or not self.device:
            raise ValueError(f"device must be a torch device name (cpu, cuda, cuda:1...), "
                             f"got {self.device!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) \
                or not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be an int in [0, 2**63), got {self.seed!r}")
        if self.max_num_batched_tokens < self.spec.max_spec_tokens + 1:
            raise ValueError(
                "max_num_batched_tokens must leave room for one draft: "
                f"{self.max_num_batched_tokens} < {self.spec.max_spec_tokens + 1}"
            )
