"""The fence around the native core: the only module that imports ``war.spec._C``.

Knows: how to validate and convert Python inputs (token ids, sequence ids,
drafting parameters) for the native suffix trees, and how to turn native results
into Python values. Does not know what the trees hold (trajectories, history,
groups: see ``speculator.py``); the algorithm itself is specified in
docs/suffix-speculation.md and implemented in ``csrc/``.

Every check happens before the native call, so a bad argument raises
``ValueError`` and leaves the tree unchanged.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from war.spec import _C  # the native core (csrc/)
from war.spec.config import MAX_DEPTH
from war.types import Draft

INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

TokenArray = npt.NDArray[np.int32]
TokensLike = Sequence[int] | npt.NDArray[Any]


class SpecResult(NamedTuple):
    """A draft from one tree: token ids, parents (-1 = root), cumulative probs."""

    token_ids: npt.NDArray[np.int32]
    parents: npt.NDArray[np.int32]
    probs: npt.NDArray[np.float64]
    score: float
    match_len: int


class BatchDrafts(NamedTuple):
    """Drafts for a batch, concatenated: draft ``i`` is ``offsets[i]:offsets[i+1]``.

    The arrays are writable views of one buffer per dtype (token ids, parents and match
    lengths share the int32 one; probabilities and scores the float64 one)."""

    token_ids: npt.NDArray[np.int32]
    parents: npt.NDArray[np.int32]
    probs: npt.NDArray[np.float64]
    offsets: npt.NDArray[np.int64]
    scores: npt.NDArray[np.float64]
    sources: npt.NDArray[np.int8]
    match_lens: npt.NDArray[np.int32]


SOURCE_NAMES = ("none", "group", "local", "global")

# The slots `_C.make_drafts` fills, in its order. It makes drafts as object.__new__
# and object.__setattr__ would, so Draft must keep exactly these fields and no
# __post_init__.
_DRAFT_FIELDS = tuple(f.name for f in dataclasses.fields(Draft))
if _DRAFT_FIELDS != ("token_ids", "parents", "probs", "score", "source", "match_len") or hasattr(
    Draft, "__post_init__"
):
    raise ImportError("war.types.Draft changed: update war.spec.tree and _C.make_drafts")


def as_tokens(tokens: TokensLike, what: str = "token ids") -> TokenArray:
    """Validates token ids (integers in [0, 2**31 - 1]) and returns them as int32.

    Accepts a 1-D array of an integer dtype or a sequence of Python/NumPy ints.
    """
    if isinstance(tokens, np.ndarray):
        arr = tokens
        if arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(f"{what} must have an integer dtype, got {arr.dtype}")
        if arr.ndim != 1:
            raise ValueError(f"{what} must be 1-D, got shape {arr.shape}")
        if arr.size:
            lo, hi = int(arr.min()), int(arr.max())
            if lo < 0 or hi > INT32_MAX:
                _out_of_range(what, lo if lo < 0 else hi)
        return np.ascontiguousarray(arr, dtype=np.int32)
    # (bytes-like objects are Sequences of small ints, but never token ids)
    if isinstance(tokens, (str, bytes, bytearray, memoryview)) or not isinstance(
        tokens, Sequence
    ):
        raise ValueError(f"{what} must be a sequence of ints, got {type(tokens).__name__}")
    if not tokens:
        return np.empty(0, dtype=np.int32)
    for t in tokens:
        if type(t) is not int and (
            not isinstance(t, (int, np.integer)) or isinstance(t, (bool, np.bool_))
        ):
            raise ValueError(f"{what} must be ints, got {t!r} ({type(t).__name__})")
    lo, hi = min(tokens), max(tokens)
    if lo < 0 or hi > INT32_MAX:
        _out_of_range(what, int(lo if lo < 0 else hi))
    return np.asarray(tokens, dtype=np.int32)


_INT_SEQUENCES = (list, tuple)


def append_native(tree: Any, seq_id: int, tokens: TokensLike) -> None:
    """Appends validated ``tokens`` to native ``tree``'s sequence ``seq_id`` (an id
    already checked). A list or tuple of plain ints in range goes in without a NumPy
    array; anything else through ``as_tokens``, which raises ValueError naming the
    problem. The native call raises ValueError before any change for a sealed or
    too-long sequence. Mutates."""
    if type(tokens) in _INT_SEQUENCES and tree.append_ints(seq_id, tokens):
        return
    tree.append(seq_id, as_tokens(tokens))


def _out_of_range(what: str, token: int) -> None:
    raise ValueError(f"{what}: token id {token} is out of range [0, {INT32_MAX}]")


def as_id(seq_id: object, what: str = "sequence id") -> int:
    """Validates an integer id that fits in int64."""
    if not isinstance(seq_id, (int, np.integer)) or isinstance(seq_id, (bool, np.bool_)):
        raise ValueError(f"{what} must be an int, got {seq_id!r}")
    value = int(seq_id)
    if not INT64_MIN <= value <= INT64_MAX:
        raise ValueError(f"{what} {value} does not fit in int64")
    return value


class DraftParams(NamedTuple):
    """Validated drafting parameters (docs/suffix-speculation.md, sections 2-3)."""

    max_tokens: int
    factor: float
    offset: float
    min_prob: float
    tree: bool
    alpha: npt.NDArray[np.float64]  # smoothing per trie depth, 0..max_depth


class MergeParams(NamedTuple):
    """How a merge of the sources' drafts cuts (docs/suffix-speculation.md, section 6)."""

    threshold: float  # merged value a draft token needs, in [0, 1]
    min_prob: float  # each source's tree-draft min_prob, in [0, 1]


