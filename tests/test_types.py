"""`war.types`: the wire types refuse values of the wrong type with a ValueError naming
the field, and keep sequences as tuples."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

from war.types import GenRequest, SamplingParams


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"temperature": "1"}, "temperature"),
    ({"temperature": None}, "temperature"),
    ({"temperature": True}, "temperature"),
    ({"temperature": math.nan}, "temperature"),
    ({"temperature": math.inf}, "temperature"),
    ({"top_p": "1"}, "top_p"),
    ({"top_p": None}, "top_p"),
    ({"top_p": True}, "top_p"),
    ({"logprobs": "no"}, "logprobs"),
    ({"logprobs": None}, "logprobs"),
    ({"logprobs": -1}, "logprobs"),
    ({"stop_token_ids": 5}, "stop_token_ids"),
    ({"stop_token_ids": "12"}, "stop_token_ids"),
    ({"stop_token_ids": [1, "2"]}, "stop_token_ids"),
    ({"stop": "zs"}, "stop"),
    ({"stop": 3}, "stop"),
    ({"stop": ["a", ""]}, "stop"),
])
def test_sampling_params_refuse_wrong_types_naming_the_field(
        kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_a_plain_stop_string_is_refused_not_split_into_characters() -> None:
    with pytest.raises(ValueError, match=r"list or tuple of strings.*\('zs',\)"):
        SamplingParams(stop="zs")
    assert SamplingParams(stop=("zs",)).stop == ("zs",)


def test_sequences_given_as_lists_are_kept_as_tuples() -> None:
    sp = SamplingParams(stop_token_ids=[1, 2], stop=["x", "yz"])  # type: ignore[arg-type]
    assert sp.stop_token_ids == (1, 2) and sp.stop == ("x", "yz")
    assert hash(sp) == hash(SamplingParams(stop_token_ids=(1, 2), stop=("x", "yz")))
    gen = SamplingParams(stop_token_ids=(t for t in (3, 4)))  # type: ignore[arg-type]
    assert gen.stop_token_ids == (3, 4)


def test_good_values_are_kept_as_given() -> None:
    sp = SamplingParams(temperature=0, top_p=1, logprobs=False)
    assert sp.greedy and sp.top_p == 1 and sp.logprobs is False
    assert SamplingParams(logprobs=2).logprobs == 2  # an OpenAI-style count
    assert SamplingParams(temperature=0.7, top_p=0.9).temperature == 0.7


@pytest.mark.parametrize("priority", ["high", None, True, math.nan, math.inf, -math.inf])
def test_gen_request_refuses_a_priority_that_is_not_a_finite_number(priority: Any) -> None:
    # the engine's admission computes -priority after registering the request
    with pytest.raises(ValueError, match="priority"):
        GenRequest("r", (1, 2), priority=priority)


def test_gen_request_takes_int_and_float_priorities() -> None:
    assert GenRequest("r", (1,), priority=3).priority == 3
    assert GenRequest("r", (1,), priority=-2.5).priority == -2.5
    assert GenRequest("r", (1,), priority=np.float32(0.5)).priority == 0.5  # a scorer's


@pytest.mark.parametrize("sampling", [None, {"temperature": 0.0}, "greedy"])
def test_gen_request_refuses_sampling_that_is_not_sampling_params(sampling: Any) -> None:
    with pytest.raises(ValueError, match="sampling must be a SamplingParams"):
        GenRequest("r", (1,), sampling=sampling)


@pytest.mark.parametrize("prompt_ids", [None, 5, "abc", b"ab"])
def test_gen_request_refuses_prompt_ids_that_are_not_a_sequence_of_ids(prompt_ids: Any) -> None:
    # None and ints raised TypeError from len(); a string passed as its characters
    with pytest.raises(ValueError, match="prompt_ids must be a sequence of token ids"):
        GenRequest("r", prompt_ids)
    assert list(GenRequest("r", [1, 2]).prompt_ids) == [1, 2]  # type: ignore[arg-type]


@pytest.mark.parametrize(("field", "value"), [
    ("trajectory_id", ""), ("trajectory_id", 7), ("group_id", ""), ("group_id", ("g",)),
    ("continues", "no"), ("continues", 1),
])
def test_gen_request_refuses_ids_and_flags_of_the_wrong_kind(field: str, value: Any) -> None:
    # an empty trajectory id with continues was refused only later, as UnknownTrajectory
    with pytest.raises(ValueError, match=field):
        GenRequest("r", (1,), **{"trajectory_id": "t", field: value})
    assert GenRequest("r", (1,), trajectory_id="t", group_id="g", continues=True).continues
