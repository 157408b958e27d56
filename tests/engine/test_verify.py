"""Tests of ``war.engine.verify``: greedy verification equals an independent greedy walk;
sampled verification is lossless (a chi-square test of the first two emitted tokens
against the exact target distribution, with a negative control showing the test catches
wrong verifiers); ``verify_batch`` equals ``verify_tree``; rows are read lazily; the
generator is consumed as documented; ``truncate``.

Knows: the documented behaviour of ``verify_tree``, ``verify_batch`` and ``truncate``, and
a tiny Markov "model" over five tokens. Does not know: real models or the engine. The
chi-square p-value is computed here (regularized incomplete gamma), without scipy.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterator, Sequence

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from war.engine.sampling import make_generator, sample_batch, sampling_probs
from war.engine.verify import TreeRows, Verified, truncate, verify_batch, verify_tree
from war.types import SamplingParams

GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(autouse=True)
def one_torch_thread() -> Iterator[None]:
    """The tensors here are tiny: intra-op threads only add synchronization (which costs
    dearly on a loaded machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)

# ---- chi-square ---------------------------------------------------------------------


def chi2_sf(stat: float, df: int) -> float:
    """P(X >= stat) for X chi-square with ``df`` degrees of freedom: the regularized upper
    incomplete gamma Q(df / 2, stat / 2), by its series (small x) or continued fraction."""
    a, x = df / 2.0, stat / 2.0
    if x <= 0.0:
        return 1.0
    log_front = -x + a * math.log(x) - math.lgamma(a)
    if x < a + 1.0:  # P(a, x) = front / a * sum_k x^k / ((a + 1) ... (a + k))
        term = total = 1.0 / a
        k = 0
        while abs(term) > abs(total) * 1e-16:
            k += 1
            term *= x / (a + k)
            total += term
        return max(0.0, 1.0 - math.exp(log_front) * total)
    tiny = 1e-300  # modified Lentz for Q(a, x) = front / (x + 1 - a - 1(1 - a) / (x + 3 - a - ...
    b = x + 1.0 - a
    c = 1.0 / tiny
    d = 1.0 / b
    h = d
    for i in range(1, 10_000):
        an = -i * (i - a)
        b += 2.0
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1.0 / d
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < 1e-15:
            break
    return math.exp(log_front) * h


def test_chi2_sf_known_values() -> None:
    for x in (0.1, 1.0, 3.0, 10.0, 40.0):
        assert chi2_sf(x, 2) == pytest.approx(math.exp(-x / 2), rel=1e-10)
        assert chi2_sf(x, 4) == pytest.approx(math.exp(-x / 2) * (1 + x / 2), rel=1e-10)
    assert chi2_sf(3.841458820694124, 1) == pytest.approx(0.05, rel=1e-8)
    assert chi2_sf(18.307038053275146, 10) == pytest.approx(0.05, rel=1e-8)
    assert chi2_sf(6.6348966010212145, 1) == pytest.approx(0.01, rel=1e-8)
    assert chi2_sf(0.0, 3) == 1.0


def chi_square_p(counts: dict[tuple[int, int], int], expected: dict[tuple[int, int], float],
                 total: int) -> float:
    """The p-value of observed pair ``counts`` against ``expected`` probabilities. Cells
    expected less than 5 times are pooled (smallest first) until every bin reaches 5; a
    pair of probability 0 that was observed gives p = 0."""
    if any(expected.get(cell, 0.0) == 0.0 for cell in counts):
        return 0.0
    cells = sorted((e * total, counts.get(cell, 0)) for cell, e in expected.items() if e > 0)
    bins: list[tuple[float, int]] = []
    pool_e, pool_o = 0.0, 0
    for e, o in cells:
        pool_e, pool_o = pool_e + e, pool_o + o
        if pool_e >= 5.0:
            bins.append((pool_e, pool_o))
            pool_e, pool_o = 0.0, 0
    if pool_e > 0.0:  # the largest bins come last: fold the remainder into the last one
        e, o = bins.pop()
        bins.append((e + pool_e, o + pool_o))
    stat = sum((o - e) ** 2 / e for e, o in bins)
    return chi2_sf(stat, len(bins) - 1)


# ---- a tiny Markov model ---------------------------------------------------------------

