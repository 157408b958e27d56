"""Cost models of a replica's forward pass: how long one step takes.

Knows: the shape of a step (sequences, tokens fed, KV read, drafts among the tokens)
and two analytic models of its duration: ``LinearCost`` (coefficients given) and
``RooflineCost``, the roofline of an accelerator preset (peak bf16 dense FLOP/s and
memory bandwidth from the vendors' datasheets) running a dense transformer preset
with tensor parallelism and a fixed overhead per step. The model fitted to a measured
cost curve lives in ``war.sim.profile``. Does not know batching, drafts' contents or
virtual time: a cost model is a pure function of the step's shape.

Conventions (the same as ``war.engine.spec_policy``): ``batch_tokens`` counts every
token of the forward pass (prefill chunks, one per decoding sequence, draft tokens);
``context_tokens`` is the KV length attention reads, summed over sequences, this
step's tokens included; ``draft_tokens`` is how many of ``batch_tokens`` are drafts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol


class CostModel(Protocol):
    """The duration of one forward pass. Implementations are deterministic."""

    @property
    def name(self) -> str: ...

    def step_time(self, num_seqs: int, batch_tokens: int, context_tokens: int,
                  draft_tokens: int = 0) -> float:
        """Seconds of one step of this shape (positive)."""
        ...

    def kv_capacity_tokens(self) -> int | None:
        """KV tokens a replica holds (``None``: the model does not know memory)."""
        ...


@dataclass(frozen=True)
class LinearCost:
    """``intercept_s + per_token_s * batch_tokens + per_context_token_s * context_tokens
    + per_seq_s * num_seqs``; drafts cost what other tokens cost."""

    intercept_s: float = 0.01
    per_token_s: float = 0.0
    per_context_token_s: float = 0.0
    per_seq_s: float = 0.0
    kv_tokens: int | None = None
    name: str = "linear"

    def __post_init__(self) -> None:
        # (an infinite coefficient makes every step last forever)
        if not 0 < self.intercept_s < math.inf:
            raise ValueError(f"intercept_s must be > 0 and finite, got {self.intercept_s}")
        for f in ("per_token_s", "per_context_token_s", "per_seq_s"):
            if not 0 <= getattr(self, f) < math.inf:
                raise ValueError(f"{f} must be >= 0 and finite, got {getattr(self, f)}")
        if self.kv_tokens is not None and self.kv_tokens < 1:
            raise ValueError(f"kv_tokens must be >= 1, got {self.kv_tokens}")

    def step_time(self, num_seqs: int, batch_tokens: int, context_tokens: int,
                  draft_tokens: int = 0) -> float:
        return (self.intercept_s + self.per_token_s * batch_tokens
                + self.per_context_token_s * context_tokens + self.per_seq_s * num_seqs)

    def kv_capacity_tokens(self) -> int | None:
        return self.kv_tokens


@dataclass(frozen=True)
class Accelerator:
    """One GPU: bf16 dense peak FLOP/s, HBM bandwidth and capacity (bytes), and the
    per-direction NVLink bandwidth used by tensor-parallel all-reduces."""

    name: str
    peak_flops: float
    mem_bandwidth: float
    mem_bytes: float
    link_bandwidth: float


# Vendors' datasheets, bf16 dense (no sparsity), SXM parts.
ACCELERATORS: dict[str, Accelerator] = {
    "A100": Accelerator("A100-SXM4-80GB", 312e12, 2.0e12, 80e9, 300e9),
    "H100": Accelerator("H100-SXM5-80GB", 989e12, 3.35e12, 80e9, 450e9),
    "H200": Accelerator("H200-SXM-141GB", 989e12, 4.8e12, 141e9, 450e9),
}


@dataclass(frozen=True)
class ModelShape:
    """A dense decoder-only transformer: parameters, layers, hidden size, attention
    heads, KV heads (grouped-query attention) and head size; bf16 weights and KV."""

    name: str
    num_params: float
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    bytes_per_value: int = 2

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.bytes_per_value


# Public model cards (Llama 3.1, Qwen2.5).
MODELS: dict[str, ModelShape] = {
    "llama-8b": ModelShape("Llama-3.1-8B", 8.03e9, 32, 4096, 32, 8, 128),
    "qwen-14b": ModelShape("Qwen2.5-14B", 14.7e9, 48, 5120, 40, 8, 128),
    "qwen-32b": ModelShape("Qwen2.5-32B", 32.8e9, 64, 5120, 40, 8, 128),
    "llama-70b": ModelShape("Llama-3.1-70B", 70.6e9, 80, 8192, 64, 8, 128),
}


@dataclass(frozen=True)
class RooflineCost:
    """A step on ``tp`` GPUs of ``accelerator`` running ``model``::

        flops  = 2 * params * batch_tokens + 4 * layers * heads * head_dim * attn_pairs
        bytes  = params * 2 + kv_bytes_per_token * (context_tokens + batch_tokens)
        time   = max(flops / (tp * peak * compute_efficiency),
                     bytes / (tp * bandwidth * memory_efficiency))
                 + all_reduce(batch_tokens) + overhead_s + per_seq_overhead_s * num_seqs

    ``attn_pairs`` (query-key pairs) is ``batch_tokens * context_tokens / num_seqs``,
    exact when sequences are alike. The all-reduce (two per layer, ring, bf16
    activations) is zero for ``tp == 1``. KV capacity: ``tp * mem_bytes *
    gpu_memory_utilization`` minus the weights, over the KV bytes per token.
    """

    accelerator: str = "H100"
    model: str = "llama-8b"
    tp: int = 1
    compute_efficiency: float = 0.6
    memory_efficiency: float = 0.8
    overhead_s: float = 0.003
    per_seq_overhead_s: float = 0.0
    all_reduce_latency_s: float = 1e-5
    gpu_memory_utilization: float = 0.9
    name: str = "roofline"

    def __post_init__(self) -> None:
        if self.accelerator not in ACCELERATORS:
            raise ValueError(f"unknown accelerator {self.accelerator!r}; "
                             f"known: {', '.join(ACCELERATORS)}")
        if self.model not in MODELS:
            raise ValueError(f"unknown model {self.model!r}; known: {', '.join(MODELS)}")
        if isinstance(self.tp, bool) or not isinstance(self.tp, int) or self.tp < 1:
            raise ValueError(f"tp must be an int >= 1, got {self.tp!r}")
        for f in ("compute_efficiency", "memory_efficiency", "gpu_memory_utilization"):
            if not 0.0 < getattr(self, f) <= 1.0:
                raise ValueError(f"{f} must be in (0, 1], got {getattr(self, f)}")
        for f in ("overhead_s", "per_seq_overhead_s", "all_reduce_latency_s"):
            if not 0.0 <= getattr(self, f) < math.inf:
                raise ValueError(f"{f} must be >= 0 and finite, got {getattr(self, f)}")
        if self.kv_capacity_tokens() < 1:
            raise ValueError(f"{self.model} does not fit {self.tp} x {self.accelerator} at "
                             f"gpu_memory_utilization {self.gpu_memory_utilization}")

    def step_time(self, num_seqs: int, batch_tokens: int, context_tokens: int,
                  draft_tokens: int = 0) -> float:
        acc, m, tp = ACCELERATORS[self.accelerator], MODELS[self.model], self.tp
        pairs = batch_tokens * context_tokens / max(num_seqs, 1)
        flops = (2.0 * m.num_params * batch_tokens
                 + 4.0 * m.num_layers * m.num_heads * m.head_dim * pairs)
        nbytes = (m.num_params * m.bytes_per_value
                  + m.kv_bytes_per_token * (context_tokens + batch_tokens))
        compute = flops / (tp * acc.peak_flops * self.compute_efficiency)
        memory = nbytes / (tp * acc.mem_bandwidth * self.memory_efficiency)
        comm = 0.0
        if tp > 1:
            size = batch_tokens * m.hidden_size * m.bytes_per_value
            per = 2.0 * (tp - 1) / tp * size / acc.link_bandwidth + self.all_reduce_latency_s
            comm = 2 * m.num_layers * per
        return max(compute, memory) + comm + self.overhead_s + self.per_seq_overhead_s * num_seqs

    def kv_capacity_tokens(self) -> int:
        acc, m = ACCELERATORS[self.accelerator], MODELS[self.model]
        free = self.tp * acc.mem_bytes * self.gpu_memory_utilization \
            - m.num_params * m.bytes_per_value
        return int(free // m.kv_bytes_per_token)
