"""Sampling: the distribution a token is drawn from, drawing it, and raw logprobs.

Knows: how ``SamplingParams`` (temperature, top-k, top-p) turn rows of logits into the
distribution a token is drawn from (``sampling_probs``; float64, per-row parameters
allowed); how to draw from such rows with per-request CPU ``torch.Generator`` streams by
the inverse CDF (so a seed fixes the draws whatever device the logits live on); the raw
``log_softmax`` log-probabilities of the unprocessed logits, which RL training needs; one
decoding step's sampling for rows without drafts (``sample_batch``).

Does not know: speculative drafts (``war.engine.verify`` verifies them with the same
distributions and draws), stop conditions, which rows belong to which request, or where
the logits come from.

Semantics, in order, of ``sampling_probs`` for one row:

* temperature 0 (greedy): one-hot at the argmax of the raw logits (ties: lowest index);
  top-k and top-p are then moot. So is a temperature below ``MIN_TEMPERATURE`` (1e-200),
  the limit it is that close to: ``logits / temperature`` would overflow to inf there
  and softmax would be NaN;
* otherwise ``softmax(logits / temperature)``;
* top-k (``k > 0`` and ``k < V``): tokens whose probability is below the k-th largest are
  dropped (tokens tied with the k-th are kept, as in Hugging Face and vLLM), renormalized;
* top-p (``p < 1``): of the tokens sorted by descending probability (ties by ascending
  index), the smallest prefix whose mass reaches ``top_p`` of the (top-k renormalized)
  mass is kept, at least one token, renormalized.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from war.types import SamplingParams

_SEED_SPACE = 2**64
# Below this temperature a row is greedy. Above it logits / temperature stays finite in
# float64 for any float32 logit (3.4e38 / 1e-200 = 3.4e238), so every temperature that
# worked before gives the same bits; below it the quotient can overflow to inf.
MIN_TEMPERATURE = 1e-200
_FALLBACK_SEED_HIGH = 2**63 - 1


def make_generator(seed: int | None, fallback: torch.Generator) -> torch.Generator:
    """A per-request CPU random stream: seeded from ``seed``, or (``None``) from one draw of
    the engine's ``fallback`` stream (so an engine seeded once is reproducible too).

    Any Python int is a valid seed (it is taken modulo 2**64).
    """
    if seed is None:
        seed = int(
            torch.randint(
                0, _FALLBACK_SEED_HIGH, (1,), generator=fallback, device=fallback.device
            ).item()
        )
    gen = torch.Generator(device="cpu")
    gen.manual_seed(seed % _SEED_SPACE)
    return gen


def draw_uniforms(generator: torch.Generator, count: int) -> Tensor:
    """``count`` float64 uniforms in [0, 1) from ``generator`` (a CPU tensor)."""
    return torch.rand(count, generator=generator, dtype=torch.float64)


def _rows_index(rows: Sequence[int], device: torch.device) -> Tensor:
    return torch.tensor(rows, dtype=torch.long, device=device)


def _top_k(probs: Tensor, ks: Sequence[int]) -> Tensor:
    """Apply top-k to the rows whose ``ks`` entry is non-zero (in place on ``probs``)."""
    rows = [i for i, k in enumerate(ks) if k > 0]
    idx = _rows_index(rows, probs.device)
    sub = probs[idx]
    kk = torch.tensor([ks[i] for i in rows], dtype=torch.long, device=probs.device)
    top = sub.topk(max(ks), dim=-1).values
    threshold = top.gather(1, (kk - 1).unsqueeze(1))
    sub = torch.where(sub >= threshold, sub, 0.0)
    probs[idx] = sub / sub.sum(dim=-1, keepdim=True)
    return probs


_NUCLEUS_CANDIDATES = 1024  # top-p first looks for the nucleus among this many tokens


def _nucleus(values: Tensor, limit: Tensor) -> tuple[Tensor, Tensor]:
    """For rows of probabilities in descending order (ties by ascending token): the keep
    mask of the shortest prefix whose mass reaches ``limit`` (at least one), and the
    cumulative sums."""
    cum = values.cumsum(dim=-1)
    before = torch.cat([torch.zeros_like(cum[:, :1]), cum[:, :-1]], dim=-1)
    keep = before < limit  # a prefix: cum is non-decreasing
    keep[:, 0] = True
    return keep, cum


def _top_p(probs: Tensor, tops: Sequence[float]) -> Tensor:
    """Apply top-p to the rows whose ``tops`` entry is below 1 (in place on ``probs``).

    The nucleus is first sought among each row's ``_NUCLEUS_CANDIDATES`` most probable
    tokens (a partial top-k instead of a full sort); a row whose nucleus is not certainly
    inside them (it does not close there, or its last token ties with the smallest
    candidate) is sorted in full. Both paths keep the same tokens."""
    rows = [i for i, p in enumerate(tops) if p < 1.0]
    idx = _rows_index(rows, probs.device)
    sub = probs[idx]
    vocab = sub.shape[1]
    limit = torch.tensor([tops[i] for i in rows], dtype=probs.dtype, device=probs.device)
    limit = limit.unsqueeze(1) * sub.sum(dim=-1, keepdim=True)
    keep = torch.zeros_like(sub, dtype=torch.bool)
    todo = torch.ones(len(rows), dtype=torch.bool, device=probs.device)
    if vocab > _NUCLEUS_CANDIDATES:
        values, tokens = sub.topk(_NUCLEUS_CANDIDATES, dim=-1)
        by_token = tokens.argsort(dim=-1)  # then a stable sort by value: ties by token
        values, tokens = values.gather(1, by_token), tokens.gather(1, by_token)
        values, order = values.sort(dim=-1, descending=True, stable=True)
        tokens = tokens.gather(1, order)
        kept, cum = _nucleus(values, limit)
        last = (kept.sum(dim=-1) - 1).unsqueeze(1)
        closes = (cum.gather(1, last) >= limit).squeeze(1)
        clear = values.gather(1, last).squeeze(1) > values[:, -1]
        done = closes & clear
        keep = keep.scatter_(1, tokens, kept & done.unsqueeze(1))
        todo = ~done
    if vocab <= _NUCLEUS_CANDIDATES or bool(todo.any()):
        rest = todo.nonzero().squeeze(1)
        values, tokens = sub[rest].sort(dim=-1, descending=True, stable=True)
        kept, _ = _nucleus(values, limit[rest])
        keep[rest] = torch.zeros_like(kept).scatter_(1, tokens, kept)
    sub = torch.where(keep, sub, 0.0)
    probs[idx] = sub / sub.sum(dim=-1, keepdim=True)
    return probs


def sampling_probs_rows(logits: Tensor, params: Sequence[SamplingParams]) -> Tensor:
    """The float64 ``[n, V]`` distributions tokens are drawn from, row ``i`` under
    ``params[i]`` (see the module docstring). Vectorized: one softmax for all rows, one
    top-k and one sort for the rows that need them."""
    if logits.dim() != 2:
        raise ValueError(f"logits must be [n, V], got shape {tuple(logits.shape)}")
    n, vocab = logits.shape
    if len(params) != n:
        raise ValueError(f"{len(params)} params for {n} rows of logits")
    x = logits.to(torch.float64)
    cold = [p.temperature < MIN_TEMPERATURE for p in params]  # greedy rows (temperature 0 too)
    temps = [1.0 if g else p.temperature for g, p in zip(cold, params, strict=True)]
    if any(t != 1.0 for t in temps):
        x = x / torch.tensor(temps, dtype=torch.float64, device=x.device).unsqueeze(1)
    probs = torch.softmax(x, dim=-1)
    ks = [0 if g or p.top_k >= vocab else p.top_k for g, p in zip(cold, params, strict=True)]
    if any(k > 0 for k in ks):
        probs = _top_k(probs, ks)
    tops = [1.0 if g else p.top_p for g, p in zip(cold, params, strict=True)]
    if any(t < 1.0 for t in tops):
        probs = _top_p(probs, tops)
    greedy = [i for i, g in enumerate(cold) if g]
    if greedy:
        idx = _rows_index(greedy, logits.device)
        best = logits[idx].argmax(dim=-1)
        probs[idx] = torch.nn.functional.one_hot(best, vocab).to(torch.float64)
    return probs


def sampling_probs(logits: Tensor, params: SamplingParams) -> Tensor:
    """The float64 ``[n, V]`` distributions tokens are drawn from, every row under
    ``params`` (see the module docstring)."""
    if logits.dim() != 2:
        raise ValueError(f"logits must be [n, V], got shape {tuple(logits.shape)}")
    return sampling_probs_rows(logits, [params] * logits.shape[0])


def sample_from_probs(probs: Tensor, uniforms: Tensor) -> Tensor:
    """Inverse-CDF draw: for each row of ``probs`` (``[m, V]``, non-negative, not
    necessarily normalized) the token whose CDF interval holds ``uniforms[i]`` (in [0, 1))
    times the row's mass. Tokens of probability 0 are never drawn (given a positive row
    mass). Returns a ``[m]`` long tensor on ``probs``' device."""
    if probs.dim() != 2 or uniforms.shape != (probs.shape[0],):
        raise ValueError(
            f"probs must be [m, V] and uniforms [m], got {tuple(probs.shape)} and "
            f"{tuple(uniforms.shape)}"
        )
    cdf = probs.cumsum(dim=-1)
    total = cdf[:, -1:]
    target = uniforms.to(device=cdf.device, dtype=cdf.dtype).unsqueeze(1) * total
    # u < 1, but u * total may round up to total; the largest float below it stays inside
    # the last non-zero token's interval.
    target = torch.minimum(target, torch.nextafter(total, torch.zeros_like(total)))
    picked = torch.searchsorted(cdf, target, right=True).squeeze(1)
    return picked.clamp_(max=probs.shape[1] - 1)