V = 5
CONTEXT_LAST = 0
# TABLE[prev]: the next-token distribution after ``prev`` (temperature 1, no truncation).
NEXT_PROBS = [
    [0.55, 0.12, 0.07, 0.25, 0.01],  # token 0 likely, token 4 unlikely
    [0.2, 0.2, 0.2, 0.2, 0.2],
    [0.01, 0.02, 0.9, 0.03, 0.04],
    [0.3, 0.05, 0.15, 0.4, 0.1],
    [0.1, 0.6, 0.1, 0.1, 0.1],
]
TABLE = torch.tensor([[math.log(p) for p in row] for row in NEXT_PROBS], dtype=torch.float32)

Tree = tuple[tuple[int, ...], tuple[int, ...]]  # (draft tokens, parents)
# Root siblings 0 (likely), 3, 4 (unlikely); chains 0-1-2, 3-3, 4-0.
TREE_A: Tree = ((0, 3, 4, 1, 2, 3, 0), (-1, -1, -1, 0, 3, 1, 2))
# The unlikely sibling first: 4-4-4 and 2-0-1.
TREE_B: Tree = ((4, 2, 4, 4, 0, 1), (-1, -1, 0, 2, 1, 4))
TREE_C: Tree = ((0, 0, 0, 0), (-1, 0, 1, 2))  # a chain
# Two roots, three siblings under the first.
TREE_D: Tree = ((1, 2, 0, 4, 3), (-1, -1, 0, 0, 0))


def tree_logits(tree: Tree, last: int = CONTEXT_LAST) -> torch.Tensor:
    """The model's rows for a draft tree: after ``last``, then after each draft node."""
    return TABLE[torch.tensor([last, *tree[0]])]


def target_pairs(params: SamplingParams) -> dict[tuple[int, int], float]:
    """The exact distribution of the first two tokens of non-speculative sampling."""
    probs = sampling_probs(TABLE, params)
    return {(a, b): float(probs[CONTEXT_LAST, a] * probs[a, b])
            for a in range(V) for b in range(V)}


def count_pairs(pairs: Sequence[tuple[int, int]]) -> dict[tuple[int, int], int]:
    counts: dict[tuple[int, int], int] = {}
    for pair in pairs:
        counts[pair] = counts.get(pair, 0) + 1
    return counts


