"""Small, generic training utilities: a byte-level BPE tokenizer trainer and a
causal language-model trainer for tiny models on CPU.

Knows: how to fit a tokenizer to texts and a model to a token stream,
reproducibly from a seed. Does not know the engine's internals (a model is any
``torch.nn.Module`` with ``forward_dense``), traces or benchmarks.
"""

from war.train.lm import TrainConfig, TrainLog, TrainResult, train_lm
from war.train.tokenizer import SPECIAL_TOKENS, TokenizerConfig, save_tokenizer, train_tokenizer

__all__ = [
    "SPECIAL_TOKENS",
    "TokenizerConfig",
    "TrainConfig",
    "TrainLog",
    "TrainResult",
    "save_tokenizer",
    "train_lm",
    "train_tokenizer",
]