AlphaLike = float | Sequence[float] | npt.NDArray[np.float64]


def alpha_table(alpha: AlphaLike, max_depth: int) -> npt.NDArray[np.float64]:
    """Smoothing per trie depth ``0..max_depth``: a constant, or one value per depth."""
    if isinstance(alpha, (int, float, np.integer, np.floating)) and not isinstance(
        alpha, (bool, np.bool_)
    ):
        try:
            values = np.full(max_depth + 1, float(alpha), dtype=np.float64)
        except OverflowError:  # an int beyond any float
            raise ValueError(f"alpha values must be finite and >= 0, got {alpha!r}") from None
    else:
        if isinstance(alpha, (str, bytes)) or (
            isinstance(alpha, np.ndarray) and alpha.dtype.kind not in "iuf"
        ) or (isinstance(alpha, Sequence) and not all(_is_number(a) for a in alpha)):
            # (NumPy would read "0.5" or True as a number)
            raise ValueError(f"alpha must be a number or a sequence of numbers, got {alpha!r}")
        try:
            values = np.asarray(alpha, dtype=np.float64)
        except (TypeError, ValueError, OverflowError):
            raise ValueError(f"alpha must be a number or a sequence of numbers, got {alpha!r}") \
                from None
        if values.ndim != 1 or values.size != max_depth + 1:
            raise ValueError(
                f"alpha must be a number or {max_depth + 1} values (one per depth 0..max_depth),"
                f" got shape {values.shape}"
            )
    if not np.all(np.isfinite(values)) or np.any(values < 0):
        raise ValueError("alpha values must be finite and >= 0")
    return np.ascontiguousarray(values)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(
        value, (bool, np.bool_)
    )


