"""The tokenizer and language-model trainers on tiny inputs (seconds on a CPU)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from war.engine.loader import init_random
from war.engine.model_config import ModelConfig
from war.train import (
    SPECIAL_TOKENS,
    TokenizerConfig,
    TrainConfig,
    TrainLog,
    save_tokenizer,
    train_lm,
)
from war.train.tokenizer import train_tokenizer

TEXTS = [
    "<|im_start|>user\nBook a flight from SFO to JFK on 2024-05-01, please.<|im_end|>\n",
    "<|im_start|>assistant\n<tool_call>\n{\"name\": \"search\", \"arguments\": {}}\n</tool_call>"
    "<|im_end|>\n",
    "def f(x):\n    return x * 2  # doubles\n",
    "Ünïcödé ✓ and emoji 🚀 survive byte-level BPE.",
] * 20


def tiny_model(seed: int = 0, vocab: int = 32) -> torch.nn.Module:
    config = ModelConfig.from_dict({
        "model_type": "llama", "vocab_size": vocab, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 1, "num_attention_heads": 2, "max_position_embeddings": 64,
        "tie_word_embeddings": True,
    })
    return init_random(config, seed)


def test_tokenizer_round_trips_and_saves(tmp_path: Path) -> None:
    config = TokenizerConfig(vocab_size=320)
    tok = train_tokenizer(TEXTS, config)
    assert tok.get_vocab_size() <= 320
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS] == [0, 1, 2]
    for text in {*TEXTS, "never seen: \u03b6 \U0001d518 \t\r\n"}:
        ids = tok.encode(text).ids
        assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.encode("<|im_start|>assistant\n").ids[0] == 1  # a special token is one id
    path = save_tokenizer(tok, tmp_path / "hf", config)
    loaded = Tokenizer.from_file(str(path))
    assert loaded.encode(TEXTS[1]).ids == tok.encode(TEXTS[1]).ids
    meta = json.loads((tmp_path / "hf" / "tokenizer_config.json").read_text())
    assert meta["eos_token"] == "<|im_end|>"
    assert "<|im_start|>" in meta["chat_template"]


def test_tokenizer_training_is_reproducible() -> None:
    a = train_tokenizer(TEXTS, TokenizerConfig(vocab_size=300))
    b = train_tokenizer(TEXTS, TokenizerConfig(vocab_size=300))
    assert a.to_str() == b.to_str()


def test_tokenizer_config_is_validated() -> None:
    with pytest.raises(ValueError, match="vocab_size"):
        TokenizerConfig(vocab_size=100)
    with pytest.raises(ValueError, match="duplicates"):
        TokenizerConfig(special_tokens=("<a>", "<a>"))


def repetitive_stream(n: int = 2000) -> np.ndarray:
    return np.tile(np.arange(3, 19), n // 16)


@pytest.mark.parametrize("specials", ["<|endoftext|>", None, ["<|endoftext|>"]])
def test_special_tokens_not_a_tuple_are_refused(specials: object) -> None:
    with pytest.raises(ValueError, match="special_tokens must be a tuple of strings"):
        TokenizerConfig(special_tokens=specials)  # type: ignore[arg-type]


def test_training_lowers_the_loss() -> None:
    model = tiny_model()
    cfg = TrainConfig(seq_len=16, batch_size=8, steps=40, lr=1e-2, warmup_steps=4, log_every=10,
                      threads=1)
    logged: list[int] = []
    result = train_lm(model, repetitive_stream(), cfg, log=lambda p: logged.append(p.step))
    assert result.steps == 40 and result.stopped_by == "steps"
    assert logged == [10, 20, 30, 40]
    assert result.final_loss < 0.5 * result.first_loss
    assert not model.training


def test_same_seed_same_weights() -> None:
    cfg = TrainConfig(seq_len=16, batch_size=4, steps=5, warmup_steps=2, threads=1, seed=3)

    def trained(seed: int) -> dict[str, torch.Tensor]:
        model = tiny_model()
        train_lm(model, repetitive_stream(), dataclasses.replace(cfg, seed=seed))
        return model.state_dict()

    a, b, c = trained(3), trained(3), trained(4)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)


def test_time_budget_stops_training() -> None:
    ticks = iter(range(10**6))
    cfg = TrainConfig(seq_len=16, batch_size=2, steps=1000, time_budget_s=5.0, warmup_steps=0)
    result = train_lm(tiny_model(), repetitive_stream(), cfg, clock=lambda: float(next(ticks)))
    assert result.stopped_by == "time"
    assert 0 < result.steps < 10


def test_bad_input_is_rejected() -> None:
    with pytest.raises(ValueError, match="seq_len"):
        TrainConfig(seq_len=0)
    with pytest.raises(ValueError, match="autocast"):
        TrainConfig(autocast="int8")
    with pytest.raises(ValueError, match="seq_len 16 needs more"):
        train_lm(tiny_model(), np.arange(10), TrainConfig(seq_len=16))
    with pytest.raises(ValueError, match="vocabulary"):
        train_lm(tiny_model(vocab=8), repetitive_stream(), TrainConfig(seq_len=16, steps=1))
    with pytest.raises(ValueError, match="1-D"):
        train_lm(tiny_model(), np.zeros((4, 40), dtype=np.int64), TrainConfig(seq_len=16))


@pytest.mark.parametrize("field, value", [
    ("lr", "3e-3"), ("lr", True), ("min_lr_ratio", "0.1"), ("weight_decay", [0.1]),
    ("eps", "1e-8"), ("time_budget_s", "60"), ("grad_clip", "1.0"),
])
def test_settings_of_the_wrong_type_are_refused_naming_them(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=f"{field} must be a number"):
        TrainConfig(**{field: value})


@pytest.mark.parametrize("betas", [0.9, ("0.9", "0.95"), (0.9, None), [0.9, 0.95]])
def test_betas_not_two_numbers_are_refused(betas: object) -> None:
    with pytest.raises(ValueError, match="betas must be two numbers"):
        TrainConfig(betas=betas)  # type: ignore[arg-type]


@pytest.mark.parametrize("seed", [-1, 2**63, 2**64])
def test_seeds_numpy_and_torch_cannot_take_are_refused(seed: int) -> None:
    # refused by the config, not by numpy when the first batch is drawn
    with pytest.raises(ValueError, match=r"seed must be an int in \[0, 2\*\*63\)"):
        TrainConfig(seed=seed)
    assert TrainConfig(seed=2**63 - 1).seed == 2**63 - 1


def test_a_failed_run_leaves_the_model_in_eval_mode() -> None:
    model = tiny_model()

    def fail(_: TrainLog) -> None:
        raise RuntimeError("logging failed")

    with pytest.raises(RuntimeError, match="logging failed"):
        train_lm(model, repetitive_stream(), TrainConfig(seq_len=16, batch_size=2, steps=2,
                                                         log_every=1), log=fail)
    assert not model.training


def test_lr_schedule_warms_up_then_decays() -> None:
    cfg = TrainConfig(lr=1.0, warmup_steps=4, min_lr_ratio=0.1)
    assert cfg.lr_at(0.0, 0) == pytest.approx(0.25)
    assert cfg.lr_at(0.0, 4) == pytest.approx(1.0)
    assert cfg.lr_at(0.5, 100) == pytest.approx(0.55)
    assert cfg.lr_at(1.0, 1000) == pytest.approx(0.1)


def pairs_stream(n: int = 1000, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Pairs (x, x + 8): x is noise (mask 0), x + 8 follows from it (mask 1)."""
    x = np.random.default_rng(seed).integers(3, 11, size=n)
    stream = np.stack([x, x + 8], axis=1).reshape(-1)
    mask = np.tile(np.array([0, 1], dtype=np.uint8), n)
    return stream, mask


