"""Training a byte-level BPE tokenizer and saving it as a Hugging Face folder.

Knows: the ``tokenizers`` library's BPE trainer (byte-level pre-tokenization, so
every string round-trips), the special tokens of ChatML (``<|im_start|>``,
``<|im_end|>``) and ``<|endoftext|>``, which get the lowest ids in the order
given, and the two files a Hugging Face tokenizer folder needs
(``tokenizer.json`` and a minimal ``tokenizer_config.json`` with a ChatML chat
template). Does not know where the texts come from or what model uses the
tokenizer.

Reproducibility: the trainer is deterministic for the same texts in the same
order and the same config (ties between equally frequent pairs are broken by the
pair's ids), whatever the number of threads it counts with.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)

# The usual ChatML template (Qwen-style), so that transformers' `apply_chat_template`
# renders conversations the way `war.spec.traces.render` does.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@dataclass(frozen=True)
class TokenizerConfig:
    """Settings of a BPE tokenizer; validated on construction.

    * ``vocab_size``: tokens in the final vocabulary, special tokens and the 256
      byte symbols included.
    * ``min_frequency``: a pair must occur this often to be merged.
    * ``special_tokens``: added first (ids ``0..``), never split, matched in text.
    * ``model_max_length``: written to ``tokenizer_config.json`` (informative).
    """

    vocab_size: int = 4096
    min_frequency: int = 2
    special_tokens: tuple[str, ...] = SPECIAL_TOKENS
    model_max_length: int = 2048

    def __post_init__(self) -> None:
        for name in ("vocab_size", "min_frequency", "model_max_length"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if not isinstance(self.special_tokens, tuple):  # a str would be split into letters
            raise ValueError(f"special_tokens must be a tuple of strings, "
                             f"got {self.special_tokens!r}")
        if self.vocab_size < 256 + len(self.special_tokens):
            raise ValueError(
                f"vocab_size must hold the 256 bytes and {len(self.special_tokens)} special "
                f"tokens, got {self.vocab_size}"
            )
        for tok in self.special_tokens:  # (before the set below: a list is not hashable)
            if not isinstance(tok, str) or not tok:
                raise ValueError(f"special tokens must be non-empty strings, got {tok!r}")
        if len(set(self.special_tokens)) != len(self.special_tokens):
            raise ValueError(f"special_tokens has duplicates: {self.special_tokens!r}")


def train_tokenizer(texts: Iterable[str], config: TokenizerConfig | None = None) -> Tokenizer:
    """A byte-level BPE tokenizer fitted to ``texts``.

    Special tokens inside the texts are not counted by the trainer (each is read as a
    newline), so no merge learns their pieces; they encode as their single ids afterwards.
    """
    if isinstance(texts, str):  # its letters would be the texts: nothing to merge
        raise ValueError("texts must be an iterable of strings, not one string")
    cfg = config if config is not None else TokenizerConfig()
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=cfg.vocab_size,
        min_frequency=cfg.min_frequency,
        special_tokens=list(cfg.special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_strip_specials(texts, cfg.special_tokens), trainer=trainer)
    return tokenizer


def _strip_specials(texts: Iterable[str], specials: tuple[str, ...]) -> Iterable[str]:
    """Texts with special tokens replaced by a newline, so that no merge learns the
    pieces of a special token (it always encodes as one id anyway)."""
    for text in texts:
        for tok in specials:
            if tok in text:
                text = text.replace(tok, "\n")
        yield text


def save_tokenizer(
    tokenizer: Tokenizer, folder: str | os.PathLike[str], config: TokenizerConfig | None = None
) -> Path:
    """Writes ``tokenizer.json`` and a minimal ``tokenizer_config.json`` into ``folder``
    (created if missing); returns the path of ``tokenizer.json``."""
    cfg = config if config is not None else TokenizerConfig()
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "tokenizer.json"
    tokenizer.save(os.fspath(path))
    specials = [t for t in cfg.special_tokens if tokenizer.token_to_id(t) is not None]
    meta: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": cfg.model_max_length,
        "bos_token": None,
        "eos_token": IM_END if IM_END in specials else None,
        "pad_token": ENDOFTEXT if ENDOFTEXT in specials else None,
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "added_tokens_decoder": {
            str(tokenizer.token_to_id(t)): {
                "content": t, "lstrip": False, "rstrip": False, "normalized": False,
                "single_word": False, "special": True,
            }
            for t in specials
        },
        "chat_template": CHATML_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    return path