def draft_params(
    max_tokens: int,
    factor: float,
    offset: float,
    min_prob: float,
    tree: bool,
    alpha: AlphaLike,
    max_depth: int,
) -> DraftParams:
    """Checks drafting parameters, naming the first bad one."""
    if not isinstance(max_tokens, (int, np.integer)) or isinstance(max_tokens, bool):
        raise ValueError(f"max_tokens must be an int, got {max_tokens!r}")
    if not 0 <= int(max_tokens) <= INT32_MAX:
        raise ValueError(f"max_tokens must be in [0, {INT32_MAX}], got {max_tokens}")
    for name, value, low in (("factor", factor, 0.0), ("offset", offset, None),
                             ("min_prob", min_prob, 0.0)):
        if isinstance(value, bool) or not isinstance(value, (int, float, np.floating)):
            raise ValueError(f"{name} must be a number, got {value!r}")
        if isinstance(value, int) and abs(value) > 2**1023:  # (float() would overflow)
            raise ValueError(f"{name} must be finite, got {value!r}")
        if not math.isfinite(float(value)) or (low is not None and float(value) < low):
            raise ValueError(f"{name} must be finite and >= {low}, got {value!r}")
    if float(min_prob) > 1.0:
        raise ValueError(f"min_prob must be <= 1, got {min_prob!r}")
    if not isinstance(tree, bool):
        raise ValueError(f"tree must be a bool, got {tree!r}")
    return DraftParams(int(max_tokens), float(factor), float(offset), float(min_prob), tree,
                       alpha_table(alpha, max_depth))


class SuffixTree:
    """A depth-limited suffix trie with counts over sequences of token ids (native).

    Mutating calls: ``append``, ``append_from``, ``seal``, ``remove``. Everything
    else only reads. Not thread-safe: callers serialise access.
    """

    def __init__(self, max_depth: int) -> None:
        if not isinstance(max_depth, (int, np.integer)) or isinstance(max_depth, bool) or not (
            1 <= max_depth <= MAX_DEPTH
        ):
            raise ValueError(f"max_depth must be an int in [1, {MAX_DEPTH}], got {max_depth!r}")
        self._t = _C.SuffixTree(int(max_depth))

    @property
    def native(self) -> Any:
        """The native tree, for batched calls in this package."""
        return self._t

    @property
    def max_depth(self) -> int:
        return int(self._t.max_depth)

    @property
    def num_seqs(self) -> int:
        return int(self._t.num_seqs)

    @property
    def num_nodes(self) -> int:
        """Nodes of the path-compressed trie (not of the conceptual one)."""
        return int(self._t.num_nodes)

    @property
    def num_tokens(self) -> int:
        """Tokens of the sequences held."""
        return int(self._t.num_tokens)

    def _known(self, seq_id: object) -> int:
        sid = as_id(seq_id)
        if not self._t.contains(sid):
            raise ValueError(f"unknown sequence id {sid}")
        return sid

    def append(self, seq_id: int, tokens: TokensLike) -> None:
        """Appends tokens to a sequence, creating it if new. Mutates."""
        append_native(self._t, as_id(seq_id), tokens)

    def append_from(
        self, seq_id: int, other: SuffixTree, other_id: int, start: int, end: int
    ) -> None:
        """Appends ``other``'s sequence ``other_id`` tokens ``[start, end)``. Mutates."""
        sid = as_id(seq_id)
        oid = other._known(other_id)
        n = other.seq_len(oid)
        lo, hi = as_id(start, "start"), as_id(end, "end")
        if not 0 <= lo <= hi <= n:
            raise ValueError(f"range [{lo}, {hi}) out of bounds for a sequence of {n}")
        self._t.append_from(sid, other._t, oid, lo, hi)

    def seal(self, seq_id: int) -> None:
        """Marks a sequence complete, freeing what appending needs. Mutates."""
        self._t.seal(self._known(seq_id))

    def remove(self, seq_id: int) -> None:
        """Removes a sequence and all its counts. Mutates."""
        self._t.remove(self._known(seq_id))

    def contains(self, seq_id: int) -> bool:
        return bool(self._t.contains(as_id(seq_id)))

    def seq_len(self, seq_id: int) -> int:
        return int(self._t.seq_len(self._known(seq_id)))

    def sequence(self, seq_id: int) -> list[int]:
        return [int(t) for t in self._t.sequence(self._known(seq_id))]

    def count(self, path: TokensLike) -> int:
        """Occurrences of ``path`` among all suffixes (0 if absent or empty)."""
        return int(self._t.count(as_tokens(path, "path")))

    def children(self, path: TokensLike) -> list[tuple[int, int]]:
        """``(token, count)`` of the tokens that follow ``path``, best first."""
        return [(int(t), int(c)) for t, c in self._t.children(as_tokens(path, "path"))]

    def match_len(self, context: TokensLike) -> int:
        """Length of the longest suffix of ``context`` present (at most max_depth)."""
        return int(self._t.match_len(as_tokens(context, "context")))

    def speculate(
        self,
        context: TokensLike,
        max_tokens: int = 16,
        factor: float = 1.0,
        offset: float = 0.0,
        min_prob: float = 0.1,
        tree: bool = False,
        alpha: AlphaLike = 0.0,
    ) -> SpecResult:
        """Best draft continuing ``context`` over all match lengths.

        ``alpha``: smoothing of the probability estimates, a constant or one value
        per trie depth ``0..max_depth``.
        """
        ctx = as_tokens(context, "context")
        p = draft_params(max_tokens, factor, offset, min_prob, tree, alpha, self.max_depth)
        tok, par, prob, score, match_len = self._t.speculate(ctx, *p)
        return SpecResult(tok, par, prob, float(score), int(match_len))

    def memory_bytes(self) -> int:
        """Bytes held by the tree: nodes, child lists, indexes and sequences."""
        return int(self._t.memory_bytes())

    def check_integrity(self) -> None:
        """Recounts everything by brute force; raises RuntimeError if broken. Slow."""
        self._t.check_integrity()