def test_loss_mask_learns_only_the_selected_tokens() -> None:
    stream, mask = pairs_stream()
    cfg = TrainConfig(seq_len=16, batch_size=8, steps=60, lr=1e-2, warmup_steps=4, threads=1)
    masked = train_lm(tiny_model(), stream, cfg, loss_mask=mask)
    assert masked.final_loss < 0.1  # the selected tokens are predictable
    full = train_lm(tiny_model(), stream, cfg)
    assert full.final_loss > 0.5  # the noise tokens are not


def test_loss_mask_of_ones_is_no_mask() -> None:
    cfg = TrainConfig(seq_len=16, batch_size=4, steps=5, warmup_steps=2, threads=1, seed=3)
    stream = repetitive_stream()
    a, b = tiny_model(), tiny_model()
    ra = train_lm(a, stream, cfg)
    rb = train_lm(b, stream, cfg, loss_mask=np.ones(len(stream), dtype=bool))
    assert rb.first_loss == pytest.approx(ra.first_loss, rel=1e-5)
    sa, sb = a.state_dict(), b.state_dict()
    assert all(torch.allclose(sa[k], sb[k], atol=1e-5) for k in sa)


def test_windows_start_where_told() -> None:
    seen: list[int] = []

    class Recorder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(64, 64)

        def forward_dense(self, ids: torch.Tensor) -> torch.Tensor:
            seen.extend(int(i) for i in ids[:, 0])
            out: torch.Tensor = self.emb(ids)
            return out

    stream = np.arange(60)  # token id == position
    starts = np.array([0, 10, 33])
    train_lm(Recorder(), stream, TrainConfig(seq_len=8, batch_size=4, steps=5, warmup_steps=0),
             window_starts=starts)
    assert set(seen) <= {0, 10, 33} and len(seen) == 20


def test_bad_mask_or_starts_are_rejected() -> None:
    stream = repetitive_stream()
    cfg = TrainConfig(seq_len=16, steps=1)
    with pytest.raises(ValueError, match="as long as"):
        train_lm(tiny_model(), stream, cfg, loss_mask=np.ones(5, dtype=np.uint8))
    with pytest.raises(ValueError, match="only 0 and 1"):
        train_lm(tiny_model(), stream, cfg, loss_mask=np.full(len(stream), 2))
    with pytest.raises(ValueError, match="0/1 integers or bools"):
        train_lm(tiny_model(), stream, cfg, loss_mask=np.ones(len(stream)))
    with pytest.raises(ValueError, match="selects no token"):
        train_lm(tiny_model(), stream, cfg, loss_mask=np.zeros(len(stream), dtype=bool))
    late = np.zeros(len(stream), dtype=bool)
    late[-1] = True
    with pytest.raises(ValueError, match="inside the windows"):
        train_lm(tiny_model(), stream, cfg, loss_mask=late, window_starts=np.array([0, 5]))
    with pytest.raises(ValueError, match="window_starts must lie"):
        train_lm(tiny_model(), stream, cfg, window_starts=np.array([len(stream) - 16]))
    with pytest.raises(ValueError, match="non-empty"):
        train_lm(tiny_model(), stream, cfg, window_starts=np.array([], dtype=np.int64))
