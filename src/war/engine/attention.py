"""Attention over a paged KV cache, and the batch description that drives it.

Knows: the paged KV cache (one flat slot space ``block_id * block_size + offset``
per layer, shared by all sequences), how a step's new tokens of many sequences
(prefill chunks, decode tokens, chains or trees of draft tokens) are packed into
one ``ForwardBatch`` with a per-sequence attention mask, and the attention layer
itself (projections, optional qk-norm, RoPE, grouped-query attention) in a dense
causal form and in the paged form. Does not know which blocks belong to whom
(the block manager decides the slots), the rest of the model (``model.py``),
nor sampling or verification.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from war.engine.layers import RMSNorm, apply_rotary
from war.engine.model_config import ModelConfig

# ---------------------------------------------------------------------------------
# KV cache
# ---------------------------------------------------------------------------------


class KVCache:
    """Keys and values of all layers in paged blocks.

    ``k`` and ``v`` are ``[num_layers, num_blocks * block_size, num_kv_heads,
    head_dim]``; a token's K/V live at slot ``block_id * block_size + offset`` in
    every layer. The cache starts zeroed, so reading a never-written slot (as
    masked padding does) yields finite values.
    """

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> None:
        for name, v in (("num_layers", num_layers), ("num_blocks", num_blocks),
                        ("block_size", block_size), ("num_kv_heads", num_kv_heads),
                        ("head_dim", head_dim)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"KVCache {name} must be an int >= 1, got {v!r}")
        shape = (num_layers, num_blocks * block_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self._num_blocks = num_blocks
        self._block_size = block_size
        self._gather: tuple[Tensor, Tensor] | None = None  # see ``gather_buffers``

    @classmethod
    def for_model(cls, config: ModelConfig, num_blocks: int, block_size: int,
                  dtype: torch.dtype = torch.float32,
                  device: torch.device | str = "cpu") -> KVCache:
        """A cache shaped for ``config``'s layers and key/value heads."""
        return cls(config.num_hidden_layers, num_blocks, block_size, config.num_key_value_heads,
                   config.head_dim, dtype, device)

    @staticmethod
    def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        """Bytes one block takes (K and V, all layers)."""
        elem = torch.empty((), dtype=dtype).element_size()
        return (2 * config.num_hidden_layers * block_size * config.num_key_value_heads
                * config.head_dim * elem)

    @staticmethod
    def blocks_for_bytes(config: ModelConfig, budget_bytes: int, block_size: int,
                          dtype: torch.dtype) -> int:
        """How many whole blocks fit in ``budget_bytes`` (may be 0)."""
        if budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
        return int(budget_bytes // KVCache.bytes_per_block(config, block_size, dtype))

    @property
    def num_layers(self) -> int:
        return int(self.k.shape[0])

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def num_slots(self) -> int:
        return self._num_blocks * self._block_size

    @property
    def num_kv_heads(self) -> int:
        return int(self.k.shape[2])

    @property
    def head_dim(self) -> int:
        return int(self.k.shape[3])

    @property
    def dtype(self) -> torch.dtype:
        return self.k.dtype

    @property
    def device(self) -> torch.device:
        return self.k.device

    @property
    def bytes(self) -> int:
        """Bytes held by K and V."""
        return 2 * self.k.numel() * self.k.element_size()

    def gather_buffers(self, num_slots: int) -> tuple[Tensor, Tensor]:
        """Two flat buffers for ``num_slots`` gathered keys and values each (of the
        cache's dtype and device), kept and reused from step to step and layer to
        layer; grown (doubling) when a step needs more. Attention gathers every
        sequence's keys into one padded tensor per layer: allocated afresh each time,
        the large ones come from the OS page by page (on Linux, allocations past
        32 MiB are mapped and unmapped each time), which made a step of 64 sequences
        of 512 tokens cost 1.5x what the same work costs from reused memory."""
        need = num_slots * self.num_kv_heads * self.head_dim
        buffers = self._gather
        if buffers is None or buffers[0].numel() < need:
            size = max(need, 2 * buffers[0].numel() if buffers is not None else 0)
            buffers = (torch.empty(size, dtype=self.dtype, device=self.device),
                       torch.empty(size, dtype=self.dtype, device=self.device))
            self._gather = buffers
        return buffers

    def copy_slots(self, src: Tensor, dst: Tensor) -> None:
        """Copy K/V of slots ``src[i]`` to ``dst[i]`` in every layer.

        All sources are read before any destination is written, so the two may
        overlap; ``dst`` must not repeat a slot.
        """
        if src.dim() != 1 or dst.dim() != 1 or src.shape != dst.shape:
            raise ValueError(
                f"copy_slots needs two 1-D index tensors of one length, got "
                f"{tuple(src.shape)} and {tuple(dst.shape)}"
            )
        if src.numel() == 0:
            return
        src = src.to(device=self.k.device, dtype=torch.int64)
        dst = dst.to(device=self.k.device, dtype=torch.int64)
        self.k[:, dst] = self.k[:, src]
        self.v[:, dst] = self.v[:, src]


# ---------------------------------------------------------------------------------
# Batch description
# ---------------------------------------------------------------------------------


@dataclass
class ForwardBatch:
    """The new tokens of one step of several sequences, as index tensors.

    * ``input_ids``, ``positions``, ``slot_mapping``: ``[N]`` int64, the new tokens
      of all sequences concatenated, their RoPE positions and the KV slots their
      K/V are written to (before attention reads the cache).
    * ``query_index``: ``[B, Q]`` int64, the rows (into the N tokens) of each
      sequence's queries; padding is ``N``. Each of the N tokens must appear once.
    * ``kv_slots``: ``[B, T]`` int64, the KV slots each sequence attends to
      (padding: any valid slot, masked out).
    * ``attn_mask``: ``[B, Q, T]`` bool, True where a query may attend to a key.
    * ``logits_index``: ``[M]`` int64, which of the N tokens' logits are returned.
    * ``extra_groups``: more ``(query_index, kv_slots, attn_mask)`` triples of other
      sequences. ``build_batch`` puts sequences with very different numbers of new
      tokens (a prefill chunk, a long draft, a plain decode) in different groups, so
      that padding every sequence to the longest one does not multiply the cost of
      attention; each group is attended to with its own padding.
    """

    input_ids: Tensor
    positions: Tensor
    slot_mapping: Tensor
    query_index: Tensor
    kv_slots: Tensor
    attn_mask: Tensor
    logits_index: Tensor
    extra_groups: tuple[tuple[Tensor, Tensor, Tensor], ...] = ()

    def groups(self) -> list[tuple[Tensor, Tensor, Tensor]]:
        """Every ``(query_index, kv_slots, attn_mask)`` group."""
        return [(self.query_index, self.kv_slots, self.attn_mask), *self.extra_groups]

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_seqs(self) -> int:
        return sum(int(q.shape[0]) for q, _, _ in self.groups())

    def check(self) -> None:
        """Raise ``ValueError`` unless the tensors' shapes and dtypes fit together."""
        n = self.num_tokens
        for name in ("input_ids", "positions", "slot_mapping", "logits_index"):
            t = getattr(self, name)
            if t.dim() != 1 or t.dtype != torch.int64:
                raise ValueError(f"ForwardBatch.{name} must be a 1-D int64 tensor")
        if self.positions.shape[0] != n or self.slot_mapping.shape[0] != n:
            raise ValueError("ForwardBatch: input_ids, positions, slot_mapping differ in length")
        for query_index, kv_slots, attn_mask in self.groups():
            if query_index.dim() != 2 or query_index.dtype != torch.int64:
                raise ValueError("ForwardBatch.query_index must be a [B, Q] int64 tensor")
            if kv_slots.dim() != 2 or kv_slots.dtype != torch.int64:
                raise ValueError("ForwardBatch.kv_slots must be a [B, T] int64 tensor")
            b, q = query_index.shape
            t = kv_slots.shape[1]
            if kv_slots.shape[0] != b:
                raise ValueError("ForwardBatch: query_index and kv_slots differ in batch size")
            if attn_mask.dtype != torch.bool or tuple(attn_mask.shape) != (b, q, t):
                raise ValueError(
                    f"ForwardBatch.attn_mask must be bool [{b}, {q}, {t}], got "
                    f"{attn_mask.dtype} {tuple(attn_mask.shape)}"
                )


@dataclass(frozen=True)
class SeqInput:
    """One sequence's part of a step (see ``build_batch``).

    * ``token_ids``, ``positions``, ``new_slots``: the new tokens (at least one),
      their RoPE positions and the KV slots they are written to.
    * ``cached_slots``: KV slots of the sequence's earlier tokens, all attended to.
    * ``parents``: ``None`` when the new tokens form a causal chain; otherwise a
      tree, ``parents[i]`` being the index of the new token that token ``i``
      follows (``-1``: it follows the cached context), with ``parents[i] < i``.
    * ``num_logits``: logits are returned for the last ``num_logits`` new tokens.

    Sequences may be lists or numpy arrays (arrays are not copied on packing).
    """

    token_ids: Sequence[int] | np.ndarray
    positions: Sequence[int] | np.ndarray
    new_slots: Sequence[int] | np.ndarray
    cached_slots: Sequence[int] | np.ndarray = ()
    parents: Sequence[int] | np.ndarray | None = None
    num_logits: int = 1

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        if n < 1:
            raise ValueError("SeqInput needs at least one new token")
        if len(self.positions) != n:
            raise ValueError(f"SeqInput: {n} tokens but {len(self.positions)} positions")
        if len(self.new_slots) != n:
            raise ValueError(f"SeqInput: {n} tokens but {len(self.new_slots)} new slots")
        if isinstance(self.num_logits, bool) or not isinstance(self.num_logits, int) \
                or not 0 <= self.num_logits <= n:
            raise ValueError(f"SeqInput: num_logits must be an int in [0, {n}], "
                             f"got {self.num_logits!r}")
        if self.parents is not None:
            if len(self.parents) != n:
                raise ValueError(f"SeqInput: {n} tokens but {len(self.parents)} parents")
            for i, p in enumerate(self.parents):
                if not -1 <= int(p) < i:
                    raise ValueError(f"SeqInput: parents[{i}] = {p} is not in [-1, {i})")


def _tree_mask(parents: Sequence[int] | np.ndarray) -> np.ndarray:
    """``[n, n]`` bool: row i marks token i and its ancestors among the new tokens."""
    n = len(parents)
    anc = np.zeros((n, n), dtype=bool)
    for i in range(n):
        p = int(parents[i])
        if p >= 0:
            anc[i] = anc[p]
        anc[i, i] = True
    return anc


def _as_i64(x: Sequence[int] | np.ndarray) -> np.ndarray:
    return np.asarray(x, dtype=np.int64).reshape(-1)


def build_batch(inputs: Sequence[SeqInput], device: torch.device | str = "cpu", *,
                num_slots: int | None = None) -> ForwardBatch:
    """Pack one step of several sequences into a ``ForwardBatch``.

    A new token attends to all of its sequence's cached slots and to itself and
    its ancestors among the new tokens (in a chain: all earlier new tokens). A
    sequence's key row is ``cached_slots + new_slots``; padded key columns repeat
    its first new slot and are masked, padded query rows attend to column 0 only
    (so they stay finite). With ``num_slots``, slots are checked to be below it.
    Raises ``ValueError`` on inconsistent input or repeated new slots.
    """
    if len(inputs) == 0:
        raise ValueError("build_batch needs at least one sequence")
    ids_l, pos_l, new_l, cached_l = [], [], [], []
    for j, s in enumerate(inputs):
        if not isinstance(s, SeqInput):
            raise ValueError(f"build_batch: input {j} is not a SeqInput")
        ids_l.append(_as_i64(s.token_ids))
        pos_l.append(_as_i64(s.positions))
        new_l.append(_as_i64(s.new_slots))
        cached_l.append(_as_i64(s.cached_slots))
    ns = [a.shape[0] for a in ids_l]
    cs = [a.shape[0] for a in cached_l]
    n_total = sum(ns)

    input_ids = np.concatenate(ids_l)
    positions = np.concatenate(pos_l)
    slot_mapping = np.concatenate(new_l)
    if input_ids.min() < 0:
        raise ValueError("build_batch: negative token id")
    if positions.min() < 0:
        raise ValueError("build_batch: negative position")
    all_slots = [slot_mapping, *(c for c in cached_l if c.size)]
    lo = min(int(a.min()) for a in all_slots)
    hi = max(int(a.max()) for a in all_slots)
    if lo < 0:
        raise ValueError(f"build_batch: negative KV slot {lo}")
    if num_slots is not None and hi >= num_slots:
        raise ValueError(f"build_batch: KV slot {hi} out of range (cache has {num_slots})")
    if np.unique(slot_mapping).shape[0] != n_total:
        raise ValueError("build_batch: two new tokens are written to the same KV slot")

    offsets = np.concatenate(([0], np.cumsum(ns)))
    logits_index = np.concatenate([
        np.arange(offsets[i] + ns[i] - s.num_logits, offsets[i] + ns[i])
        for i, s in enumerate(inputs)]).astype(np.int64)

    def t(a: np.ndarray) -> Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).to(device)

    groups = []
    for members in _group_by_queries(ns):
        q_max = max(ns[i] for i in members)
        t_max = max(cs[i] + ns[i] for i in members)
        query_index = np.full((len(members), q_max), n_total, dtype=np.int64)
        kv_slots = np.empty((len(members), t_max), dtype=np.int64)
        mask = np.zeros((len(members), q_max, t_max), dtype=bool)
        for row, i in enumerate(members):
            s, n, c, offset = inputs[i], ns[i], cs[i], offsets[i]
            query_index[row, :n] = np.arange(offset, offset + n)
            kv_slots[row, :c] = cached_l[i]
            kv_slots[row, c:c + n] = new_l[i]
            kv_slots[row, c + n:] = new_l[i][0]
            mask[row, :n, :c] = True
            if s.parents is None:
                mask[row, :n, c:c + n] = np.tri(n, dtype=bool)
            else:
                mask[row, :n, c:c + n] = _tree_mask(s.parents)
            mask[row, n:, 0] = True
        groups.append((t(query_index), t(kv_slots), t(mask)))

    return ForwardBatch(
        input_ids=t(input_ids),
        positions=t(positions),
        slot_mapping=t(slot_mapping),
        query_index=groups[0][0],
        kv_slots=groups[0][1],
        attn_mask=groups[0][2],
        logits_index=t(logits_index),
        extra_groups=tuple(groups[1:]),
    )


