"""The replica engine: schedule, draft, run, verify, in one ``step()``.

Knows: how a step is put together from the scheduler (which sequences and
chunks), the speculator (drafts, one batched call), the spec policy (how many
draft tokens each sequence verifies under the current load), the model (one
forward pass with tree attention over the paged KV cache) and verification
(lossless acceptance, sampling, logprobs). Does not know HTTP, routing or
environments; it never sleeps or spawns threads (``AsyncEngine`` drives it).

The correctness contract of speculation: greedy output with drafts equals the
output without, token for token; for temperature > 0 the output distribution is
exactly the model's (``verify.py``); logprobs are always the model's.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Callable, Iterable, Mapping
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from war.engine.attention import KVCache, SeqInput, build_batch
from war.engine.block_manager import BlockManager
from war.engine.config import EngineConfig
from war.engine.drafting import TrajectoryDrafts
from war.engine.loader import load_model, torch_device
from war.engine.model import CausalLM
from war.engine.model_config import ModelConfig
from war.engine.sampling import make_generator
from war.engine.scheduler import Scheduler
from war.engine.sequence import SeqStatus, Sequence
from war.engine.spec_policy import SpecPolicy, SpecPolicyConfig
from war.engine.stats import EngineStats, StepRecord
from war.engine.verify import TreeRows, Verified, truncate, verify_batch
from war.spec.speculator import SuffixSpeculator
from war.types import GenRequest, GenResult, ReplicaLoad, UnknownTrajectory

_TORCH_DTYPES = {
    "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
    "float64": torch.float64,
}


class Detokenizer(Protocol):
    """What the engine needs of a tokenizer: text of token ids (for stop strings)."""

    def decode(self, ids: list[int]) -> str: ...


@dataclass
class _Plan:
    """One sequence's part of a step."""

    seq: Sequence
    num_new: int  # tokens fed (pending/prefill chunk, plus drafts)
    num_logits: int
    draft_tokens: np.ndarray  # draft token ids fed after the pending token
    draft_parents: np.ndarray
    draft_probs: np.ndarray


def _outside_vocab(ids: Seq[object], vocab: int,
                   kinds: tuple[type[int] | type[np.integer[Any]], ...]) -> int | None:
    """The index of the first of ``ids`` that is no token id of a ``vocab``-token
    vocabulary (a bool, not of ``kinds``, or outside ``[0, vocab)``); None if none."""
    return next((i for i, t in enumerate(ids)
                 if isinstance(t, bool) or not isinstance(t, kinds) or not 0 <= t < vocab),
                None)


# What a weight update must not change: every field of a model config but its special
# token ids and its context length (which RoPE scaling has already read).
_ARCHITECTURE = tuple(f.name for f in dataclasses.fields(ModelConfig)
                      if f.name not in ("max_position_embeddings", "bos_token_id",
                                        "eos_token_id", "pad_token_id"))


def _architecture_differences(ours: ModelConfig, theirs: ModelConfig) -> list[str]:
    """The fields of ``_ARCHITECTURE`` in which two configs differ, as ``name (ours vs
    theirs)``."""
    return [f"{n} ({getattr(ours, n)!r} vs {getattr(theirs, n)!r})" for n in _ARCHITECTURE
            if getattr(ours, n) != getattr(theirs, n)]


# Stop strings: the old tokens decoded again with a step's new ones (the window)
# start at this many and double while that is too few (see ``stop_string_cut``).
_STOP_WINDOW_TOKENS = 8
# Characters at the start of a window whose text may differ from the full text's
# (decoded without the tokens before it: up to 3 lone UTF-8 continuation bytes of
# byte-level BPE, a word piece's "##", a first token's stripped leading space). A
# stop string is only looked for past them.
_STOP_WINDOW_SLACK = 16