def propose_batch(
    locals_: Sequence[SuffixTree],
    local_ids: Sequence[int],
    groups: Sequence[SuffixTree],
    global_tree: SuffixTree | None,
    budgets: npt.NDArray[np.int32],
    params: DraftParams,
    local_alpha: npt.NDArray[np.float64],
    global_alpha: npt.NDArray[np.float64],
    group_weight: float,
    merge: MergeParams | None = None,
) -> BatchDrafts:
    """Drafts for many sequences in one native call (GIL released while drafting).

    ``params.alpha`` smooths group drafts; local and global drafts have their own
    tables. ``merge``: None keeps the best single source (section 4), else the
    sources' drafts are merged (section 6; ``params.tree`` is then the shape of the
    merged draft, ``params.min_prob`` unused). Inputs are trusted: the speculator
    builds them from validated state.
    """
    out = _C.propose_batch(
        [t.native for t in locals_],
        np.asarray(local_ids, dtype=np.int64),
        [g.native for g in groups],
        None if global_tree is None else global_tree.native,
        np.ascontiguousarray(budgets, dtype=np.int32),
        *params,
        local_alpha,
        global_alpha,
        float(group_weight),
        merge is not None,
        0.5 if merge is None else float(merge.threshold),
        0.05 if merge is None else float(merge.min_prob),
    )
    return _unpack(*out)


def drafts_of(batch: BatchDrafts) -> list[Draft]:
    """A batch's drafts as one ``war.types.Draft`` each, made natively.

    Raises ValueError if the arrays do not form a batch (wrong dtypes or lengths)."""
    drafts: list[Draft] = _C.make_drafts(Draft, _DRAFT_FIELDS, SOURCE_NAMES, *batch)
    return drafts


def _unpack(b64: bytearray, b32: bytearray, bf64: bytearray, b8: bytearray) -> BatchDrafts:
    """The native batch's arrays (one bytearray per dtype, ``packed`` in
    csrc/bindings.cc) as writable views: offsets; tokens, parents, match lengths;
    probabilities, scores; sources."""
    offsets = np.frombuffer(b64, np.int64)  # always holds 0 first
    total = int(offsets[-1])
    i32 = np.frombuffer(b32, np.int32)
    f64 = np.frombuffer(bf64, np.float64)
    return BatchDrafts(
        i32[:total], i32[total : 2 * total], f64[:total], offsets, f64[total:],
        np.frombuffer(b8, np.int8), i32[2 * total :],
    )