def _group_by_queries(ns: Sequence[int], spread: int = 4) -> list[list[int]]:
    """Sequences (by index) grouped so that within a group the most new tokens is at
    most ``spread`` times the fewest: padded attention then costs at most about
    ``spread`` times the useful work, while a step of similar sequences stays one
    group (one attention call per layer)."""
    order = sorted(range(len(ns)), key=lambda i: (ns[i], i))
    groups: list[list[int]] = []
    for i in order:
        if groups and ns[i] <= spread * ns[groups[-1][0]]:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


# ---------------------------------------------------------------------------------
# Attention layer
# ---------------------------------------------------------------------------------


@dataclass
class GroupPlan:
    """One attention group's index tensors (see ``ForwardBatch.extra_groups``).

    * ``query_index``: ``[B * Q]`` rows of the zero-padded ``[N + 1]`` queries.
    * ``kv_slots``: ``[B * T]`` flat KV slots.
    * ``mask``: ``[B, 1, G * Q, T]`` bool, the mask repeated for the ``G`` query
      heads that share a key/value head; every row has at least one True.
    """

    num_seqs: int
    num_queries: int
    num_keys: int
    query_index: Tensor
    kv_slots: Tensor
    mask: Tensor


@dataclass
class PagedPlan:
    """Per-step index tensors shared by all layers (built once by ``plan_paged``):
    the groups, and ``token_to_query`` (``[N]``: each new token's row among the
    groups' outputs, concatenated)."""

    groups: list[GroupPlan]
    token_to_query: Tensor
    slot_mapping: Tensor
    # reused buffers for the gathered keys and values (``KVCache.gather_buffers``);
    # None: allocate per layer
    gather: tuple[Tensor, Tensor] | None = None

    @property
    def max_gathered_slots(self) -> int:
        """The most keys one group gathers (its sequences times its padded length)."""
        return max((grp.num_seqs * grp.num_keys for grp in self.groups), default=0)


