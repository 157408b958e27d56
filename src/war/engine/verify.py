"""Lossless verification of a deterministic speculative draft tree in one pass of logits.

Knows: how to walk a draft token tree against the target model's logits for the tree
(row 0: after the sequence's last real token; row ``1 + i``: after draft node ``i``) and
emit the accepted draft tokens plus exactly one token sampled from the target, so that the
emitted tokens are distributed exactly as non-speculative decoding with the same
``SamplingParams`` would produce them; the raw logprob of every emitted token; cutting
emitted tokens at a stop token or a length budget (``truncate``).

Does not know: where drafts come from, how the logits were computed (attention masks, KV
cache), detokenization and stop strings, or the request's bookkeeping.

The walk, at a node whose row gives the target distribution ``p`` (``sampling_probs``):

* greedy (temperature 0): ``t = argmax`` of the raw row; a child with token ``t`` is
  accepted and the walk moves to it; otherwise ``t`` is emitted and the walk stops. The
  output is exactly greedy decoding's.
* temperature > 0: one uniform ``u`` is drawn from the request's generator and the token
  ``y`` whose interval of the CDF of ``p`` holds it is taken (the inverse-CDF draw,
  exactly as non-speculative sampling draws its token); a child with token ``y`` is
  accepted and the walk moves to it, with the next uniform; otherwise ``y`` is emitted and
  the walk stops.

Why that is lossless: at every position the emitted token is ``y``, drawn from the target's
distribution ``p`` of that position by the inverse CDF, whatever the draft; the draft only
decides how many positions one forward pass settles (a child is accepted exactly when the
target's own draw equals it: with probability ``p(x)`` for child ``x``, the sum over
distinct siblings for a node with several, as for rejection sampling of deterministic
drafts). Given the next token, what follows is drawn from the row after it: the child's
row (the target's logits after exactly that path) when it was a draft node, otherwise
the next decoding step's. So the emitted sequence is distributed as non-speculative
sampling's. The drafts are deterministic (proposed without sampling); with randomly drawn
drafts their own distribution would enter and this rule would not be optimal.

Random draws: one uniform per emitted token, in order, from the request's generator (a
verification that accepts ``k`` draft nodes takes ``k + 1``); greedy takes none. A
non-speculative step takes one for its one token (``war.engine.sampling.sample_batch``),
so a seeded request emits the same tokens whatever its drafts, speculating or not, as long
as the logits are the same (float rounding of another batch shape may move a draw that
falls within rounding of an interval's edge). ``verify_tree`` and ``verify_batch`` make the
same choices from the same generator states.

Numerical guards: a token of probability 0 is never drawn (``sample_from_probs``), so
such a child is never accepted; a duplicated sibling is the same token, accepted as its
first occurrence.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple, TypeVar

import torch
from torch import Tensor

from war.engine.sampling import (
    draw_uniforms,
    raw_logprobs,
    sample_from_probs,
    sampling_probs,
    sampling_probs_rows,
)
from war.types import SamplingParams

_T = TypeVar("_T")


class Verified(NamedTuple):
    """The outcome of verifying one draft tree.

    ``accepted``: the accepted draft nodes' indices, root to leaf. ``tokens``: their tokens
    then exactly one more, sampled from the target (the correction or bonus token).
    ``logprobs[j]``: the raw model logprob (``log_softmax`` of the unprocessed logits) of
    ``tokens[j]`` in the row that predicted it.
    """

    accepted: tuple[int, ...]
    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]


class TreeRows(NamedTuple):
    """Where one sequence's tree sits in a step's logits: rows ``start .. start + n``
    (``n = len(draft_tokens)``), laid out as in ``verify_tree``. ``n = 0`` is plain
    decoding."""

    start: int
    draft_tokens: Sequence[int]
    parents: Sequence[int]


def _children(draft_tokens: Sequence[int], parents: Sequence[int], vocab: int) -> list[list[int]]:
    """``kids[row]``: the draft nodes predicted by logits row ``row`` (row 0: the roots; row
    ``1 + i``: node ``i``'s children), in draft order. Raises ``ValueError`` on a bad tree."""
    n = len(draft_tokens)
    if len(parents) != n:
        raise ValueError(f"{n} draft tokens but {len(parents)} parents")
    kids: list[list[int]] = [[] for _ in range(n + 1)]
    for i in range(n):
        tok, par = draft_tokens[i], parents[i]
        if not -1 <= par < i:
            raise ValueError(f"parents[{i}] = {par}: must be -1 or an earlier node")
        if not 0 <= tok < vocab:
            raise ValueError(f"draft token {tok} at node {i} is outside the vocabulary {vocab}")
        kids[par + 1].append(i)
    return kids


def _greedy_walk(
    kids: list[list[int]], tokens: Sequence[int], argmax: Callable[[int], int]
) -> tuple[list[int], int, int]:
    """Accepted nodes, the final row, and the token it emits."""
    accepted: list[int] = []
    row = 0
    while True:
        best = argmax(row)
        nxt = next((c for c in kids[row] if tokens[c] == best), -1)
        if nxt < 0:
            return accepted, row, best
        accepted.append(nxt)
        row = nxt + 1


def _shifted(values: list[_T], base: int) -> Callable[[int], _T]:
    """``i -> values[base + i]``."""
    return lambda i: values[base + i]


def _emitted(logits: Tensor, rows: Sequence[int], tokens: Sequence[int]) -> list[float]:
    """The raw logprob of ``tokens[j]`` in logits row ``rows[j]``."""
    index = torch.tensor(rows, dtype=torch.long, device=logits.device)
    return raw_logprobs(logits[index], tokens)


def verify_tree(
    logits: Tensor,
    draft_tokens: Sequence[int],
    parents: Sequence[int],
    params: SamplingParams,
    generator: torch.Generator | None = None,
) -> Verified:
    """Verify one draft tree (see the module docstring).

    ``logits``: ``[1 + n, V]``, row 0 after the sequence's last real token, row ``1 + i``
    after draft node ``i``. ``parents[i]``: ``-1`` for a root-level node, else an earlier
    node. Rows are processed lazily: only the rows the walk visits are softmaxed, so rows
    of unvisited nodes are never read. ``generator`` is needed unless ``params`` is greedy.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [1 + n, V], got shape {tuple(logits.shape)}")
    n = len(draft_tokens)
    if logits.shape[0] != n + 1:
        raise ValueError(f"{logits.shape[0]} rows of logits for a draft of {n} nodes")
    vocab = logits.shape[1]
    kids = _children(draft_tokens, parents, vocab)
    tokens = [int(t) for t in draft_tokens]
    if params.greedy:
        accepted, _, last = _greedy_walk(kids, tokens, lambda r: int(logits[r].argmax()))
    else:
        if generator is None:
            raise ValueError("a generator is needed when temperature > 0")
        accepted = []
        r = 0
        while True:  # (rows are softmaxed as the walk reaches them)
            probs = sampling_probs(logits[r : r + 1], params)
            y = int(sample_from_probs(probs, draw_uniforms(generator, 1))[0])
            nxt = next((c for c in kids[r] if tokens[c] == y), -1)
            if nxt < 0:
                last = y
                break
            accepted.append(nxt)
            r = nxt + 1
    emitted = [tokens[c] for c in accepted] + [last]
    rows = [0] + [c + 1 for c in accepted]
    return Verified(tuple(accepted), tuple(emitted), tuple(_emitted(logits, rows, emitted)))


def _sampled_walks(
    logits: Tensor,
    trees: Sequence[TreeRows],
    kids_of: Sequence[list[list[int]]],
    tokens_of: Sequence[list[int]],
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> list[tuple[list[int], int]]:
    """``verify_batch``'s temperature > 0 trees: (accepted nodes, last token) of each."""
    device = logits.device
    rows: list[int] = []
    row_params: list[SamplingParams] = []
    bases: list[int] = []  # tree j's row 0 is row bases[j] of ``probs``
    for tree, tokens, sp in zip(trees, tokens_of, params, strict=True):
        bases.append(len(rows))
        rows.extend(range(tree.start, tree.start + 1 + len(tokens)))
        row_params.extend([sp] * (1 + len(tokens)))
    probs = sampling_probs_rows(logits[torch.tensor(rows, device=device)], row_params)
    accepted_of: list[list[int]] = [[] for _ in trees]
    lasts: list[int] = [-1] * len(trees)
    at = [0] * len(trees)  # the row (of its own tree) each walk is at
    active = list(range(len(trees)))
    gens: list[torch.Generator] = []
    for gen in generators:
        if gen is None:
            raise ValueError("a tree samples (temperature > 0) but has no generator")
        gens.append(gen)
    while active:  # one position of every walk still going: one draw each, batched
        uniforms = torch.cat([draw_uniforms(gens[j], 1) for j in active])
        index = torch.tensor([bases[j] + at[j] for j in active], device=device)
        ys: list[int] = sample_from_probs(probs[index], uniforms).tolist()
        going = []
        for j, y in zip(active, ys, strict=True):
            tokens = tokens_of[j]
            nxt = next((c for c in kids_of[j][at[j]] if tokens[c] == y), -1)
            if nxt < 0:
                lasts[j] = y
                continue
            accepted_of[j].append(nxt)
            at[j] = nxt + 1
            going.append(j)
        active = going
    return list(zip(accepted_of, lasts, strict=True))


def verify_batch(
    logits: Tensor,
    trees: Sequence[TreeRows],
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> list[Verified]:
    """Verify one decoding step's trees at once: ``logits`` holds every sequence's rows
    (``trees[s]`` says where), ``params[s]`` and ``generators[s]`` are sequence ``s``'s.
    Makes the same choices as ``verify_tree`` on each tree separately (same draws from
    the same generator states, in sequence order), but with a handful of batched tensor
    operations and host transfers for the whole step instead of some per visited row.
    Every row of a sampled tree is softmaxed (cheap when batched)."""
    if logits.dim() != 2:
        raise ValueError(f"logits must be [rows, V], got shape {tuple(logits.shape)}")
    num_rows, vocab = logits.shape
    count = len(trees)
    if len(params) != count or len(generators) != count:
        raise ValueError(f"{len(params)} params and {len(generators)} generators for "
                         f"{count} trees")
    device = logits.device
    kids_of: list[list[list[int]]] = []
    tokens_of: list[list[int]] = []
    for s, tree in enumerate(trees):
        n = len(tree.draft_tokens)
        if tree.start < 0 or tree.start + n >= num_rows:
            raise ValueError(f"tree {s}: rows {tree.start}..{tree.start + n} outside the "
                             f"{num_rows} rows of logits")
        kids_of.append(_children(tree.draft_tokens, tree.parents, vocab))
        tokens_of.append([int(t) for t in tree.draft_tokens])

    accepted_of: list[list[int]] = [[] for _ in range(count)]
    last_of: list[int] = [0] * count
    greedy = [s for s in range(count) if params[s].greedy]
    if greedy:
        rows = [r for s in greedy for r in range(trees[s].start, trees[s].start + 1 +
                                                 len(tokens_of[s]))]
        best: list[int] = logits[torch.tensor(rows, device=device)].argmax(dim=-1).tolist()
        base = 0
        for s in greedy:
            accepted_of[s], _, last_of[s] = _greedy_walk(
                kids_of[s], tokens_of[s], _shifted(best, base)
            )
            base += 1 + len(tokens_of[s])
    drawn = [s for s in range(count) if not params[s].greedy]
    if drawn:
        walked = _sampled_walks(
            logits,
            [trees[s] for s in drawn],
            [kids_of[s] for s in drawn],
            [tokens_of[s] for s in drawn],
            [params[s] for s in drawn],
            [generators[s] for s in drawn],
        )
        for s, (accepted, last) in zip(drawn, walked, strict=True):
            accepted_of[s], last_of[s] = accepted, last

    emitted_rows: list[int] = []
    emitted_tokens: list[int] = []
    for s in range(count):
        start = trees[s].start
        emitted_rows.append(start)
        emitted_rows.extend(start + 1 + c for c in accepted_of[s])
        emitted_tokens.extend(tokens_of[s][c] for c in accepted_of[s])
        emitted_tokens.append(last_of[s])
    logprobs = _emitted(logits, emitted_rows, emitted_tokens) if count else []
    out: list[Verified] = []
    pos = 0
    for s in range(count):
        k = len(accepted_of[s]) + 1
        toks = (*(tokens_of[s][c] for c in accepted_of[s]), last_of[s])
        out.append(Verified(tuple(accepted_of[s]), toks, tuple(logprobs[pos : pos + k])))
        pos += k
    return out


class Truncated(NamedTuple):
    """Emitted tokens cut for the request; ``stopped``: a stop token ended them."""

    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]
    stopped: bool


def truncate(
    tokens: Sequence[int],
    logprobs: Sequence[float],
    stop_token_ids: Sequence[int],
    max_new: int,
) -> Truncated:
    """Cut emitted ``tokens`` (and their ``logprobs``, which may be empty when not kept)
    after the first stop token (kept) and at ``max_new`` tokens (what the request may still
    generate).

    The third value, ``stopped``, is true exactly when a stop token was kept (it is then the
    last token): the finish reason is "stop". The request is finished when ``stopped`` or
    when ``len(tokens) == max_new`` (reason "length" unless ``stopped``).
    """
    if max_new < 0:
        raise ValueError(f"max_new must be >= 0, got {max_new}")
    if logprobs and len(logprobs) != len(tokens):
        raise ValueError(f"{len(logprobs)} logprobs for {len(tokens)} tokens")
    stops = set(stop_token_ids)
    cut = min(len(tokens), max_new)
    stopped = False
    for i in range(cut):
        if tokens[i] in stops:
            cut = i + 1
            stopped = True
            break
    return Truncated(tuple(tokens[:cut]), tuple(logprobs[:cut]), stopped)
