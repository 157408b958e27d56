"""Suffix-tree speculation (SuffixDecoding): model-free drafts from earlier trajectories.

Knows: token-id sequences, suffix trees, drafts and their probabilities. Does not
know: models, logits, HTTP. ``tree.py`` is the only module that imports the native
core; ``reference.py`` is a slow pure-Python twin used by the tests.
"""

from war.spec.config import SpecConfig
from war.spec.speculator import SuffixSpeculator
from war.spec.tree import SpecResult, SuffixTree

__all__ = ["SpecConfig", "SpecResult", "SuffixSpeculator", "SuffixTree"]
