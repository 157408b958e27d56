"""Unusual inputs of the trainers and of the policy's folder (a review's findings)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import pytest
from test_policy import TINY as POLICY_TINY

from war.engine.loader import load_model
from war.train import TokenizerConfig, train_tokenizer
from war.train.policy import (
    check_policy_out,
    train_policy,
    train_policy_tokenizer,
)

TINY = dataclasses.replace(POLICY_TINY, steps=2)


def test_a_policy_folder_with_the_longest_name_is_written_and_replaced(tmp_path: Path) -> None:
    # the check passes for such a name: the temporary folder beside it must fit too, or
    # the trained model is lost after training
    out = tmp_path / ("p" * 250)
    check_policy_out(out)
    train_policy(TINY, out)
    train_policy(TINY, out)
    load_model(out)
    assert [p.name for p in tmp_path.iterdir()] == [out.name]


def test_an_out_name_too_long_is_a_value_error_naming_it(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"out_dir .*x{10}"):
        check_policy_out(tmp_path / ("x" * 300))


@pytest.mark.parametrize("specials", [("<|a|>", ["<|b|>"]), ({"<|a|>": 1},)])
def test_unhashable_special_tokens_are_a_value_error(specials: tuple[object, ...]) -> None:
    with pytest.raises(ValueError, match="special tokens must be non-empty strings"):
        TokenizerConfig(special_tokens=specials)  # type: ignore[arg-type]


@pytest.mark.parametrize("train", [train_tokenizer, train_policy_tokenizer])
def test_a_single_string_is_not_taken_for_a_list_of_texts(
        train: Callable[[str, TokenizerConfig], object]) -> None:
    # iterating it would train on its letters, one text each: no merge at all
    with pytest.raises(ValueError, match="texts"):
        train("hello world " * 50, TokenizerConfig(vocab_size=300, min_frequency=1))