def plan_paged(batch: ForwardBatch, num_kv_groups: int) -> PagedPlan:
    """Flatten ``batch``'s indices and expand its masks for grouped-query attention."""
    batch.check()
    n = batch.num_tokens
    device = batch.input_ids.device
    inverse = torch.zeros(n + 1, dtype=torch.int64, device=device)
    plans = []
    base = 0
    g = num_kv_groups
    for query_index, kv_slots, attn_mask in batch.groups():
        b, q = query_index.shape
        t = kv_slots.shape[1]
        qi = query_index.reshape(-1)
        inverse.scatter_(0, qi, torch.arange(base, base + b * q, dtype=torch.int64,
                                              device=device))
        base += b * q
        # a row without any key would make softmax NaN: let such rows see column 0
        # (done unconditionally, so that no device-to-host sync is needed)
        first = attn_mask[..., :1] | ~attn_mask.any(dim=-1, keepdim=True)
        mask = torch.cat((first, attn_mask[..., 1:]), dim=-1)
        mask = mask.unsqueeze(1).expand(b, g, q, t).reshape(b, 1, g * q, t)
        plans.append(GroupPlan(b, q, t, qi, kv_slots.reshape(-1), mask))
    return PagedPlan(plans, inverse[:n], batch.slot_mapping)


