"""Fixtures shared by test folders: a tiny random chat policy saved as a Hugging Face
folder (GPT-2 tokenizer with the ChatML markers, a one-layer llama of random
weights), for tests that run rollouts, replicas or benchmarks end to end."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from war.data import gpt2_tokenizer_json
from war.engine.loader import init_random, save_model
from war.engine.model_config import ModelConfig


def write_random_policy(folder: Path, seed: int = 0) -> Path:
    """Saves the tiny random policy into ``folder`` (created if missing); returns it."""
    folder.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer.from_str(gpt2_tokenizer_json())
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    tok.save(str(folder / "tokenizer.json"))
    cfg = ModelConfig.from_dict({
        "model_type": "llama", "vocab_size": tok.get_vocab_size(), "hidden_size": 32,
        "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
        "num_key_value_heads": 1, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0, "tie_word_embeddings": True})
    save_model(init_random(cfg, seed=seed), folder)
    return folder


@pytest.fixture(scope="session")
def random_policy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random policy (seed 0), saved once per test session."""
    return write_random_policy(tmp_path_factory.mktemp("random-policy"))


@pytest.fixture
def make_random_policy() -> Callable[[Path, int], Path]:
    """``write_random_policy`` (another seed, or a folder of the test's own)."""
    return write_random_policy
