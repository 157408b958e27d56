"""Tests of ``war.engine.sampling``: the temperature/top-k/top-p distribution on hand-made
logits with exact expected values, greedy ties, per-row parameters, the inverse-CDF draw,
seeded generators, raw logprobs, and ``SamplingParams`` validation.

Knows: the documented semantics of ``sampling_probs`` and ``sample_batch``. Does not
know: drafts and their verification (``test_verify.py``).
"""

from __future__ import annotations

import math

import pytest
import torch

from war.engine import sampling
from war.engine.sampling import (
    make_generator,
    raw_logprobs,
    sample_batch,
    sample_from_probs,
    sampling_probs,
    sampling_probs_rows,
)
from war.types import SamplingParams

P1234 = [0.1, 0.2, 0.3, 0.4]


def logits_of(probs: list[float]) -> torch.Tensor:
    return torch.tensor([[math.log(p) for p in probs]], dtype=torch.float64)


def assert_probs(actual: torch.Tensor, expected: list[float]) -> None:
    assert actual.dtype == torch.float64
    torch.testing.assert_close(actual, torch.tensor([expected], dtype=torch.float64),
                               rtol=0, atol=1e-12)


def test_plain_softmax() -> None:
    assert_probs(sampling_probs(logits_of(P1234), SamplingParams()), P1234)


def test_temperature() -> None:
    # logits log(1), log(2), log(4): at temperature 2 the weights are 1, sqrt 2, 2.
    logits = logits_of([1 / 7, 2 / 7, 4 / 7])
    z = 3 + math.sqrt(2)
    assert_probs(sampling_probs(logits, SamplingParams(temperature=2.0)),
                 [1 / z, math.sqrt(2) / z, 2 / z])
    # At temperature 0.5 the weights are squared: 1, 4, 16.
    assert_probs(sampling_probs(logits, SamplingParams(temperature=0.5)),
                 [1 / 21, 4 / 21, 16 / 21])


def test_top_k() -> None:
    assert_probs(sampling_probs(logits_of(P1234), SamplingParams(top_k=2)), [0, 0, 3 / 7, 4 / 7])
    assert_probs(sampling_probs(logits_of(P1234), SamplingParams(top_k=1)), [0, 0, 0, 1])
    # k >= V is no truncation.
    assert_probs(sampling_probs(logits_of(P1234), SamplingParams(top_k=4)), P1234)
    assert_probs(sampling_probs(logits_of(P1234), SamplingParams(top_k=9)), P1234)


def test_top_k_keeps_ties_with_the_kth() -> None:
    logits = torch.tensor([[0.0, 1.0, 1.0, 2.0]])
    e = math.e
    z = 2 * e + e * e
    assert_probs(sampling_probs(logits, SamplingParams(top_k=2)), [0, e / z, e / z, e * e / z])


def test_top_p() -> None:
    # Sorted: 0.4, 0.3, 0.2, 0.1; the mass before them: 0, 0.4, 0.7, 0.9.
    assert_probs(sampling_probs(logits_of(P1234), SamplingParams(top_p=0.5)),
                 [0, 0, 3 / 7, 4 / 7])
    assert_probs(sampling_probs(logits_of(P1234), SamplingParams(top_p=0.05)), [0, 0, 0, 1])
    assert_probs(sampling_probs(logits_of(P1234), SamplingParams(top_p=0.75)),
                 [0, 2 / 9, 3 / 9, 4 / 9])
    assert_probs(sampling_probs(logits_of(P1234), SamplingParams(top_p=0.95)), P1234)


def test_top_p_ties_are_broken_by_token() -> None:
    logits = torch.tensor([[0.0, 1.0, 0.0, 1.0]])
    assert_probs(sampling_probs(logits, SamplingParams(top_p=0.3)), [0, 1, 0, 0])
    e = math.e
    # Before each (sorted: 1, 3, 0, 2): 0, 0.37, 0.73, 0.87.
    assert_probs(sampling_probs(logits, SamplingParams(top_p=0.8)),
                 [1 / (2 * e + 1), e / (2 * e + 1), 0, e / (2 * e + 1)])