def real_pairs(tree: Tree, params: SamplingParams, n: int, seed: int,
               batch: int = 1000) -> list[tuple[int, int]]:
    """The first two tokens of ``n`` generations: one verification of ``tree`` (batched
    like an engine step), then, where it emitted one token only, a plain sampling step."""
    tokens, parents = tree
    rows = 1 + len(tokens)
    logits = tree_logits(tree).repeat(batch, 1)
    gen = make_generator(seed, torch.Generator())
    trees = [TreeRows(j * rows, tokens, parents) for j in range(batch)]
    pairs: list[tuple[int, int]] = []
    for _ in range(n // batch):
        out = verify_batch(logits, trees, [params] * batch, [gen] * batch)
        short = [j for j, v in enumerate(out) if len(v.tokens) == 1]
        second = sample_batch(TABLE[torch.tensor([out[j].tokens[0] for j in short])],
                              [params] * len(short), [gen] * len(short)).tokens
        seconds = dict(zip(short, second, strict=True))
        pairs.extend((v.tokens[0], v.tokens[1] if len(v.tokens) > 1 else seconds[j])
                     for j, v in enumerate(out))
    return pairs


WrongVerifier = Callable[[list[list[float]], Tree, random.Random], list[int]]


def _draw(weights: Sequence[float], rng: random.Random) -> int:
    return rng.choices(range(V), weights=weights)[0]


def accept_first_child(probs: list[list[float]], tree: Tree, rng: random.Random) -> list[int]:
    """Wrong: always accepts the first child (emits the draft's first branch)."""
    tokens, parents = tree
    node, out = -1, list[int]()
    while True:
        kids = [i for i, p in enumerate(parents) if p == node]
        if not kids:
            return [*out, _draw(probs[tokens[node] if node >= 0 else CONTEXT_LAST], rng)]
        node = kids[0]
        out.append(tokens[node])


def unnormalized_residual(probs: list[list[float]], tree: Tree,
                          rng: random.Random) -> list[int]:
    """Wrong: tests later siblings against ``p(x)`` instead of ``r(x) / sum(r)``."""
    tokens, parents = tree
    node, out = -1, list[int]()
    while True:
        p = probs[tokens[node] if node >= 0 else CONTEXT_LAST]
        residual = list(p)
        nxt = -1
        for c in (i for i, q in enumerate(parents) if q == node):
            if rng.random() < p[tokens[c]]:
                nxt = c
                break
            residual[tokens[c]] = 0.0
        if nxt < 0:
            return [*out, _draw(residual, rng)]
        node = nxt
        out.append(tokens[node])


def residual_not_zeroed(probs: list[list[float]], tree: Tree,
                        rng: random.Random) -> list[int]:
    """Wrong: right acceptance tests, but the last token is drawn from ``p``, not ``r``."""
    tokens, parents = tree
    node, out = -1, list[int]()
    while True:
        p = probs[tokens[node] if node >= 0 else CONTEXT_LAST]
        mass = 1.0
        nxt = -1
        for c in (i for i, q in enumerate(parents) if q == node):
            if rng.random() * mass < p[tokens[c]]:
                nxt = c
                break
            mass -= p[tokens[c]]
        if nxt < 0:
            return [*out, _draw(p, rng)]
        node = nxt
        out.append(tokens[node])


def wrong_pairs(verifier: WrongVerifier, tree: Tree, params: SamplingParams, n: int,
                seed: int) -> list[tuple[int, int]]:
    probs = sampling_probs(TABLE, params).tolist()
    rng = random.Random(seed)
    pairs = []
    for _ in range(n):
        out = verifier(probs, tree, rng)
        second = out[1] if len(out) > 1 else _draw(probs[out[0]], rng)
        pairs.append((out[0], second))
    return pairs


N_SAMPLES = 20_000
P_MIN = 1e-4

LOSSLESS_CASES = [
    (TREE_A, SamplingParams()),
    (TREE_B, SamplingParams()),
    (TREE_D, SamplingParams()),
    (TREE_A, SamplingParams(temperature=0.6, top_k=3)),  # root token 4 has p = 0
    (TREE_D, SamplingParams(temperature=1.5, top_p=0.7)),
    (TREE_B, SamplingParams(temperature=0.8, top_k=2, top_p=0.9)),  # both roots p = 0
    (TREE_C, SamplingParams(temperature=1.3, top_p=0.8)),
]


@pytest.mark.parametrize(("tree", "params"), LOSSLESS_CASES)
def test_sampled_verification_is_lossless(tree: Tree, params: SamplingParams) -> None:
    pairs = real_pairs(tree, params, N_SAMPLES, seed=2024)
    p_value = chi_square_p(count_pairs(pairs), target_pairs(params), N_SAMPLES)
    assert p_value > P_MIN


@pytest.mark.parametrize(
    "verifier", [accept_first_child, unnormalized_residual, residual_not_zeroed]
)
@pytest.mark.parametrize(("tree", "params"), [
    (TREE_A, SamplingParams()),
    (TREE_D, SamplingParams(temperature=1.5, top_p=0.7)),
])
def test_wrong_verifiers_fail_the_same_check(verifier: WrongVerifier, tree: Tree,
                                             params: SamplingParams) -> None:
    pairs = wrong_pairs(verifier, tree, params, N_SAMPLES, seed=7)
    assert chi_square_p(count_pairs(pairs), target_pairs(params), N_SAMPLES) < P_MIN


def test_the_python_harness_passes_with_a_right_verifier() -> None:
    """The negative control's harness itself is sound: plain sampling in it passes."""
    params = SamplingParams()
    no_draft: Tree = ((), ())
    pairs = wrong_pairs(accept_first_child, no_draft, params, N_SAMPLES, seed=7)
    assert chi_square_p(count_pairs(pairs), target_pairs(params), N_SAMPLES) > P_MIN


def test_the_draft_is_used() -> None:
    """Speculation does something: a likely chain emits several tokens per verification."""
    n = 2000
    tree = TREE_C
    gen = make_generator(3, torch.Generator())
    out = verify_batch(tree_logits(tree).repeat(n, 1),
                       [TreeRows(j * 5, *tree) for j in range(n)],
                       [SamplingParams()] * n, [gen] * n)
    mean = sum(len(v.tokens) for v in out) / n
    # Expected: 1 + 0.55 + 0.55^2 + 0.55^3 + 0.55^4 = 2.1
    assert 2.0 < mean < 2.2


# ---- greedy ----------------------------------------------------------------------------


@st.composite
def trees_and_logits(draw: st.DrawFn) -> tuple[list[int], list[int], torch.Tensor]:
    vocab = draw(st.integers(2, 5))
    size = draw(st.integers(0, 10))
    tokens: list[int] = []
    parents: list[int] = []
    for _ in range(size):
        parent = draw(st.integers(-1, len(tokens) - 1))
        taken = {t for t, p in zip(tokens, parents, strict=True) if p == parent}
        free = [t for t in range(vocab) if t not in taken]
        if free:  # siblings have distinct tokens
            parents.append(parent)
            tokens.append(draw(st.sampled_from(free)))
    values = draw(st.lists(st.integers(-2, 2), min_size=(1 + len(tokens)) * vocab,
                           max_size=(1 + len(tokens)) * vocab))
    logits = torch.tensor(values, dtype=torch.float32).reshape(1 + len(tokens), vocab)
    return tokens, parents, logits


def reference_greedy(tokens: list[int], parents: list[int],
                     logits: torch.Tensor) -> tuple[list[int], list[int], list[float]]:
    """Accepted nodes, emitted tokens and their logprobs, by walking the tree on lists."""
    node = -1
    accepted: list[int] = []
    emitted: list[int] = []
    logprobs: list[float] = []
    while True:
        row = logits[node + 1].tolist()
        best = row.index(max(row))  # the lowest index among ties
        emitted.append(best)
        logprobs.append(row[best] - math.log(sum(math.exp(v) for v in row)))
        match = [i for i in range(len(tokens)) if parents[i] == node and tokens[i] == best]
        if not match:
            return accepted, emitted, logprobs
        node = match[0]
        accepted.append(node)


@settings(max_examples=150, deadline=None)
@given(trees_and_logits())
def test_greedy_equals_the_reference_walk(case: tuple[list[int], list[int], torch.Tensor]) -> None:
    tokens, parents, logits = case
    accepted, emitted, logprobs = reference_greedy(tokens, parents, logits)
    got = verify_tree(logits, tokens, parents, GREEDY)
    assert got.accepted == tuple(accepted)
    assert got.tokens == tuple(emitted)
    assert got.logprobs == pytest.approx(logprobs, abs=1e-5)
    batched = verify_batch(torch.cat([logits, logits]),
                           [TreeRows(0, tokens, parents),
                            TreeRows(1 + len(tokens), tokens, parents)],
                           [GREEDY, GREEDY], [None, None])
    assert batched == [got, got]


def test_greedy_equals_greedy_decoding_of_the_tiny_model() -> None:
    # Greedy decoding from token 0: 0 -> 0 -> 0 ...; draft 0, 0, 3 then 0 under the first.
    tree: Tree = ((0, 0, 3, 0), (-1, 0, 1, 0))
    got = verify_tree(tree_logits(tree), *tree, GREEDY)
    assert got.accepted == (0, 1)
    assert got.tokens == (0, 0, 0)


# ---- verify_batch against verify_tree ---------------------------------------------------

PARAMS = st.sampled_from([
    SamplingParams(),
    GREEDY,
    SamplingParams(temperature=0.7, top_k=3),
    SamplingParams(temperature=1.2, top_p=0.8),
    SamplingParams(temperature=0.3, top_k=2, top_p=0.6),
])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(trees_and_logits(), PARAMS, st.integers(0, 2**32)), min_size=1,
                max_size=5),
       st.integers(0, 2**16))