def _raw_logprobs(logits: Tensor, token_ids: Tensor) -> Tensor:
    x = logits if logits.dtype == torch.float64 else logits.float()
    return x.log_softmax(dim=-1).gather(1, token_ids.reshape(-1, 1)).squeeze(1)


def raw_logprobs(logits: Tensor, token_ids: Sequence[int] | Tensor) -> list[float]:
    """``log_softmax(logits)[i, token_ids[i]]`` of the unprocessed logits (float32, or
    float64 for float64 logits): the model's own log-probabilities, which RL needs, not
    those of the temperature/top-k/top-p distribution the tokens were drawn from."""
    if logits.dim() != 2:
        raise ValueError(f"logits must be [n, V], got shape {tuple(logits.shape)}")
    ids = torch.as_tensor(token_ids, dtype=torch.long, device=logits.device).reshape(-1)
    if ids.shape[0] != logits.shape[0]:
        raise ValueError(f"{ids.shape[0]} token ids for {logits.shape[0]} rows of logits")
    values: list[float] = _raw_logprobs(logits, ids).tolist()
    return values


class Sampled(NamedTuple):
    """One token per row and its raw logprob (see ``raw_logprobs``)."""

    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]


def sample_batch(
    logits: Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> Sampled:
    """Sample one token from every row of ``logits`` (``[m, V]``): greedy rows take the
    argmax, the others draw one uniform from their generator (in row order, so one
    generator may serve several rows) and take the inverse-CDF token of
    ``sampling_probs``. Equals ``war.engine.verify.verify_tree`` with an empty draft, draw
    for draw. A greedy row's generator may be ``None``."""
    if logits.dim() != 2:
        raise ValueError(f"logits must be [m, V], got shape {tuple(logits.shape)}")
    m = logits.shape[0]
    if len(params) != m or len(generators) != m:
        raise ValueError(f"{len(params)} params and {len(generators)} generators for {m} rows")
    device = logits.device
    picked = torch.empty(m, dtype=torch.long, device=device)
    greedy = [i for i, p in enumerate(params) if p.greedy]
    if greedy:
        idx = _rows_index(greedy, device)
        picked[idx] = logits[idx].argmax(dim=-1)
    drawn = [i for i, p in enumerate(params) if not p.greedy]
    if drawn:
        uniforms = []
        for i in drawn:
            gen = generators[i]
            if gen is None:
                raise ValueError(f"row {i} samples (temperature > 0) but has no generator")
            uniforms.append(draw_uniforms(gen, 1))
        idx = _rows_index(drawn, device)
        probs = sampling_probs_rows(logits[idx], [params[i] for i in drawn])
        picked[idx] = sample_from_probs(probs, torch.cat(uniforms))
    logprobs: list[float] = _raw_logprobs(logits, picked).tolist()
    tokens: list[int] = picked.tolist()
    return Sampled(tuple(tokens), tuple(logprobs))
