"""Tiny seeded models shared by the engine tests (a plain module, so that tests import
it by name; ``conftest.py`` wraps it in fixtures)."""

from __future__ import annotations

import torch

from war.engine.loader import init_random
from war.engine.model import CausalLM
from war.engine.model_config import ModelConfig

TINY = {
    "model_type": "llama",
    "vocab_size": 97,
    "hidden_size": 48,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}


def tiny_model(seed: int = 0, dtype: torch.dtype = torch.float64, **overrides: object) -> CausalLM:
    return init_random(ModelConfig.from_dict({**TINY, **overrides}), seed=seed, dtype=dtype)