def test_batch_equals_single_trees(
    cases: list[tuple[tuple[list[int], list[int], torch.Tensor], SamplingParams, int]],
    noise_seed: int,
) -> None:
    noise = torch.Generator().manual_seed(noise_seed)
    vocab = 6
    blocks, trees, params, seeds = [], [], [], []
    start = 0
    for (tokens, parents, _), sp, seed in cases:
        rows = torch.randn(1 + len(tokens), vocab, generator=noise) * 2
        blocks.append(rows)
        trees.append(TreeRows(start, tokens, parents))
        params.append(sp)
        seeds.append(seed)
        start += 1 + len(tokens)
    logits = torch.cat(blocks)
    batched = verify_batch(logits, trees, params,
                           [make_generator(s, torch.Generator()) for s in seeds])
    for block, tree, sp, seed, got in zip(blocks, trees, params, seeds, batched, strict=True):
        single = verify_tree(block, tree.draft_tokens, tree.parents, sp,
                             make_generator(seed, torch.Generator()))
        assert got.accepted == single.accepted
        assert got.tokens == single.tokens
        assert got.logprobs == pytest.approx(single.logprobs, abs=1e-6)
        assert len(got.tokens) == len(got.accepted) + 1


def test_empty_draft_matches_sample_batch() -> None:
    logits = torch.randn(8, 100, generator=torch.Generator().manual_seed(0))
    sp = SamplingParams(temperature=0.9, top_p=0.95)
    g1 = make_generator(77, torch.Generator())
    g2 = make_generator(77, torch.Generator())
    batch = sample_batch(logits, [sp] * 8, [g1] * 8)
    single = [verify_tree(logits[i : i + 1], [], [], sp, g2) for i in range(8)]
    assert batch.tokens == tuple(v.tokens[0] for v in single)
    assert all(v.accepted == () for v in single)


