"""The building blocks of a decoder layer: RMSNorm, rotary position embedding, SwiGLU MLP.

Knows: the math of each block and the numerics transformers uses for them (RMSNorm
statistics in at least float32 and the product with the weight in the input's
dtype; RoPE frequencies for the default, linear, llama3 and YaRN schemes, the
rotate-half convention and YaRN's attention factor on cos/sin). Does not know
attention, KV caches or how the blocks are stacked (see ``attention.py`` and
``model.py``).
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from war.engine.model_config import ModelConfig, RopeScaling


class RMSNorm(nn.Module):
    """``x / sqrt(mean(x**2) + eps) * weight`` over the last dimension.

    The statistics are computed in float32 for half-precision inputs (in the
    input's own dtype for float32/float64), the normalised value is cast back to
    the input's dtype and then multiplied by the weight, as transformers does.
    """

    def __init__(self, dim: int, eps: float, *, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device))

    def forward(self, x: Tensor) -> Tensor:
        in_dtype = x.dtype
        compute = x if in_dtype in (torch.float32, torch.float64) else x.float()
        var = compute.pow(2).mean(-1, keepdim=True)
        normed = compute * torch.rsqrt(var + self.eps)
        return self.weight * normed.to(in_dtype)


def rope_inv_freq(config: ModelConfig) -> tuple[np.ndarray, float]:
    """``(inv_freq, attention_factor)``: the ``head_dim // 2`` rotation frequencies
    (float64) after the config's scaling, and the factor cos/sin are multiplied by.
    """
    dim = config.head_dim
    base = config.rope_theta
    exponents = np.arange(0, dim, 2, dtype=np.float64) / dim
    inv_freq: np.ndarray = 1.0 / (base ** exponents)
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq, 1.0
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor, 1.0
    if scaling.rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling), 1.0
    if scaling.rope_type == "yarn":
        return _yarn_inv_freq(inv_freq, dim, base, scaling)
    raise ValueError(f"unsupported RoPE scaling type {scaling.rope_type!r}")


def _llama3_inv_freq(inv_freq: np.ndarray, s: RopeScaling) -> np.ndarray:
    # Wavelengths shorter than the context / high_freq_factor stay as they are,
    # longer than context / low_freq_factor are stretched by ``factor``, and the
    # band between is a linear blend in (context / wavelength).
    assert s.low_freq_factor is not None and s.high_freq_factor is not None
    assert s.original_max_position_embeddings is not None
    ctx = float(s.original_max_position_embeddings)
    lo, hi = s.low_freq_factor, s.high_freq_factor
    wavelen = 2.0 * math.pi / inv_freq
    smooth = (ctx / wavelen - lo) / (hi - lo)
    blended = (1.0 - smooth) * inv_freq / s.factor + smooth * inv_freq
    out = np.where(wavelen > ctx / lo, inv_freq / s.factor, blended)
    result: np.ndarray = np.where(wavelen < ctx / hi, inv_freq, out)
    return result


def _yarn_inv_freq(inv_freq: np.ndarray, dim: int, base: float,
                   s: RopeScaling) -> tuple[np.ndarray, float]:
    assert s.original_max_position_embeddings is not None
    ctx = float(s.original_max_position_embeddings)

    def dim_of_rotations(rotations: float) -> float:
        # the dimension index whose frequency turns ``rotations`` times over ``ctx``
        return dim * math.log(ctx / (rotations * 2.0 * math.pi)) / (2.0 * math.log(base))

    low, high = dim_of_rotations(s.beta_fast), dim_of_rotations(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    # ramp: 0 for high-frequency dims (kept: extrapolation), 1 for low ones (interpolated)
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    inv: np.ndarray = (inv_freq / s.factor) * ramp + inv_freq * (1.0 - ramp)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1.0 else 0.1 * m * math.log(scale) + 1.0

    if s.attention_factor is not None:
        attn = s.attention_factor
    elif s.mscale and s.mscale_all_dim:
        attn = mscale(s.factor, s.mscale) / mscale(s.factor, s.mscale_all_dim)
    else:
        attn = mscale(s.factor)
    return inv, float(attn)


class RotaryEmbedding:
    """cos/sin tables of rotary position embedding for given positions.

    Not an ``nn.Module``: it holds no weights and must not be cast by ``.to(dtype)``.
    Angles are computed in float64; the frequencies are first rounded to float32
    unless the output is float64, which is what transformers (and training code)
    use, so float32/bfloat16 models see the same frequencies as there.
    """

    def __init__(self, config: ModelConfig) -> None:
        inv, attn = rope_inv_freq(config)
        self.attention_factor = attn
        self._inv64 = torch.from_numpy(inv)
        self._inv32 = self._inv64.float().double()
        self._cache: dict[tuple[torch.device, bool], Tensor] = {}

    def _inv_freq(self, device: torch.device, exact: bool) -> Tensor:
        key = (device, exact)
        t = self._cache.get(key)
        if t is None:
            t = (self._inv64 if exact else self._inv32).to(device)
            self._cache[key] = t
        return t

    def cos_sin(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """``(cos, sin)`` of shape ``positions.shape + (head_dim,)`` in ``dtype``."""
        inv = self._inv_freq(positions.device, dtype == torch.float64)
        angles = positions.to(torch.float64).unsqueeze(-1) * inv
        angles = torch.cat((angles, angles), dim=-1)
        cos, sin = angles.cos(), angles.sin()
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return cos.to(dtype), sin.to(dtype)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x[..., heads, head_dim]`` by the angles of ``cos``/``sin[..., head_dim]``.

    Pairs are ``(x[i], x[i + head_dim/2])`` (the rotate-half layout of HF checkpoints).
    """
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    rotated = torch.cat((-x2, x1), dim=-1)
    c, s = cos.unsqueeze(-2), sin.unsqueeze(-2)
    return x * c + rotated * s


class MLP(nn.Module):
    """SwiGLU: ``down_proj(silu(gate_proj(x)) * up_proj(x))``, no biases."""

    def __init__(self, hidden_size: int, intermediate_size: int, *,
                 dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False,
                                   dtype=dtype, device=device)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False,
                                 dtype=dtype, device=device)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False,
                                   dtype=dtype, device=device)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return out