def test_top_p_applies_to_the_top_k_renormalized_distribution() -> None:
    # top-k 3: 2/9, 3/9, 4/9. 4/9 >= 0.42 closes the nucleus at one token, although the
    # untruncated 0.4 would not.
    assert_probs(sampling_probs(logits_of(P1234), SamplingParams(top_k=3, top_p=0.42)),
                 [0, 0, 0, 1])
    assert_probs(sampling_probs(logits_of(P1234), SamplingParams(top_k=3, top_p=0.5)),
                 [0, 0, 3 / 7, 4 / 7])


def test_temperature_then_top_p() -> None:
    # At temperature 0.5: 1/30, 4/30, 9/30, 16/30 (before them: 0, 16/30, 25/30).
    p = sampling_probs(logits_of(P1234), SamplingParams(temperature=0.5, top_p=0.6))
    assert_probs(p, [0, 0, 9 / 25, 16 / 25])


def test_greedy_is_one_hot_with_lowest_index_ties() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0, 3.0], [5.0, 5.0, 5.0, 5.0], [-1.0, -2.0, 0.0, -3.0]])
    p = sampling_probs(logits, SamplingParams(temperature=0.0, top_k=3, top_p=0.5))
    torch.testing.assert_close(p, torch.tensor(
        [[0, 1, 0, 0], [1, 0, 0, 0], [0, 0, 1, 0]], dtype=torch.float64))


@pytest.mark.parametrize("temperature", [1e-310, 5e-324, 1e-201])
def test_a_vanishing_temperature_is_greedy(temperature: float) -> None:
    # logits / 1e-310 overflow to inf and softmax gives NaN; the limit is greedy.
    logits = torch.tensor([[1.0, 3.0, 2.0, 3.0], [-5.0, -7.0, -6.0, -9.0]])
    params = SamplingParams(temperature=temperature, top_k=2, top_p=0.5)
    p = sampling_probs(logits, params)
    torch.testing.assert_close(p, torch.tensor([[0, 1, 0, 0], [1, 0, 0, 0]],
                                               dtype=torch.float64))
    gens = [torch.Generator().manual_seed(i) for i in range(2)]
    assert sample_batch(logits, [params] * 2, gens).tokens == (1, 0)
    # From the floor up the temperature divides as always: tied maxima share the mass.
    at = sampling_probs(logits, SamplingParams(temperature=sampling.MIN_TEMPERATURE))
    torch.testing.assert_close(at, torch.tensor([[0, 0.5, 0, 0.5], [1, 0, 0, 0]],
                                                dtype=torch.float64))


def test_rows_with_their_own_params_match_single_rows() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 3000, generator=gen) * 2
    params = [
        SamplingParams(),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.7, top_k=20),
        SamplingParams(top_p=0.9),
        SamplingParams(temperature=1.3, top_k=100, top_p=0.5),
        SamplingParams(top_p=0.999),
    ]
    batched = sampling_probs_rows(logits, params)
    for i, sp in enumerate(params):
        torch.testing.assert_close(batched[i], sampling_probs(logits[i : i + 1], sp)[0])
        assert float(batched[i].sum()) == pytest.approx(1.0, abs=1e-12)


@pytest.mark.parametrize("top_p", [0.01, 0.3, 0.9, 0.999])
@pytest.mark.parametrize("scale", [0.3, 3.0, 12.0])
def test_top_p_shortcut_keeps_the_full_sort_nucleus(
    monkeypatch: pytest.MonkeyPatch, top_p: float, scale: float
) -> None:
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(8, 5000, generator=gen) * scale
    logits[:, 100:140] = logits[:, 200:240]  # ties
    logits[0, :] = 0.0  # uniform
    fast = sampling_probs(logits, SamplingParams(top_p=top_p))
    monkeypatch.setattr(sampling, "_NUCLEUS_CANDIDATES", 10**9)
    full = sampling_probs(logits, SamplingParams(top_p=top_p))
    assert torch.equal(fast, full)


