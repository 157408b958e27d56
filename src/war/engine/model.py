"""The decoder-only language model (Llama / Qwen2 / Qwen3) of the engine.

Knows: how embeddings, decoder layers (attention + SwiGLU MLP with pre-RMSNorm and
residuals), the final norm and the LM head are stacked; parameter names equal to
Hugging Face's so that ``state_dict()`` is a checkpoint; a dense causal forward
(training, reference) and a paged forward over a ``KVCache`` (the engine's), and
in-place weight updates with name/shape validation. Does not know files (see
``loader.py``), which slots a sequence owns, nor sampling.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import cast

import torch
from torch import Tensor, nn

from war.engine.attention import Attention, ForwardBatch, KVCache, PagedPlan, plan_paged
from war.engine.layers import MLP, RMSNorm, RotaryEmbedding
from war.engine.model_config import ModelConfig

# Tensors some checkpoints carry that hold nothing a model needs.
_DERIVED_SUFFIXES = ("rotary_emb.inv_freq",)
_LM_HEAD = "lm_head.weight"


class DecoderLayer(nn.Module):
    """``h + attn(norm(h))``, then ``h + mlp(norm(h))``."""

    def __init__(self, config: ModelConfig, *, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        self.self_attn = Attention(config, dtype=dtype, device=device)
        self.mlp = MLP(config.hidden_size, config.intermediate_size, dtype=dtype, device=device)
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps, dtype=dtype, device=device)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, dtype=dtype,
                                                device=device)

    def forward_dense(self, h: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        h = h + self.self_attn.forward_dense(self.input_layernorm(h), cos, sin)
        out: Tensor = h + self.mlp(self.post_attention_layernorm(h))
        return out

    def forward_paged(self, h: Tensor, cos: Tensor, sin: Tensor, plan: PagedPlan,
                      k_cache: Tensor, v_cache: Tensor) -> Tensor:
        h = h + self.self_attn.forward_paged(self.input_layernorm(h), cos, sin, plan,
                                             k_cache, v_cache)
        out: Tensor = h + self.mlp(self.post_attention_layernorm(h))
        return out


class DecoderModel(nn.Module):
    """Embeddings, the decoder layers and the final norm (HF's ``model.`` prefix)."""

    def __init__(self, config: ModelConfig, *, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, dtype=dtype,
                                         device=device)
        self.layers = nn.ModuleList(
            DecoderLayer(config, dtype=dtype, device=device)
            for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype, device=device)

    def decoder_layers(self) -> Iterator[DecoderLayer]:
        for layer in self.layers:
            yield cast(DecoderLayer, layer)


class CausalLM(nn.Module):
    """A causal language model whose ``state_dict()`` names match Hugging Face's.

    With ``tie_word_embeddings`` there is no ``lm_head``: logits use the embedding
    matrix. Logits come back in the model's dtype.
    """

    def __init__(self, config: ModelConfig, *, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        if dtype not in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
            raise ValueError(f"unsupported model dtype {dtype}")
        self.config = config
        self.model = DecoderModel(config, dtype=dtype, device=device)
        self.lm_head: nn.Linear | None = None
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False,
                                     dtype=dtype, device=device)
        self.rotary = RotaryEmbedding(config)

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    def _logits(self, h: Tensor) -> Tensor:
        if self.lm_head is None:
            return torch.nn.functional.linear(h, self.model.embed_tokens.weight)
        out: Tensor = self.lm_head(h)
        return out

    # ---- forward -----------------------------------------------------------------

    def forward_dense(self, input_ids: Tensor) -> Tensor:
        """Logits ``[B, T, V]`` of ``input_ids[B, T]`` (positions 0..T-1, causal, no cache)."""
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [B, T], got shape {tuple(input_ids.shape)}")
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        cos, sin = self.rotary.cos_sin(positions, self.dtype)
        h = self.model.embed_tokens(input_ids)
        for layer in self.model.decoder_layers():
            h = layer.forward_dense(h, cos, sin)
        return self._logits(self.model.norm(h))

    def forward(self, batch: ForwardBatch, kv: KVCache) -> Tensor:
        """Logits ``[M, V]`` of the ``batch.logits_index`` tokens; writes the new K/V to ``kv``.

        Runs without autograd. See ``attention.build_batch`` for the batch.
        """
        self._check_cache(kv)
        with torch.no_grad():
            plan = plan_paged(batch, self.config.num_kv_groups)
            plan.gather = kv.gather_buffers(plan.max_gathered_slots)
            cos, sin = self.rotary.cos_sin(batch.positions, self.dtype)
            h = self.model.embed_tokens(batch.input_ids)
            for i, layer in enumerate(self.model.decoder_layers()):
                h = layer.forward_paged(h, cos, sin, plan, kv.k[i], kv.v[i])
            h = h.index_select(0, batch.logits_index)
            return self._logits(self.model.norm(h))

    def _check_cache(self, kv: KVCache) -> None:
        c = self.config
        if (kv.num_layers, kv.num_kv_heads, kv.head_dim) != (
                c.num_hidden_layers, c.num_key_value_heads, c.head_dim):
            raise ValueError(
                f"KV cache shaped for {kv.num_layers} layers x {kv.num_kv_heads} heads x "
                f"{kv.head_dim}, model needs {c.num_hidden_layers} x {c.num_key_value_heads} "
                f"x {c.head_dim}"
            )
        if kv.dtype != self.dtype or kv.device != self.device:
            raise ValueError(
                f"KV cache is {kv.dtype} on {kv.device}, model is {self.dtype} on {self.device}"
            )

    # ---- weights -----------------------------------------------------------------

    def check_weights(self, shapes: Mapping[str, Sequence[int]], *,
                      strict: bool = True) -> set[str]:
        """Validate checkpoint tensor names and shapes against the parameters.

        Returns the names to skip: derived buffers (``*.rotary_emb.inv_freq``) and
        ``lm_head.weight`` of a tied model (it is the embedding matrix). Raises
        ``ValueError`` naming unexpected tensors, wrong shapes and (``strict``)
        missing parameters.
        """
        params = {name: tuple(p.shape) for name, p in self.named_parameters()}
        skip = {n for n in shapes if n.endswith(_DERIVED_SUFFIXES)}
        if self.config.tie_word_embeddings and _LM_HEAD in shapes:
            skip.add(_LM_HEAD)
        unexpected = sorted(n for n in shapes if n not in params and n not in skip)
        if unexpected:
            raise ValueError(f"unexpected tensors: {_names(unexpected)}")
        wrong = [
            f"{n}: got {tuple(s)}, expected {params[n]}"
            for n, s in shapes.items() if n in params and tuple(s) != params[n]
        ]
        if wrong:
            raise ValueError(f"tensors with wrong shapes: {'; '.join(wrong[:8])}"
                             + (f" (and {len(wrong) - 8} more)" if len(wrong) > 8 else ""))
        if strict:
            missing = sorted(n for n in params if n not in shapes)
            if missing:
                raise ValueError(f"missing tensors: {_names(missing)}")
        return skip

    def load_weights(self, state_dict: Mapping[str, Tensor], *, strict: bool = True) -> None:
        """Copy ``state_dict`` into the parameters in place (cast to their dtype and device).

        Everything is validated (``check_weights``, and every value is a floating-point
        tensor with data) before anything is copied. With
        ``strict=False`` a subset of the parameters may be given (chunked updates).
        """
        # checked first: ``copy_`` would raise on such a value after copying earlier ones
        odd = sorted(n for n, t in state_dict.items()
                     if not isinstance(t, Tensor) or not t.is_floating_point() or t.is_meta)
        if odd:
            raise ValueError(f"values that are not floating-point tensors with data: "
                             f"{_names(odd)}")
        skip = self.check_weights({n: t.shape for n, t in state_dict.items()}, strict=strict)
        params = dict(self.named_parameters())
        with torch.no_grad():
            for name, tensor in state_dict.items():
                if name not in skip:
                    params[name].copy_(tensor)


def _names(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" (and {len(names) - limit} more)" if len(names) > limit else "")
