"""The engine's model against transformers, and its config.json reading and writing."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from war.engine.attention import KVCache, SeqInput, build_batch
from war.engine.layers import rope_inv_freq
from war.engine.loader import init_random, load_model, save_model
from war.engine.model import CausalLM
from war.engine.model_config import ModelConfig, RopeScaling

BASE: dict[str, Any] = {
    "vocab_size": 160,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
}

CASES: dict[str, dict[str, Any]] = {
    "llama": {"model_type": "llama"},
    "llama-tied": {"model_type": "llama", "tie_word_embeddings": True},
    "llama-bias-mha": {"model_type": "llama", "attention_bias": True, "num_key_value_heads": 4},
    "llama-linear": {"model_type": "llama",
                     "rope_scaling": RopeScaling("linear", factor=2.5)},
    "llama-llama3-tied": {"model_type": "llama", "tie_word_embeddings": True,
                          "rope_scaling": RopeScaling("llama3", factor=8.0,
                                                      original_max_position_embeddings=32,
                                                      low_freq_factor=1.0, high_freq_factor=4.0)},
    "llama-yarn": {"model_type": "llama",
                   "rope_scaling": RopeScaling("yarn", factor=4.0,
                                               original_max_position_embeddings=64)},
    "qwen2": {"model_type": "qwen2", "attention_bias": True, "tie_word_embeddings": True},
    "qwen3": {"model_type": "qwen3", "head_dim": 24, "num_key_value_heads": 1},
}

PROMPT_LENS = (21, 13)


def _config(case: str) -> ModelConfig:
    return ModelConfig(**{**BASE, **CASES[case]})


def _prompts(vocab: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, vocab, (n,), generator=g) for n in PROMPT_LENS]


def _paged_prefill(model: CausalLM, prompts: list[torch.Tensor]) -> list[torch.Tensor]:
    """All prompts prefilled together in one step, in interleaved slots."""
    kv = KVCache.for_model(model.config, num_blocks=16, block_size=8, dtype=model.dtype)
    inputs = []
    for i, p in enumerate(prompts):
        n = p.shape[0]
        slots = [2 * j + i for j in range(n)]  # sequence i owns every other slot
        inputs.append(SeqInput(p.tolist(), list(range(n)), slots, (), None, n))
    logits = model.forward(build_batch(inputs, model.device, num_slots=kv.num_slots), kv)
    return list(logits.split([p.shape[0] for p in prompts]))


@pytest.fixture(scope="module")
def transformers_mod() -> Any:
    return pytest.importorskip("transformers")


def _hf_logits(transformers_mod: Any, folder: Path, prompts: list[torch.Tensor],
               dtype: torch.dtype) -> list[torch.Tensor]:
    hf = transformers_mod.AutoModelForCausalLM.from_pretrained(
        folder, dtype=dtype, attn_implementation="eager")
    hf.eval()
    with torch.no_grad():
        return [hf(p.unsqueeze(0)).logits[0] for p in prompts]


@pytest.mark.parametrize("case", list(CASES))
def test_matches_transformers_float32(case: str, tmp_path: Path, transformers_mod: Any) -> None:
    config = _config(case)
    model = init_random(config, seed=3)
    save_model(model, tmp_path)
    prompts = _prompts(config.vocab_size)
    want = _hf_logits(transformers_mod, tmp_path, prompts, torch.float32)

    loaded = load_model(tmp_path)
    assert loaded.config == config
    names = set(loaded.state_dict())
    assert ("lm_head.weight" in names) != config.tie_word_embeddings
    assert ("model.layers.0.self_attn.q_norm.weight" in names) == config.qk_norm
    assert ("model.layers.0.self_attn.q_proj.bias" in names) == config.attention_bias
    with torch.no_grad():
        for p, w in zip(prompts, want, strict=True):
            dense = loaded.forward_dense(p.unsqueeze(0))[0]
            torch.testing.assert_close(dense, w, atol=1e-5, rtol=0)
    for got, w in zip(_paged_prefill(loaded, prompts), want, strict=True):
        torch.testing.assert_close(got, w, atol=1e-5, rtol=0)
    # the logits are not trivially flat
    assert float(want[0].std(dim=-1).min()) > 1e-2


def test_rope_scaling_changes_the_model() -> None:
    plain = _config("llama")
    for case in ("llama-linear", "llama-llama3-tied", "llama-yarn"):
        inv_plain, _ = rope_inv_freq(plain)
        inv, attn = rope_inv_freq(_config(case))
        assert inv.shape == inv_plain.shape
        assert (inv != inv_plain).any() or attn != 1.0, case


def test_bfloat16_smoke(tmp_path: Path, transformers_mod: Any) -> None:
    config = _config("qwen3")
    save_model(init_random(config, seed=5), tmp_path)
    prompts = _prompts(config.vocab_size)
    ref = load_model(tmp_path)
    model = load_model(tmp_path, dtype=torch.bfloat16)
    assert model.dtype == torch.bfloat16
    want_hf = _hf_logits(transformers_mod, tmp_path, prompts, torch.bfloat16)
    with torch.no_grad():
        for p, paged, hf in zip(prompts, _paged_prefill(model, prompts), want_hf, strict=True):
            exact = ref.forward_dense(p.unsqueeze(0))[0]
            dense = model.forward_dense(p.unsqueeze(0))[0]
            for got in (dense, paged, hf):
                assert got.dtype == torch.bfloat16
                assert torch.isfinite(got).all()
                assert float((got.float() - exact).abs().max()) < 0.05
            assert float((dense.float() - hf.float()).abs().max()) < 0.03


# ---------------------------------------------------------------------------------
# config.json
# ---------------------------------------------------------------------------------


@pytest.mark.parametrize("case", list(CASES))
def test_config_round_trip(case: str, tmp_path: Path, transformers_mod: Any) -> None:
    config = _config(case)
    assert ModelConfig.from_dict(config.to_dict()) == config
    (tmp_path / "config.json").write_text(json.dumps(config.to_dict()))
    assert ModelConfig.from_file(tmp_path) == config
    # transformers reads what we write, and we read what it writes (new spelling)
    hf = transformers_mod.AutoConfig.from_pretrained(tmp_path)
    assert ModelConfig.from_dict(hf.to_dict()) == config


def test_config_defaults() -> None:
    d = {"model_type": "llama", "vocab_size": 10, "hidden_size": 32, "intermediate_size": 8,
         "num_hidden_layers": 1, "num_attention_heads": 4}
    c = ModelConfig.from_dict(d)
    assert (c.num_key_value_heads, c.head_dim, c.rope_theta) == (4, 8, 10000.0)
    assert c.rope_scaling is None and not c.attention_bias and not c.tie_word_embeddings
    assert c.max_position_embeddings == 2048 and c.eos_token_id == ()
    q2 = ModelConfig.from_dict({**d, "model_type": "qwen2", "attention_bias": False})
    assert q2.attention_bias and not q2.o_proj_bias  # qwen2 always has q/k/v biases
    q3 = ModelConfig.from_dict({**d, "model_type": "qwen3", "eos_token_id": [3, 4]})
    assert q3.head_dim == 128 and q3.qk_norm and q3.eos_token_id == (3, 4)
    assert ModelConfig.from_dict({**d, "eos_token_id": 2}).eos_token_id == (2,)
    lb = ModelConfig.from_dict({**d, "attention_bias": True})
    assert lb.attention_bias and lb.o_proj_bias


def test_config_rope_spellings() -> None:
    d = {"model_type": "llama", "vocab_size": 10, "hidden_size": 32, "intermediate_size": 8,
         "num_hidden_layers": 1, "num_attention_heads": 4, "max_position_embeddings": 4096}
    old = ModelConfig.from_dict({**d, "rope_theta": 5e5, "rope_scaling": {
        "type": "llama3", "factor": 8, "low_freq_factor": 1, "high_freq_factor": 4,
        "original_max_position_embeddings": 1024}})
    new = ModelConfig.from_dict({**d, "rope_parameters": {
        "rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1,
        "high_freq_factor": 4, "original_max_position_embeddings": 1024}})
    assert old == new and old.rope_theta == 5e5
    assert old.rope_scaling is not None and old.rope_scaling.factor == 8.0
    plain = ModelConfig.from_dict({**d, "rope_parameters": {"rope_type": "default",
                                                            "rope_theta": 1e6}})
    assert plain.rope_scaling is None and plain.rope_theta == 1e6
    nested = ModelConfig.from_dict({**d, "rope_parameters": {"full_attention": {
        "rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}})
    assert nested.rope_scaling == RopeScaling("linear", 2.0)
    yarn = ModelConfig.from_dict({**d, "rope_scaling": {
        "rope_type": "yarn", "original_max_position_embeddings": 1024}})
    assert yarn.rope_scaling is not None and yarn.rope_scaling.factor == 4.0
    defaulted = ModelConfig.from_dict({**d, "rope_scaling": {
        "rope_type": "llama3", "factor": 8, "low_freq_factor": 1, "high_freq_factor": 4}})
    assert defaulted.rope_scaling is not None
    assert defaulted.rope_scaling.original_max_position_embeddings == 4096


@pytest.mark.parametrize(("change", "message"), [
    ({"model_type": "gpt2"}, "gpt2"),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "dynamic"),
    ({"rope_scaling": {"rope_type": "longrope", "factor": 2.0}}, "longrope"),
    ({"rope_scaling": {"rope_type": "linear"}}, "factor"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "low_freq_factor"),
    ({"num_key_value_heads": 3}, "divisible"),
    ({"hidden_size": 30}, "divisible"),
    ({"hidden_size": 0}, "hidden_size"),
    ({"vocab_size": None}, "vocab_size"),
    ({"rms_norm_eps": -1.0}, "rms_norm_eps"),
    ({"hidden_act": "gelu"}, "gelu"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"use_sliding_window": True}, "sliding"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ({"tie_word_embeddings": "yes"}, "tie_word_embeddings"),
    ({"eos_token_id": [1, -2]}, "eos_token_id"),
])
def test_config_rejects(change: dict[str, Any], message: str) -> None:
    d = {"model_type": "llama", "vocab_size": 10, "hidden_size": 32, "intermediate_size": 8,
         "num_hidden_layers": 1, "num_attention_heads": 4, **change}
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dict(d)


def test_config_file_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        ModelConfig.from_file(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="JSON"):
        ModelConfig.from_file(tmp_path / "config.json")