def _common_prefix_len(a: str, b: str) -> int:
    """The length of the longest common prefix of ``a`` and ``b`` (linear time)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def stop_string_cut(detok: Detokenizer, ids: Seq[int], start: int, new: Seq[int],
                    stops: tuple[str, ...]) -> int | None:
    """How many of the ``new`` tokens to keep, given that they follow the output so far
    ``ids[start:]``, if a stop string completed among them: the least ``j >= 1`` for
    which the text of ``ids[start:] + new[:j]`` contains one of ``stops`` (the first
    completion wins, whichever stop it is, as decoding token by token would find it);
    None when the text of ``ids[start:] + new`` contains none (also when ``new`` or
    ``stops`` is empty).

    Assumes what the engine guarantees: the text of the output so far contains no
    stop string (else it would have stopped). A stop string can then only newly
    appear in text that the new tokens changed or added, or in the ``len(stop) - 1``
    characters before it. That text is found by decoding a window, the last few
    output tokens with the new ones, against the same window without them: past
    their common prefix. The window grows (doubling) until that common prefix is at
    least ``longest stop - 1 + _STOP_WINDOW_SLACK`` characters long, or is the whole
    output, so that where the text of the window's first tokens depends on the
    tokens before it (byte-level BPE: a token may be bytes of a character begun
    before it, and text ending in a partial character reads as U+FFFD until the
    character completes) lies before what is searched. Hence the cuts are those of
    decoding the whole output again at each of the ``new`` tokens (exactly so for
    detokenizers in which a token's text depends on at most ``_STOP_WINDOW_SLACK``
    characters' worth of tokens before it: byte-level BPE, word level, word pieces,
    characters), while the tokens decoded per call are O(new tokens + longest stop):
    the new tokens and those that hold the last ``longest stop + _STOP_WINDOW_SLACK``
    characters or so, not O(output). (Times the new tokens in the one step in which
    a stop completes, to find the first token that completes it.)
    """
    if not new or not stops:
        return None
    reach = max(len(s) for s in stops) - 1 + _STOP_WINDOW_SLACK
    new = list(new)
    size = _STOP_WINDOW_TOKENS
    while True:
        lo = max(len(ids) - size, start)
        cut = _stop_cut_in_window(detok, list(ids[lo:]), new, stops,
                                  reach if lo > start else 0)
        if cut != -1:
            return cut
        size *= 2


def _stop_cut_in_window(detok: Detokenizer, old: list[int], new: list[int],
                        stops: tuple[str, ...], reach: int) -> int | None:
    """``stop_string_cut`` for a window of the ``old`` output tokens before the
    ``new`` ones; -1 where a decoded window and the window without the new tokens
    share fewer than ``reach`` leading characters (a wider window is needed)."""
    before = detok.decode(old)

    def completes(j: int) -> bool | None:
        text = detok.decode(old + new[:j])
        same = _common_prefix_len(before, text)
        if same < reach:
            return None
        # Text up to ``same`` is the old text's, which holds no stop string.
        return any(s in text[max(same - len(s) + 1, 0):] for s in stops)

    hit = completes(len(new))
    if not hit:
        return None if hit is False else -1
    for j in range(1, len(new)):
        hit = completes(j)
        if hit is None:
            return -1
        if hit:
            return j
    return len(new)


class Engine:
    """One replica: continuous batching with prefix caching and load-aware
    speculation. Not thread-safe; one loop calls ``step()``."""

    def __init__(
        self,
        model: CausalLM,
        config: EngineConfig | None = None,
        tokenizer: Detokenizer | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.config = config if config is not None else EngineConfig()
        cfg = self.config
        self.device = torch_device(cfg.device)
        self.dtype = _TORCH_DTYPES[cfg.dtype]
        self.model = model.to(device=self.device, dtype=self.dtype).eval()
        self.model_config = model.config
        self.tokenizer = tokenizer
        self._clock = clock
        mc = self.model_config
        self.max_model_len = cfg.max_model_len or mc.max_position_embeddings
        num_blocks = cfg.num_kv_blocks or KVCache.blocks_for_bytes(
            mc, cfg.kv_cache_bytes, cfg.block_size, self.dtype)
        self.kv = KVCache.for_model(mc, num_blocks, cfg.block_size, self.dtype, self.device)
        self.blocks = BlockManager(num_blocks, cfg.block_size, cfg.enable_prefix_cache)
        self.scheduler = Scheduler(self.blocks, cfg.max_num_seqs, cfg.max_num_batched_tokens,
                                   cfg.kv_hold_s, cfg.admit_whole_prompt)
        self.speculator = SuffixSpeculator(cfg.spec)
        self.drafts = TrajectoryDrafts(self.speculator, cfg.max_idle_trajectories)
        # Prefill tokens count as useful work: a step that carries a large prefill
        # chunk is not a reason to verify long, unlikely drafts.
        self.policy = SpecPolicy(SpecPolicyConfig(
            mode=cfg.spec_mode, max_spec_tokens_per_seq=cfg.spec.max_spec_tokens,
            prefill_token_value=1.0))
        self.stats = EngineStats()
        self.weight_version = 0
        self._generator = torch.Generator().manual_seed(cfg.seed)
        self._seqs: dict[str, Sequence] = {}
        self._done: list[Sequence] = []  # done in a step that raised, not finished yet
        self._arrivals = 0
        # The most recent steps, for timelines and reports (bounded).
        self.timeline: collections.deque[StepRecord] = collections.deque(maxlen=200_000)

    @classmethod
    def from_pretrained(
        cls, path: str | Path, config: EngineConfig | None = None,
        tokenizer: Detokenizer | None = None,
    ) -> Engine:
        """Loads a Hugging Face folder (``config.json``, ``*.safetensors``); the
        tokenizer (``tokenizer.json``) is loaded too when present and not given."""
        cfg = config if config is not None else EngineConfig()
        model = load_model(path, dtype=_TORCH_DTYPES[cfg.dtype], device=cfg.device)
        if tokenizer is None and (Path(path) / "tokenizer.json").is_file():
            from tokenizers import Tokenizer

            tokenizer = Tokenizer.from_file(str(Path(path) / "tokenizer.json"))
        return cls(model, cfg, tokenizer)

    # ------------------------------------------------------------ requests

    def add_request(self, request: GenRequest) -> None:
        """Queues a request; raises ValueError (naming it) if it cannot be served."""
        self.add_requests([request])

    def add_requests(self, requests: Iterable[GenRequest]) -> None:
        """Queues several requests, all or none: every one is checked before any is
        queued, so a ``ValueError`` (naming the request) leaves the engine, its
        trajectories and their held contexts as they were. The requests are checked
        as if added one after another: a continuing request whose trajectory an
        earlier one of them names finds it taken (``UnknownTrajectory``)."""
        checked: list[GenRequest] = []
        ids: set[str] = set()
        named: set[str] = set()
        for request in requests:
            rid = request.request_id
            if rid in ids:
                raise ValueError(f"request {rid} appears twice in one batch")
            checked.append(self._checked(request, taken=named))
            ids.add(rid)
            if request.trajectory_id is not None:
                named.add(request.trajectory_id)
        for request in checked:
            self._admit(request)

    def held_length(self, trajectory_id: str) -> int | None:
        """How many tokens a continuing request of ``trajectory_id`` is appended to
        (its last prompt and output); None when the trajectory is not held."""
        held = self.drafts.held_tokens(trajectory_id)
        return None if held is None else len(held)

    def _checked(self, request: GenRequest, taken: set[str]) -> GenRequest:
        """``request`` with a continuing request's held context prepended, once it is
        known to be servable (``taken``: trajectories that requests queued before it
        take over). Changes nothing; raises ValueError naming the request."""
        rid = request.request_id
        if rid in self._seqs:
            raise ValueError(f"request {rid} is already in flight")
        if request.continues:
            assert request.trajectory_id is not None
            held = self.drafts.held_tokens(request.trajectory_id)
            if held is None or request.trajectory_id in taken:
                raise UnknownTrajectory(
                    f"request {rid}: trajectory {request.trajectory_id} is not held by this "
                    "replica (or has a request in flight); send the whole context")
            request = dataclasses.replace(
                request, prompt_ids=(*held, *request.prompt_ids), continues=False)
        vocab = self.model_config.vocab_size
        bad = _outside_vocab(request.prompt_ids, vocab, (int,))
        if bad is not None:
            tok = request.prompt_ids[bad]
            if isinstance(tok, bool) or not isinstance(tok, int):  # (numpy ints read "outside")
                raise ValueError(f"request {rid}: prompt_ids[{bad}] = {tok!r} is not an int")
            raise ValueError(f"request {rid}: token id {tok!r} outside the vocabulary "
                             f"[0, {vocab})")
        sp = request.sampling
        for t in sp.stop_token_ids:
            if t >= vocab:
                raise ValueError(f"request {rid}: stop token id {t} outside the vocabulary")
        total = len(request.prompt_ids) + sp.max_tokens
        if total > self.max_model_len:
            raise ValueError(
                f"request {rid}: prompt ({len(request.prompt_ids)}) + max_tokens "
                f"({sp.max_tokens}) = {total} exceeds the context length {self.max_model_len}")
        capacity = self.kv.num_blocks * self.kv.block_size
        if total > capacity:
            raise ValueError(
                f"request {rid}: {total} tokens exceed the KV cache ({capacity} tokens)")
        if sp.stop and self.tokenizer is None:
            raise ValueError(f"request {rid}: stop strings need an engine with a tokenizer")
        return request

    def _admit(self, request: GenRequest) -> None:
        """Queues a request ``_checked`` returned."""
        sp = request.sampling
        sid = self.drafts.begin(request.prompt_ids, request.trajectory_id, request.group_id)
        self._arrivals += 1
        seq = Sequence(request, sid, self._arrivals,
                       make_generator(sp.seed, self._generator), self._clock())
        self._seqs[request.request_id] = seq
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> GenResult | None:
        """Stops a request; returns its partial result (None if unknown). Its
        trajectory's held context is let go of, whether the request was running (it
        had taken the hold over) or still queued (the hold it would have taken over
        ends, unless another turn of the trajectory is queued); the blocks stay in the
        prefix cache, and the trajectory's next turn sends its whole context."""
        seq = self._seqs.get(request_id)
        if seq is None:
            return None
        seq.finish_reason = "abort"
        self.stats.num_aborted += 1
        return self._finish(seq, commit=False)

    def has_unfinished(self) -> bool:
        return bool(self._seqs)

    @property
    def num_unfinished(self) -> int:
        return len(self._seqs)

    def generate(self, requests: Iterable[GenRequest]) -> list[GenResult]:
        """Runs requests to completion; results in the order given."""
        reqs = list(requests)
        self.add_requests(reqs)
        wanted = {r.request_id for r in reqs}
        done: dict[str, GenResult] = {}
        while wanted - done.keys():
            for res in self.step():
                done[res.request_id] = res
            if self.scheduler.blocked:
                # Nothing can send the held trajectories' next turns during this call.
                self.scheduler.break_hold()
        return [done[r.request_id] for r in reqs]

    def finish_trajectory(self, trajectory_id: str) -> bool:
        """The trajectory has ended: releases the KV held for its next turn (see
        ``EngineConfig.kv_hold_s``); False if none was held."""
        return self.scheduler.release_hold(trajectory_id)

    def wait_s(self) -> float | None:
        """When the last step ran nothing because held contexts fill the KV: seconds
        until the first hold expires (a new request may end the wait sooner); else
        None."""
        if not self.scheduler.blocked:
            return None
        expiry = self.scheduler.hold_expiry
        return None if expiry is None else max(expiry - self._clock(), 0.0)

    # ------------------------------------------------------------ history and weights

    def add_history(self, token_ids: Seq[int], group_id: str | None = None) -> None:
        """Adds a completed response (from another replica) to the draft history;
        raises ValueError (changing nothing) for a token id outside the vocabulary,
        which drafts would otherwise feed to the model in a later step."""
        ids = list(token_ids)
        vocab = self.model_config.vocab_size
        bad = _outside_vocab(ids, vocab, (int, np.integer))
        if bad is not None:
            raise ValueError(f"history token id {ids[bad]!r} outside the vocabulary [0, {vocab})")
        self.speculator.add_history(ids, group_id)

    def observe_rl_step(self, rl_step: int) -> None:
        """Advances the draft history's sliding window of RL steps."""
        self.speculator.observe_step(rl_step)

    def load_weights(self, weights: Mapping[str, torch.Tensor] | str | Path) -> int:
        """Replaces the model's weights (a state dict or a Hugging Face folder).

        In-flight sequences are preempted and recomputed with the new weights;
        the prefix cache is cleared. Returns the new weight version. A folder whose
        config describes another architecture (``_ARCHITECTURE``) is a ValueError, and
        so are tensors that do not fit; either changes nothing."""
        if isinstance(weights, (str, Path)):
            # Only the weights are taken: a folder of another architecture whose tensors
            # have the same shapes (an untied head, another norm eps or RoPE) would
            # load into a model that is neither.
            differ = _architecture_differences(
                self.model_config, ModelConfig.from_file(Path(weights) / "config.json"))
            if differ:
                raise ValueError(f"{weights}: the model's config differs from the engine's "
                                 f"in {', '.join(differ)}")
            weights = load_model(weights, dtype=self.dtype, device=self.device).state_dict()
        self.model.load_weights(weights)  # validates before changing anything
        self.stats.num_preemptions += len(self.scheduler.preempt_all())
        self.blocks.clear_cache()
        self.weight_version += 1
        return self.weight_version

    # ------------------------------------------------------------ load

    def load(self) -> ReplicaLoad:
        running = self.scheduler.running
        waiting = self.scheduler.waiting
        in_flight = sum(s.num_tokens for s in running) + sum(s.num_tokens for s in waiting)
        return ReplicaLoad(
            num_running=len(running), num_waiting=len(waiting), tokens_in_flight=in_flight,
            kv_blocks_used=self.blocks.num_used_blocks, kv_blocks_total=self.kv.num_blocks,
            block_size=self.kv.block_size,
            spec_tokens_per_seq=self.stats.last_spec_tokens / max(self.stats.last_num_seqs, 1),
            weight_version=self.weight_version,
        )

    # ------------------------------------------------------------ the step

    def step(self) -> list[GenResult]:
        """Runs one forward pass over the scheduled batch; returns finished requests."""
        if self._done:  # requests done in a step that raised later
            late, self._done = self._done, []
            return [self._finish(s, commit=True) for s in late
                    if self._seqs.get(s.request_id) is s]
        t0 = self._clock()
        sched = self.scheduler.schedule(t0)
        self.stats.num_preemptions += len(sched.preempted)
        if sched.is_empty:
            return []
        accepted_before = self.stats.num_accepted_tokens
        plans = [self._prefill_plan(seq, n) for seq, n in sched.prefills]
        context = sum(s.num_computed + n for s, n in sched.prefills)
        context += sum(s.num_computed + 1 for s in sched.decodes)
        plans += self._decode_plans(sched.decodes, sched.num_batched_tokens, context)
        inputs = [self._seq_input(p) for p in plans]
        with torch.inference_mode():
            logits = self.model.forward(build_batch(inputs, self.device), self.kv)
        # One batched verification for every sequence that samples this step.
        sampling = [p for p in plans if p.num_logits]
        trees, row = [], 0
        for p in sampling:
            trees.append(TreeRows(row, p.draft_tokens.tolist(), p.draft_parents.tolist()))
            row += p.num_logits
        verified = verify_batch(logits, trees, [p.seq.request.sampling for p in sampling],
                                [p.seq.generator for p in sampling])
        outcome = dict(zip((id(p) for p in sampling), verified, strict=True))
        verified_probs: list[np.ndarray] = []  # the step's draft tokens, all sequences
        verified_ok: list[np.ndarray] = []
        done: list[Sequence] = []
        try:
            for plan in plans:
                if self._postprocess(plan, outcome.get(id(plan)), verified_probs, verified_ok):
                    done.append(plan.seq)
        except BaseException:
            # Finished only once the whole step applies: a request whose result the
            # raise would lose must not commit its turn (its trajectory, its KV hold).
            # The next step returns it, unless it is aborted first.
            self._done.extend(done)
            raise
        finished = [self._finish(seq, commit=True) for seq in done]
        if verified_probs:  # the calibration learns from the whole step at once
            self.policy.observe_verification(np.concatenate(verified_probs),
                                             np.concatenate(verified_ok))
        elapsed = self._clock() - t0
        batch_tokens = sum(p.num_new for p in plans)
        num_drafts = sum(len(p.draft_tokens) for p in plans)
        if elapsed > 0:  # a clock that did not advance (or went back) measured nothing
            self.policy.observe_step(batch_tokens, context + num_drafts, elapsed)
        st = self.stats
        st.num_steps += 1
        st.total_step_s += elapsed
        st.last_step_s = elapsed
        st.last_batch_tokens = batch_tokens
        st.last_num_seqs = len(plans)
        st.last_spec_tokens = num_drafts
        st.total_spec_budget += st.last_spec_tokens
        self.timeline.append(StepRecord(
            self._clock(), len(plans), len(sched.decodes), self.scheduler.num_waiting,
            batch_tokens, num_drafts, st.num_accepted_tokens - accepted_before, elapsed))
        return finished

    def _prefill_plan(self, seq: Sequence, n: int) -> _Plan:
        if seq.first_scheduled_s is None:
            seq.first_scheduled_s = self._clock()
        completes = seq.num_computed + n == seq.num_tokens
        empty_i = np.zeros(0, dtype=np.int64)
        return _Plan(seq, n, 1 if completes else 0, empty_i, empty_i, np.zeros(0))

    def _decode_plans(
        self, decodes: list[Sequence], base_tokens: int, context: int
    ) -> list[_Plan]:
        empty_i = np.zeros(0, dtype=np.int64)
        if not decodes:
            return []
        if self.config.spec_mode == "off":
            return [_Plan(s, 1, 1, empty_i, empty_i, np.zeros(0)) for s in decodes]
        drafts = self.drafts.propose([s.spec_id for s in decodes], self.config.spec.max_spec_tokens)
        offsets = drafts.offsets
        probs: list[np.ndarray] = []
        for i, seq in enumerate(decodes):
            # Never draft past the request's last token (one more comes from the model).
            room = seq.request.sampling.max_tokens - seq.num_output - 1
            a, b = int(offsets[i]), int(offsets[i + 1])
            probs.append(drafts.probs[a: a + max(0, min(b - a, room))])
        chosen = self.policy.choose(probs, base_tokens, context)
        room_tokens = self.config.max_num_batched_tokens - base_tokens
        plans = []
        for i, seq in enumerate(decodes):
            k = int(min(int(chosen[i]), len(probs[i]), max(room_tokens, 0)))
            if k > 0:
                k = min(k, self.scheduler.reserve(seq, seq.num_tokens + k) - seq.num_tokens)
            k = max(k, 0)
            room_tokens -= k
            a = int(offsets[i])
            plans.append(_Plan(
                seq, 1 + k, 1 + k,
                drafts.token_ids[a: a + k].astype(np.int64),
                drafts.parents[a: a + k].astype(np.int64),
                probs[i][:k],
            ))
        return plans

    def _seq_input(self, plan: _Plan) -> SeqInput:
        seq = plan.seq
        bs = self.kv.block_size
        table = seq.block_table
        start = seq.num_computed
        k = len(plan.draft_tokens)
        n_base = plan.num_new - k
        tokens = seq.token_ids[start: start + n_base] + plan.draft_tokens.tolist()
        positions = list(range(start, start + n_base))
        parents: list[int] | None = None
        if k:
            depth = np.zeros(k, dtype=np.int64)
            for j, p in enumerate(plan.draft_parents.tolist()):
                depth[j] = 1 if p < 0 else depth[p] + 1
            positions += (start + depth).tolist()  # start is the pending token's position
            parents = [-1] + [(0 if p < 0 else p + 1) for p in plan.draft_parents.tolist()]
        # A new token at flat index i is written to the slot of position start + i.
        new_pos = np.arange(start, start + plan.num_new)
        tbl = np.asarray(table, dtype=np.int64)
        new_slots = tbl[new_pos // bs] * bs + new_pos % bs
        cached_pos = np.arange(start)
        cached_slots = tbl[cached_pos // bs] * bs + cached_pos % bs
        return SeqInput(tokens, positions, new_slots, cached_slots, parents, plan.num_logits)

    def _postprocess(self, plan: _Plan, ver: Verified | None, verified_probs: list[np.ndarray],
                     verified_ok: list[np.ndarray]) -> bool:
        """Applies a sequence's step outcome; True when the request is done (its
        ``finish_reason`` is set; the caller finishes it). Its draft tokens' predicted
        probabilities and acceptance are appended to ``verified_probs`` and
        ``verified_ok``. What may raise (the KV copy, the detokenizer, the speculator)
        runs before the sequence changes, so that an error leaves its tokens, KV and
        draft tree in step: as before this step, to be computed again."""
        seq = plan.seq
        if ver is None:  # a prefill chunk that does not reach the end yet
            seq.num_computed += plan.num_new
            self.scheduler.publish(seq)
            return False
        sp = seq.request.sampling
        start = seq.num_computed  # the first fed token's position
        k = len(plan.draft_tokens)
        m = len(ver.accepted)
        tokens, logprobs, stopped = truncate(
            list(ver.tokens), list(ver.logprobs), sp.stop_token_ids, sp.max_tokens - seq.num_output)
        if sp.stop:
            # Even when a stop token ended the step's tokens: with drafts one step emits
            # several, and a stop string may complete before that token. The first cut
            # wins, as decoding token by token would have found it first.
            cut = self._stop_string_cut(seq.token_ids, seq.num_prompt, tokens, sp.stop)
            if cut is not None:
                tokens, logprobs = tokens[:cut], logprobs[:cut]
                stopped = True
        if m:
            # Move accepted tree nodes' KV to the positions they now hold (slots past
            # what the sequence has computed: harmless should a later call raise).
            pos0 = start + 1
            src = [pos0 + a for a in ver.accepted]
            dst = [pos0 + j for j in range(m)]
            if src != dst:
                self.kv.copy_slots(self._slots(seq, src), self._slots(seq, dst))
        if tokens:
            self.drafts.extend(seq.spec_id, tokens)
        if k:
            accepted = np.zeros(k, dtype=bool)
            accepted[list(ver.accepted)] = True
            verified_probs.append(plan.draft_probs)
            verified_ok.append(accepted)
            seq.num_draft_tokens += k
            seq.num_accepted_tokens += m
            self.stats.num_draft_tokens += k
            self.stats.num_accepted_tokens += m
        fed_end = start + plan.num_new - k  # positions < fed_end have KV now
        seq.num_computed = fed_end + min(len(tokens), m)
        seq.token_ids.extend(tokens)
        seq.logprobs.extend(logprobs)
        seq.num_forward_passes += 1
        self.stats.num_decode_passes += 1
        self.stats.num_generated_tokens += len(tokens)
        self.scheduler.trim(seq, seq.num_tokens)
        self.scheduler.publish(seq)
        if stopped or seq.num_output >= sp.max_tokens:
            seq.finish_reason = "stop" if stopped else "length"
            return True
        return False

    def _stop_string_cut(self, ids: Seq[int], start: int, new: Seq[int],
                         stops: tuple[str, ...]) -> int | None:
        """How many of this step's ``new`` tokens to keep if a stop string completed
        among them (None: no stop string); the output so far is ``ids[start:]`` (not
        copied). See ``stop_string_cut``: the work does not grow with the output."""
        assert self.tokenizer is not None
        return stop_string_cut(self.tokenizer, ids, start, new, stops)

    def _slots(self, seq: Sequence, positions: list[int]) -> torch.Tensor:
        bs = self.kv.block_size
        pos = np.asarray(positions, dtype=np.int64)
        slots = np.asarray(seq.block_table, dtype=np.int64)[pos // bs] * bs + pos % bs
        return torch.from_numpy(slots).to(self.device)

    def _finish(self, seq: Sequence, commit: bool) -> GenResult:
        self.scheduler.finish(seq, self._clock(), hold=commit)
        self.drafts.end(seq.spec_id, seq.request.trajectory_id, commit=commit)
        del self._seqs[seq.request_id]
        if seq.finish_reason != "abort":
            self.stats.num_finished += 1
        self.stats.num_prompt_tokens += seq.num_prompt
        self.stats.num_cached_prompt_tokens += seq.num_cached_tokens
        return seq.result(self.weight_version, self._clock())

    def check_integrity(self) -> None:
        """Expensive consistency checks (for tests)."""
        self.blocks.check_integrity()
        self.speculator.check_integrity()
        for seq in self.scheduler.running:
            assert seq.status is SeqStatus.RUNNING, f"request {seq.request_id} not running"
            assert len(seq.block_table) * self.kv.block_size >= seq.num_computed, (
                f"request {seq.request_id} lacks blocks for its KV")