# ---- edge cases -------------------------------------------------------------------------


def test_generator_use() -> None:
    """A sampled verification takes one uniform per emitted token (k accepted: k + 1);
    greedy takes none."""
    tree = TREE_A
    gen = make_generator(5, torch.Generator())
    twin = make_generator(5, torch.Generator())
    for _ in range(20):
        got = verify_tree(tree_logits(tree), *tree, SamplingParams(), gen)
        for _ in got.tokens:
            torch.rand(1, generator=twin, dtype=torch.float64)
        assert torch.equal(gen.get_state(), twin.get_state())
    verify_tree(tree_logits(tree), *tree, GREEDY, gen)
    assert torch.equal(gen.get_state(), twin.get_state())


def _markov_decode(seed: int, params: SamplingParams, n: int,
                   draft: Callable[[list[int], random.Random], Tree] | None,
                   batched: bool) -> list[int]:
    """``n`` tokens of the Markov model from ``CONTEXT_LAST``, seeded: plain sampling
    steps (``draft`` None) or verifications of the drafts ``draft(emitted, rng)`` gives."""
    gen = make_generator(seed, torch.Generator())
    rng = random.Random(seed)
    out: list[int] = []
    while len(out) < n:
        last = out[-1] if out else CONTEXT_LAST
        if draft is None:
            out.extend(sample_batch(TABLE[torch.tensor([last])], [params], [gen]).tokens)
            continue
        tokens, parents = draft(out, rng)
        logits = tree_logits((tokens, parents), last)
        got = (verify_batch(logits, [TreeRows(0, tokens, parents)], [params], [gen])[0]
               if batched else verify_tree(logits, tokens, parents, params, gen))
        out.extend(got.tokens)
    return out[:n]


def _random_tree(_out: list[int], rng: random.Random) -> Tree:
    n = rng.randrange(0, 7)
    return (tuple(rng.randrange(V) for _ in range(n)),
            tuple(rng.randrange(-1, i) for i in range(n)))


def _likely_chain(_out: list[int], rng: random.Random) -> Tree:
    k = rng.randrange(1, 5)
    return (0,) * k, tuple(range(-1, k - 1))


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.7),
                                    SamplingParams(temperature=1.3, top_p=0.8, top_k=4)])
@pytest.mark.parametrize("batched", [False, True])
def test_a_seed_gives_the_same_tokens_whatever_the_drafts(
        params: SamplingParams, batched: bool) -> None:
    """The emitted token of every position is the target's own inverse-CDF draw: a seeded
    generation is the same token for token with any drafts as without speculation."""
    for seed in range(8):
        plain = _markov_decode(seed, params, 60, None, batched)
        for draft in (_random_tree, _likely_chain):
            assert _markov_decode(seed, params, 60, draft, batched) == plain, (seed, draft)
    assert len({tuple(_markov_decode(s, params, 60, None, batched)) for s in range(8)}) > 1


def test_certain_and_impossible_children() -> None:
    """p(x) = 1 is always accepted (even as the second sibling), p(x) = 0 never; rows the
    walk never visits are not read (NaN there changes nothing)."""
    gen = make_generator(8, torch.Generator())
    sp = SamplingParams(top_k=1)  # one-hot at the argmax
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0],  # argmax 1
                           [float("nan")] * 4,  # after 3: never visited
                           [0.0, 0.0, 0.0, 5.0],  # after 1: argmax 3
                           [float("nan")] * 4])  # after 1, 2: never visited
    for _ in range(20):
        got = verify_tree(logits, [3, 1, 2], [-1, -1, 1], sp, gen)
        assert got.accepted == (1,)
        assert got.tokens == (1, 3)


