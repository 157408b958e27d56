"""Verifiable answer checking shared by the built-in environments.

Knows: where the answer sits in a final assistant message (after the last "answer is" or
"answer:", else the whole message, with ``<think>`` and ``<tool_call>`` blocks removed), how to
normalise a text answer (case, whitespace, surrounding quotes/markdown, trailing punctuation)
and how to compare numbers (the first number of the answer, thousands separators allowed,
relative tolerance 1e-6). Does not know tasks, environments or partial credit: a score is 0 or 1.
"""

from __future__ import annotations

import math
import re

_ANSWER = re.compile(r"\banswer\s*(?:is|:)\s*", re.IGNORECASE)
_NUMBER = re.compile(
    r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:[eE][-+]?\d+)?|[-+]?\.\d+(?:[eE][-+]?\d+)?"
)
_BLOCKS = re.compile(r"<think>.*?(?:</think>|$)|<tool_call>.*?(?:</tool_call>|$)", re.DOTALL)
_EDGE = " \t\n\"'`*"


def extract_answer(text: str) -> str:
    """The answer span of a final assistant message."""
    if not isinstance(text, str):
        raise ValueError(f"final answer must be a string, got {type(text).__name__}")
    text = _BLOCKS.sub(" ", text)
    matches = list(_ANSWER.finditer(text))
    if matches:
        text = text[matches[-1].end():]
    return text.strip()


def normalize_text(text: str) -> str:
    """Lower case, single spaces, without surrounding quotes/markdown or final punctuation."""
    text = " ".join(text.split()).lower().strip(_EDGE)
    return text.rstrip(".!;:,").strip(_EDGE)


def parse_number(text: str) -> float | None:
    """``text`` as a number when it is exactly one (``"1,234.5"`` -> 1234.5), else None."""
    text = text.strip()
    if not _NUMBER.fullmatch(text):
        return None
    return float(text.replace(",", ""))


def score_answer(final_answer: str, expected: str) -> float:
    """1.0 if ``final_answer``'s answer span matches ``expected``, else 0.0. A numeric
    ``expected`` is compared with the first number of the span; text is compared normalised."""
    if not isinstance(expected, str) or not expected.strip():
        raise ValueError(f"expected answer must be a non-empty string, got {expected!r}")
    candidate = extract_answer(final_answer)
    if not candidate:
        return 0.0
    target = parse_number(expected)
    if target is not None:
        found = _NUMBER.search(candidate)
        if found is None:
            return 0.0
        value = float(found.group().replace(",", ""))
        return 1.0 if math.isclose(value, target, rel_tol=1e-6, abs_tol=1e-9) else 0.0
    return 1.0 if normalize_text(candidate) == normalize_text(expected) else 0.0
