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
* temperature > 0: the residual ``r = p``; the children are tested in draft order; child
  ``x`` is accepted with probability ``r(x) / sum(r)``, and if rejected ``r(x) = 0``. When
  one is accepted the walk moves to it; when all are rejected (or there are none) the
  emitted token is drawn from ``r / sum(r)`` and the walk stops.

Why that is lossless (the drafts are deterministic: proposed without sampling, so their
tokens carry no randomness of their own). Let ``x_1..x_k`` be the children's (distinct)
tokens and ``R_j = 1 - p(x_1) - ... - p(x_{j-1})`` the residual mass when ``x_j`` is
tested. ``x_j`` is tested with probability ``R_j`` (all earlier ones rejected) and then
accepted with probability ``p(x_j) / R_j``, so it is the next token with probability
``p(x_j)``. All are rejected with probability ``R_{k+1}``, and then a token ``y`` outside
the children is drawn with probability ``p(y) / R_{k+1}``: ``p(y)`` overall. So the next
token is distributed as ``p`` exactly. Given the next token, what follows is drawn from
the row after it: the child's row (the target's logits after exactly that path) when it
was a draft node, otherwise the next decoding step's. By induction on the position every
emitted token has the target's conditional distribution given the tokens before it: the
emitted sequence is distributed as non-speculative sampling's. (With randomly drawn
drafts the draft's own distribution would enter and this simple rule would not suffice.)

Random draws: a sampled verification of a draft of ``n`` nodes takes exactly ``n + 1``
uniforms from the request's generator in one call (acceptance tests use them in order,
the final draw uses the last), whatever path it takes; greedy takes none. So
``verify_tree`` and ``verify_batch`` make the same choices from the same generator state,
and ``n = 0`` matches ``war.engine.sampling.sample_batch``.

Numerical guards: a child of probability 0 is never accepted (its test still uses its
uniform); the running residual mass is ``sum(p)`` minus the rejected probabilities, and a
child is accepted outright when that mass is not above its probability; should rounding
leave an all-zero residual, the final token is drawn from ``p`` itself.
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


def _sampling_walk(
    kids: list[list[int]],
    tokens: Sequence[int],
    child_prob: Callable[[int], float],
    row_mass: Callable[[int], float],
    uniforms: Sequence[float],
) -> tuple[list[int], int, list[int]]:
    """Accepted nodes, the final row, and the tokens rejected there (to zero in its
    residual). ``child_prob(i)``: ``p`` of node ``i``'s token in its parent's row."""
    accepted: list[int] = []
    row = 0
    used = 0
    while True:
        if not kids[row]:  # a leaf (or no draft): nothing to test here
            return accepted, row, []
        mass = row_mass(row)
        rejected: list[int] = []
        nxt = -1
        for c in kids[row]:
            tok = tokens[c]
            prob = 0.0 if tok in rejected else child_prob(c)  # a duplicate sibling: r = 0
            u = uniforms[used]
            used += 1
            if prob > 0.0 and u * mass < prob:
                nxt = c
                break
            mass -= prob
            rejected.append(tok)
        if nxt < 0:
            return accepted, row, rejected
        accepted.append(nxt)
        row = nxt + 1


def _residual_draw(probs: Tensor, rejected: Sequence[Sequence[int]], uniforms: Tensor) -> Tensor:
    """One token per row of ``probs`` from the row with its ``rejected`` tokens zeroed."""
    rows = [i for i, toks in enumerate(rejected) for _ in toks]
    if not rows:  # nothing rejected (no draft, or every draft token accepted)
        return sample_from_probs(probs, uniforms)
    residual = probs.clone()
    cols = [t for toks in rejected for t in toks]
    device = probs.device
    residual[torch.tensor(rows, device=device), torch.tensor(cols, device=device)] = 0.0
    mass = residual.sum(dim=-1, keepdim=True)
    residual = torch.where(mass > 0.0, residual, probs)
    return sample_from_probs(residual, uniforms)


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
    parent_rows = [int(p) + 1 for p in parents]
    if params.greedy:
        accepted, _, last = _greedy_walk(kids, tokens, lambda r: int(logits[r].argmax()))
    else:
        if generator is None:
            raise ValueError("a generator is needed when temperature > 0")
        uniforms = draw_uniforms(generator, n + 1)
        cache: dict[int, tuple[Tensor, float]] = {}

        def row(r: int) -> tuple[Tensor, float]:
            if r not in cache:
                probs = sampling_probs(logits[r : r + 1], params)[0]
                cache[r] = (probs, float(probs.sum()))
            return cache[r]

        accepted, final, rejected = _sampling_walk(
            kids,
            tokens,
            lambda c: float(row(parent_rows[c])[0][tokens[c]]),
            lambda r: row(r)[1],
            uniforms.tolist(),
        )
        last = int(_residual_draw(row(final)[0].unsqueeze(0), [rejected], uniforms[n:])[0])
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
    child_rows: list[int] = []
    child_cols: list[int] = []
    for tree, tokens, sp in zip(trees, tokens_of, params, strict=True):
        base = len(rows)
        bases.append(base)
        rows.extend(range(tree.start, tree.start + 1 + len(tokens)))
        row_params.extend([sp] * (1 + len(tokens)))
        child_rows.extend(base + 1 + p for p in tree.parents)
        child_cols.extend(tokens)
    probs = sampling_probs_rows(logits[torch.tensor(rows, device=device)], row_params)
    masses: list[float] = []  # (read by the walks only where a tree has nodes)
    child_p: list[float] = []  # node i of tree j: child_p[(nodes of trees < j) + i]
    if child_rows:
        masses = probs.sum(dim=-1).tolist()
        child_p = probs[torch.tensor(child_rows, device=device),
                        torch.tensor(child_cols, device=device)].tolist()
    accepted_of: list[list[int]] = []
    finals: list[int] = []
    rejected_of: list[list[int]] = []
    last_uniforms: list[float] = []
    child_base = 0
    for j, (gen, base) in enumerate(zip(generators, bases, strict=True)):
        if gen is None:
            raise ValueError("a tree samples (temperature > 0) but has no generator")
        n = len(tokens_of[j])
        uniforms: list[float] = draw_uniforms(gen, n + 1).tolist()
        accepted, final, rejected = _sampling_walk(
            kids_of[j],
            tokens_of[j],
            _shifted(child_p, child_base),
            _shifted(masses, base),
            uniforms,
        )
        accepted_of.append(accepted)
        finals.append(base + final)
        rejected_of.append(rejected)
        last_uniforms.append(uniforms[n])
        child_base += n
    lasts: list[int] = _residual_draw(
        probs[torch.tensor(finals, device=device)],
        rejected_of,
        torch.tensor(last_uniforms, dtype=torch.float64),
    ).tolist()
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
