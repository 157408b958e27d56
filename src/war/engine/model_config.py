"""The architecture of a decoder model, as a Hugging Face ``config.json`` describes it.

Knows: the fields of Llama, Qwen2 and Qwen3 configs that change the computation
(sizes, heads, norms, RoPE and its scaling, biases, qk-norm, tied embeddings,
special token ids), both the old (``rope_theta`` + ``rope_scaling``) and the new
(``rope_parameters``) spelling of RoPE settings, their defaults as transformers
applies them, which values are valid, and how to write them back as a
``config.json`` that transformers loads. Does not know weights, tensors or files
other than the one ``config.json`` (see ``loader.py``), nor how the fields are
used (see ``layers.py``, ``attention.py``, ``model.py``).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MODEL_TYPES = ("llama", "qwen2", "qwen3")
ROPE_TYPES = ("linear", "llama3", "yarn")

_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
# transformers' defaults where config.json leaves a field out.
_DEFAULT_MAX_POSITIONS = {"llama": 2048, "qwen2": 32768, "qwen3": 32768}
_QWEN3_DEFAULT_HEAD_DIM = 128
_DEFAULT_ROPE_THETA = 10000.0


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_real(v: object) -> bool:
    return (isinstance(v, int | float) and not isinstance(v, bool)) and math.isfinite(v)


@dataclass(frozen=True)
class RopeScaling:
    """How RoPE frequencies are rescaled for long contexts.

    * ``rope_type``: ``"linear"`` (positions divided by ``factor``), ``"llama3"``
      (low frequencies divided by ``factor``, high ones kept, a smooth ramp between,
      set by ``low_freq_factor``/``high_freq_factor``) or ``"yarn"`` (per-frequency
      blend of interpolation and extrapolation between the ``beta_fast`` and
      ``beta_slow`` rotation counts, and cos/sin multiplied by ``attention_factor``).
    * ``original_max_position_embeddings``: the pretraining context (llama3, yarn);
      ``None`` until ``ModelConfig`` fills in its ``max_position_embeddings``.
    * ``attention_factor`` (yarn): ``None`` is derived from ``factor`` (and from
      ``mscale``/``mscale_all_dim`` when both are set), as the YaRN paper suggests.
    * ``truncate`` (yarn): round the ramp's ends to whole dimensions.
    """

    rope_type: str
    factor: float
    original_max_position_embeddings: int | None = None
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    attention_factor: float | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(
                f"unsupported RoPE scaling type {self.rope_type!r} "
                f"(supported: default, {', '.join(ROPE_TYPES)})"
            )
        if not _is_real(self.factor) or self.factor <= 0:
            raise ValueError(f"rope scaling factor must be a number > 0, got {self.factor!r}")
        object.__setattr__(self, "factor", float(self.factor))
        omp = self.original_max_position_embeddings
        if omp is not None and (not _is_int(omp) or omp < 1):
            raise ValueError(f"original_max_position_embeddings must be an int >= 1, got {omp!r}")
        if self.rope_type == "llama3":
            lo, hi = self.low_freq_factor, self.high_freq_factor
            if lo is None or hi is None:
                raise ValueError("llama3 rope scaling needs low_freq_factor and high_freq_factor")
            if not _is_real(lo) or not _is_real(hi) or lo <= 0 or hi <= lo:
                raise ValueError(
                    f"llama3 rope scaling needs 0 < low_freq_factor < high_freq_factor, "
                    f"got {lo!r} and {hi!r}"
                )
        for name in ("attention_factor", "mscale", "mscale_all_dim"):
            v = getattr(self, name)
            if v is not None and (not _is_real(v) or v < 0):
                raise ValueError(f"rope scaling {name} must be a number >= 0, got {v!r}")
        for name in ("beta_fast", "beta_slow"):
            v = getattr(self, name)
            if not _is_real(v) or v <= 0:
                raise ValueError(f"rope scaling {name} must be a number > 0, got {v!r}")
        if not isinstance(self.truncate, bool):
            raise ValueError(f"rope scaling truncate must be a bool, got {self.truncate!r}")

    def to_dict(self) -> dict[str, Any]:
        """The entries of a ``rope_scaling``/``rope_parameters`` dict (without ``rope_theta``)."""
        d: dict[str, Any] = {"rope_type": self.rope_type, "factor": self.factor}
        if self.rope_type in ("llama3", "yarn"):
            d["original_max_position_embeddings"] = self.original_max_position_embeddings
        if self.rope_type == "llama3":
            d["low_freq_factor"] = self.low_freq_factor
            d["high_freq_factor"] = self.high_freq_factor
        if self.rope_type == "yarn":
            d["beta_fast"] = self.beta_fast
            d["beta_slow"] = self.beta_slow
            d["truncate"] = self.truncate
            for name in ("attention_factor", "mscale", "mscale_all_dim"):
                if getattr(self, name) is not None:
                    d[name] = getattr(self, name)
        return d


@dataclass(frozen=True)
class ModelConfig:
    """A Llama / Qwen2 / Qwen3 decoder; validated on construction.

    * ``num_key_value_heads``: ``0`` means ``num_attention_heads`` (no GQA).
    * ``head_dim``: ``0`` means ``hidden_size // num_attention_heads`` (qwen3: 128,
      transformers' default for that model type).
    * ``attention_bias``: q/k/v projections carry a bias (qwen2 always does; for
      llama and qwen3 the output projection then has one too, as in transformers).
    * ``rope_scaling``: ``None`` is plain RoPE.
    * ``eos_token_id``: all end-of-sequence ids (config.json may hold one or a list).

    Both ``0`` placeholders are replaced by their value on construction, so the
    fields of a constructed config always hold the real sizes.
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int = 0
    head_dim: int = 0
    rms_norm_eps: float = 1e-6
    rope_theta: float = _DEFAULT_ROPE_THETA
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 0
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()
    pad_token_id: int | None = None

    def __post_init__(self) -> None:
        if self.model_type not in MODEL_TYPES:
            raise ValueError(
                f"unsupported model_type {self.model_type!r} (supported: {', '.join(MODEL_TYPES)})"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads"):
            v = getattr(self, name)
            if not _is_int(v) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        for name in ("num_key_value_heads", "head_dim", "max_position_embeddings"):
            v = getattr(self, name)
            if not _is_int(v) or v < 0:
                raise ValueError(f"{name} must be an int >= 1 (or 0 for the default), got {v!r}")
        if self.num_key_value_heads == 0:
            object.__setattr__(self, "num_key_value_heads", self.num_attention_heads)
        if self.head_dim == 0:
            if self.model_type == "qwen3":
                object.__setattr__(self, "head_dim", _QWEN3_DEFAULT_HEAD_DIM)
            else:
                if self.hidden_size % self.num_attention_heads:
                    raise ValueError(
                        f"hidden_size {self.hidden_size} is not divisible by "
                        f"num_attention_heads {self.num_attention_heads}; set head_dim"
                    )
                object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        if self.max_position_embeddings == 0:
            object.__setattr__(
                self, "max_position_embeddings", _DEFAULT_MAX_POSITIONS[self.model_type]
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads {self.num_attention_heads} is not divisible by "
                f"num_key_value_heads {self.num_key_value_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if not _is_real(self.rms_norm_eps) or self.rms_norm_eps <= 0:
            raise ValueError(f"rms_norm_eps must be a number > 0, got {self.rms_norm_eps!r}")
        if not _is_real(self.rope_theta) or self.rope_theta <= 1:
            raise ValueError(f"rope_theta must be a number > 1, got {self.rope_theta!r}")
        object.__setattr__(self, "rms_norm_eps", float(self.rms_norm_eps))
        object.__setattr__(self, "rope_theta", float(self.rope_theta))
        if self.rope_scaling is not None:
            if not isinstance(self.rope_scaling, RopeScaling):
                raise ValueError(
                    f"rope_scaling must be a RopeScaling or None, got {self.rope_scaling!r}"
                )
            if (self.rope_scaling.rope_type in ("llama3", "yarn")
                    and self.rope_scaling.original_max_position_embeddings is None):
                object.__setattr__(self, "rope_scaling", dataclasses.replace(
                    self.rope_scaling,
                    original_max_position_embeddings=self.max_position_embeddings,
                ))
        for name in ("tie_word_embeddings", "attention_bias"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.model_type == "qwen2" and not self.attention_bias:
            raise ValueError("qwen2 always has q/k/v biases: attention_bias must be True")
        for name in ("bos_token_id", "pad_token_id"):
            v = getattr(self, name)
            if v is not None and (not _is_int(v) or v < 0):
                raise ValueError(f"{name} must be an int >= 0 or None, got {v!r}")
        if not isinstance(self.eos_token_id, tuple) or not all(
                _is_int(t) and t >= 0 for t in self.eos_token_id):
            raise ValueError(
                f"eos_token_id must be a tuple of ints >= 0, got {self.eos_token_id!r}"
            )

    # ---- derived -----------------------------------------------------------------

    @property
    def qk_norm(self) -> bool:
        """Whether q and k are RMS-normalised over ``head_dim`` before RoPE (qwen3)."""
        return self.model_type == "qwen3"

    @property
    def o_proj_bias(self) -> bool:
        """Whether the attention output projection has a bias (llama/qwen3 with biases)."""
        return self.attention_bias and self.model_type != "qwen2"

    @property
    def num_kv_groups(self) -> int:
        """Query heads per key/value head."""
        return self.num_attention_heads // self.num_key_value_heads

    # ---- config.json ---------------------------------------------------------------

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ModelConfig:
        """Read a Hugging Face ``config.json`` dict; unknown keys are ignored.

        Raises ``ValueError`` for a missing required key, an unsupported model type,
        RoPE type, activation or feature (sliding window, MLP bias, partial rotary).
        """
        if not isinstance(d, Mapping):
            raise ValueError(f"a config must be a mapping, got {type(d).__name__}")
        model_type = d.get("model_type")
        if model_type not in MODEL_TYPES:
            raise ValueError(
                f"unsupported model_type {model_type!r} (supported: {', '.join(MODEL_TYPES)})"
            )
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads"):
            if d.get(key) is None:
                raise ValueError(f"config ({model_type}) lacks {key!r}")
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"unsupported hidden_act {act!r} (only 'silu')")
        if d.get("mlp_bias", False):
            raise ValueError("unsupported: mlp_bias=True")
        if d.get("use_sliding_window", False):
            raise ValueError("unsupported: use_sliding_window=True (sliding-window attention)")
        layer_types = d.get("layer_types")
        if layer_types is not None and any(t != "full_attention" for t in layer_types):
            raise ValueError(f"unsupported layer_types {sorted(set(layer_types))!r}")

        rope_theta, rope_scaling = _read_rope(d)
        eos = d.get("eos_token_id")
        if eos is None:
            eos_ids: tuple[int, ...] = ()
        elif isinstance(eos, list | tuple):
            eos_ids = tuple(eos)
        else:
            eos_ids = (eos,)
        # transformers' Qwen2 ignores the key: its q/k/v projections always have biases
        attention_bias = True if model_type == "qwen2" else d.get("attention_bias", False)
        return cls(
            model_type=model_type,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=d["num_attention_heads"],
            num_key_value_heads=d.get("num_key_value_heads") or 0,
            head_dim=d.get("head_dim") or 0,
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=d.get("max_position_embeddings") or 0,
            tie_word_embeddings=d.get("tie_word_embeddings", False),
            attention_bias=attention_bias,
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=eos_ids,
            pad_token_id=d.get("pad_token_id"),
        )

    @classmethod
    def from_file(cls, path: str | Path) -> ModelConfig:
        """Read ``config.json`` (``path`` is the file or the folder holding it)."""
        p = Path(path)
        if p.is_dir():
            p = p / "config.json"
        if not p.is_file():
            raise FileNotFoundError(f"no model config at {p}")
        try:
            d = json.loads(p.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise ValueError(f"{p} is not valid JSON: {e}") from e
        return cls.from_dict(d)

    def to_dict(self) -> dict[str, Any]:
        """A ``config.json`` dict that transformers (4.x and 5.x) and ``from_dict`` load.

        RoPE settings are written in both spellings (``rope_theta``/``rope_scaling``
        and ``rope_parameters``), which agree.
        """
        scaling = self.rope_scaling.to_dict() if self.rope_scaling is not None else None
        rope_parameters: dict[str, Any] = {"rope_type": "default", "rope_theta": self.rope_theta}
        if scaling is not None:
            rope_parameters = {**scaling, "rope_theta": self.rope_theta}
        eos: int | list[int] | None
        if not self.eos_token_id:
            eos = None
        elif len(self.eos_token_id) == 1:
            eos = self.eos_token_id[0]
        else:
            eos = list(self.eos_token_id)
        d: dict[str, Any] = {
            "architectures": [_ARCHITECTURES[self.model_type]],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": scaling,
            "rope_parameters": rope_parameters,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos,
            "pad_token_id": self.pad_token_id,
        }
        if self.model_type == "llama":
            d["mlp_bias"] = False
        else:
            d["use_sliding_window"] = False
        return d


def _read_rope(d: Mapping[str, Any]) -> tuple[float, RopeScaling | None]:
    """``(rope_theta, scaling)`` from either spelling; ``rope_scaling`` wins, as in transformers."""
    params: Any = d.get("rope_scaling") or d.get("rope_parameters") or {}
    if not isinstance(params, Mapping):
        raise ValueError(f"rope_scaling/rope_parameters must be a dict, got {params!r}")
    if isinstance(params.get("full_attention"), Mapping):  # nested by layer type
        others = [k for k in params if k != "full_attention"]
        if others:
            raise ValueError(f"unsupported per-layer-type RoPE parameters for {others!r}")
        params = params["full_attention"]
    theta = params.get("rope_theta", d.get("rope_theta"))
    if theta is None:
        theta = _DEFAULT_ROPE_THETA
    partial = params.get("partial_rotary_factor", d.get("partial_rotary_factor"))
    if partial is not None and partial != 1.0:
        raise ValueError(f"unsupported: partial_rotary_factor={partial!r}")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type not in ROPE_TYPES:
        raise ValueError(
            f"unsupported RoPE scaling type {rope_type!r} (supported: default, "
            f"{', '.join(ROPE_TYPES)})"
        )
    omp = params.get("original_max_position_embeddings")
    factor = params.get("factor")
    if factor is None and rope_type == "yarn" and omp:
        max_pos = d.get("max_position_embeddings")
        if max_pos:
            factor = max_pos / omp  # transformers' rule for yarn without a factor
    if factor is None:
        raise ValueError(f"rope scaling {rope_type!r} lacks 'factor'")
    kwargs: dict[str, Any] = {
        "rope_type": rope_type,
        "factor": factor,
        "original_max_position_embeddings": omp,
    }
    if rope_type == "llama3":
        kwargs["low_freq_factor"] = params.get("low_freq_factor")
        kwargs["high_freq_factor"] = params.get("high_freq_factor")
    if rope_type == "yarn":
        # transformers reads ``beta_* or default``: a 0 or null also means the default
        kwargs["beta_fast"] = params.get("beta_fast") or 32.0
        kwargs["beta_slow"] = params.get("beta_slow") or 1.0
        kwargs["attention_factor"] = params.get("attention_factor")
        kwargs["mscale"] = params.get("mscale")
        kwargs["mscale_all_dim"] = params.get("mscale_all_dim")
        kwargs["truncate"] = params.get("truncate", True)
    return theta, RopeScaling(**kwargs)