class Attention(nn.Module):
    """Multi-head attention with grouped key/value heads, RoPE and optional qk-norm.

    Parameter names follow Hugging Face: ``{q,k,v,o}_proj`` (biases as the config
    says) and ``{q,k}_norm`` for qwen3.
    """

    def __init__(self, config: ModelConfig, *, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        h, nh, nkv, hd = (config.hidden_size, config.num_attention_heads,
                          config.num_key_value_heads, config.head_dim)
        self.num_heads, self.num_kv_heads, self.head_dim = nh, nkv, hd
        self.num_kv_groups = nh // nkv
        bias = config.attention_bias
        self.q_proj = nn.Linear(h, nh * hd, bias=bias, dtype=dtype, device=device)
        self.k_proj = nn.Linear(h, nkv * hd, bias=bias, dtype=dtype, device=device)
        self.v_proj = nn.Linear(h, nkv * hd, bias=bias, dtype=dtype, device=device)
        self.o_proj = nn.Linear(nh * hd, h, bias=config.o_proj_bias, dtype=dtype, device=device)
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if config.qk_norm:
            self.q_norm = RMSNorm(hd, config.rms_norm_eps, dtype=dtype, device=device)
            self.k_norm = RMSNorm(hd, config.rms_norm_eps, dtype=dtype, device=device)

    def _qkv(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """q ``[..., heads, head_dim]``, k and v ``[..., kv_heads, head_dim]``, RoPE applied."""
        lead = x.shape[:-1]
        q = self.q_proj(x).view(*lead, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(*lead, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(*lead, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v

    def forward_dense(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """Causal self-attention of ``x[B, T, hidden]`` (``cos``/``sin``: ``[T, head_dim]``)."""
        bsz, t, _ = x.shape
        q, k, v = self._qkv(x, cos, sin)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
            is_causal=True, enable_gqa=self.num_kv_groups > 1,
        )
        o: Tensor = self.o_proj(out.transpose(1, 2).reshape(bsz, t, -1))
        return o

    def forward_paged(self, x: Tensor, cos: Tensor, sin: Tensor, plan: PagedPlan,
                      k_cache: Tensor, v_cache: Tensor) -> Tensor:
        """Attention of the N new tokens ``x[N, hidden]`` over a paged cache layer.

        ``k_cache``/``v_cache`` are one layer's ``[slots, kv_heads, head_dim]``; the
        new tokens' K/V are written to them first, then each sequence's keys are
        gathered at its ``kv_slots``.
        """
        g, nkv, hd = self.num_kv_groups, self.num_kv_heads, self.head_dim
        q, k, v = self._qkv(x, cos, sin)
        k_cache.index_copy_(0, plan.slot_mapping, k)
        v_cache.index_copy_(0, plan.slot_mapping, v)
        q_pad = torch.cat((q, q.new_zeros(1, self.num_heads, hd)), dim=0)
        outs = []
        for grp in plan.groups:
            b, nq, nt = grp.num_seqs, grp.num_queries, grp.num_keys
            if plan.gather is not None:
                size = b * nt * nkv * hd
                k_out = plan.gather[0][:size].view(b * nt, nkv, hd)
                v_out = plan.gather[1][:size].view(b * nt, nkv, hd)
                torch.index_select(k_cache, 0, grp.kv_slots, out=k_out)
                torch.index_select(v_cache, 0, grp.kv_slots, out=v_out)
            else:
                k_out = k_cache.index_select(0, grp.kv_slots)
                v_out = v_cache.index_select(0, grp.kv_slots)
            keys = k_out.view(b, nt, nkv, hd).transpose(1, 2)
            values = v_out.view(b, nt, nkv, hd).transpose(1, 2)
            # heads h = kv * G + j share kv head ``kv``: fold the G heads into the query axis
            queries = (q_pad.index_select(0, grp.query_index).view(b, nq, nkv, g, hd)
                       .permute(0, 2, 3, 1, 4).reshape(b, nkv, g * nq, hd))
            out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=grp.mask)
            outs.append(out.view(b, nkv, g, nq, hd).permute(0, 3, 1, 2, 4).reshape(b * nq, -1))
        rows = outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)
        o: Tensor = self.o_proj(rows.index_select(0, plan.token_to_query))
        return o