def test_inverse_cdf_draw() -> None:
    probs = torch.tensor([[0.25, 0.0, 0.5, 0.25, 0.0]] * 6, dtype=torch.float64)
    u = torch.tensor([0.0, 0.2499, 0.25, 0.7499, 0.75, 1 - 2**-53], dtype=torch.float64)
    assert sample_from_probs(probs, u).tolist() == [0, 0, 2, 2, 3, 3]
    # Unnormalized rows scale with their mass.
    assert sample_from_probs(probs * 3, u).tolist() == [0, 0, 2, 2, 3, 3]


def test_seeded_generators_are_deterministic() -> None:
    fallback = torch.Generator().manual_seed(5)
    logits = torch.randn(64, 50, generator=torch.Generator().manual_seed(2))
    params = [SamplingParams()] * 64

    def run(seed: int) -> tuple[int, ...]:
        gen = make_generator(seed, fallback)
        return sample_batch(logits, params, [gen] * 64).tokens

    assert run(123) == run(123)
    assert run(123) != run(124)
    assert run(2**70 + 3) == run(3)  # seeds are taken modulo 2**64
    assert run(-1) == run(2**64 - 1)


def test_fallback_stream() -> None:
    def draws(fallback_seed: int) -> list[list[float]]:
        fallback = torch.Generator().manual_seed(fallback_seed)
        gens = [make_generator(None, fallback) for _ in range(3)]
        return [torch.rand(4, generator=g).tolist() for g in gens]

    a, b = draws(9), draws(9)
    assert a == b
    assert a[0] != a[1] != a[2]
    assert draws(10) != a


def test_sample_batch() -> None:
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(5, 40, generator=gen)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(top_k=1),
        SamplingParams(top_k=3),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.5, top_p=0.2),
    ]
    sample_gen = make_generator(0, gen)
    out = sample_batch(logits.to(torch.bfloat16), params, [None, sample_gen, sample_gen, None,
                                                            sample_gen])
    lb = logits.to(torch.bfloat16)
    assert out.tokens[0] == int(lb[0].argmax())
    assert out.tokens[1] == int(lb[1].argmax())
    assert out.tokens[2] in lb[2].float().topk(3).indices.tolist()
    assert out.tokens[3] == int(lb[3].argmax())
    expected = torch.log_softmax(lb.float(), dim=-1)
    for i, (tok, lp) in enumerate(zip(out.tokens, out.logprobs, strict=True)):
        assert lp == pytest.approx(float(expected[i, tok]), abs=1e-6)
    with pytest.raises(ValueError, match="no generator"):
        sample_batch(logits, params, [None] * 5)


def test_sample_batch_frequencies() -> None:
    probs = [0.1, 0.2, 0.3, 0.4]
    n = 20000
    logits = logits_of(probs).float().expand(n, 4)
    gen = make_generator(11, torch.Generator())
    tokens = sample_batch(logits, [SamplingParams()] * n, [gen] * n).tokens
    counts = torch.bincount(torch.tensor(tokens), minlength=4).double() / n
    # Four standard deviations of a frequency at n = 20000 are below 0.014.
    torch.testing.assert_close(counts, torch.tensor(probs, dtype=torch.float64), rtol=0,
                               atol=0.014)


def test_raw_logprobs_are_log_softmax_of_the_unprocessed_logits() -> None:
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(7, 300, generator=gen) * 4
    tokens = torch.randint(0, 300, (7,), generator=gen)
    expected = torch.log_softmax(logits.double(), dim=-1)[torch.arange(7), tokens]
    got = raw_logprobs(logits, tokens.tolist())
    torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), expected, rtol=0,
                               atol=1e-5)
    # bfloat16 logits are promoted to float32 first.
    lb = logits.to(torch.bfloat16)
    expected_b = torch.log_softmax(lb.double(), dim=-1)[torch.arange(7), tokens]
    got_b = raw_logprobs(lb, tokens)
    torch.testing.assert_close(torch.tensor(got_b, dtype=torch.float64), expected_b, rtol=0,
                               atol=1e-5)
    with pytest.raises(ValueError):
        raw_logprobs(logits, [1, 2])


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": -0.5},
        {"temperature": float("nan")},
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"top_k": -1},
        {"top_k": 2.0},
        {"max_tokens": 0},
        {"seed": 1.5},
    ],
)
def test_invalid_params_are_rejected(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)  # type: ignore[arg-type]