def test_duplicate_siblings_stay_lossless() -> None:
    """A duplicated sibling is never accepted after its twin was rejected."""
    gen = make_generator(9, torch.Generator())
    n = 4000
    logits = torch.zeros(3 * n, 2)
    firsts = verify_batch(logits, [TreeRows(3 * j, [0, 0], [-1, -1]) for j in range(n)],
                          [SamplingParams()] * n, [gen] * n)
    assert all(v.accepted in ((), (0,)) for v in firsts)
    share = sum(v.tokens[0] == 0 for v in firsts) / len(firsts)
    assert abs(share - 0.5) < 0.04


def test_logprobs_are_raw_in_sampled_mode() -> None:
    tree = TREE_A
    logits = tree_logits(tree)
    sp = SamplingParams(temperature=0.5, top_k=2)
    gen = make_generator(1, torch.Generator())
    log_softmax = torch.log_softmax(logits.double(), dim=-1)
    for _ in range(50):
        got = verify_tree(logits, *tree, sp, gen)
        rows = [0] + [1 + a for a in got.accepted]
        expected = [float(log_softmax[r, t]) for r, t in zip(rows, got.tokens, strict=True)]
        assert got.logprobs == pytest.approx(expected, abs=1e-6)


def test_invalid_trees_are_rejected() -> None:
    logits = torch.zeros(3, 4)
    with pytest.raises(ValueError, match="parents"):
        verify_tree(logits, [1, 2], [-1, 1], GREEDY)
    with pytest.raises(ValueError, match="parents"):
        verify_tree(logits, [1, 2], [-1, -2], GREEDY)
    with pytest.raises(ValueError, match="vocabulary"):
        verify_tree(logits, [1, 4], [-1, 0], GREEDY)
    with pytest.raises(ValueError, match="rows"):
        verify_tree(logits, [1], [-1], GREEDY)
    with pytest.raises(ValueError, match="parents"):
        verify_tree(logits, [1, 2], [-1], GREEDY)
    with pytest.raises(ValueError, match="generator"):
        verify_tree(logits, [1, 2], [-1, 0], SamplingParams())
    with pytest.raises(ValueError, match="outside"):
        verify_batch(logits, [TreeRows(1, [1, 2], [-1, 0])], [GREEDY], [None])
    with pytest.raises(ValueError, match="generator"):
        verify_batch(logits, [TreeRows(0, [1, 2], [-1, 0])], [SamplingParams()], [None])
    assert verify_batch(logits, [], [], []) == []


def test_verified_shape() -> None:
    got = verify_tree(torch.tensor([[0.0, 1.0]]), [], [], GREEDY)
    assert isinstance(got, Verified)
    assert (got.accepted, got.tokens) == ((), (1,))
    assert got.logprobs == pytest.approx((math.log(math.e / (1 + math.e)),))


# ---- truncate ---------------------------------------------------------------------------


def test_truncate_at_a_stop_token() -> None:
    tokens, logprobs, stopped = truncate([5, 7, 2, 7, 9], [-1.0, -2.0, -3.0, -4.0, -5.0],
                                         [7], max_new=10)
    assert (tokens, logprobs, stopped) == ((5, 7), (-1.0, -2.0), True)
    # The first of several stop tokens ends it.
    assert truncate([5, 9, 7], [], [7, 9], 10) == ((5, 9), (), True)


def test_truncate_at_max_new() -> None:
    assert truncate([5, 6, 7], [-1.0, -2.0, -3.0], [7], 2) == ((5, 6), (-1.0, -2.0), False)
    assert truncate([5, 6, 7], [-1.0, -2.0, -3.0], [7], 3) == ((5, 6, 7), (-1.0, -2.0, -3.0),
                                                                True)
    assert truncate([5, 6], [-1.0, -2.0], [], 5) == ((5, 6), (-1.0, -2.0), False)
    assert truncate([5, 6], [-1.0, -2.0], [], 0) == ((), (), False)
    # A stop token beyond the budget does not count.
    assert truncate([5, 6, 7], [], [7], 2) == ((5, 6), (), False)


def test_truncate_rejects_bad_input() -> None:
    with pytest.raises(ValueError):
        truncate([1, 2], [-1.0], [], 5)
    with pytest.raises(ValueError):
        truncate([1, 2], [], [], -1)
