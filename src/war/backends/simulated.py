"""Replicas without a model, for router tests, fault tests and benchmarks.

Knows: ``SimulatedBackend``, a replica that answers with deterministic tokens
after a delay taken from a cost model (``step_time(batch_tokens, context_tokens)
-> seconds``, one prefill step and one decode step per output token) on an
injectable clock; it tracks what it has in flight (for ``load()``), keeps the
contexts of finished trajectories (so ``continues`` works, and fails with
``UnknownTrajectory`` for what it does not hold), records shared history, and
fails on demand (``fail_after_n``: the call after the first ``n`` crashes the
replica; ``set_down(True)``: the replica is down, its in-flight requests fail
with ``ReplicaUnavailable`` and its trajectories are lost, until
``set_down(False)``). ``InstantBackend`` answers at once by echoing the prompt.

Does not know real models or batching: the delay of a request is computed once,
when it starts, from the replica's load at that moment (a placeholder the
simulator extends).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from typing import Protocol

from war.backends.base import ReplicaUnavailable
from war.types import GenRequest, GenResult, ReplicaLoad, UnknownTrajectory

StepTime = Callable[[int, int], float]
"""``step_time(batch_tokens, context_tokens) -> seconds`` of one forward pass."""


class Clock(Protocol):
    """Time for simulated replicas: ``now()`` in seconds and ``sleep(seconds)``."""

    def now(self) -> float: ...

    async def sleep(self, seconds: float) -> None: ...


class RealClock:
    """Wall time: ``time.monotonic`` and ``asyncio.sleep``."""

    def now(self) -> float:
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


def default_step_time(batch_tokens: int, context_tokens: int) -> float:
    """A small GPU-like step: 2 ms fixed, 20 us per batched token, 5 ns per context token."""
    return 2e-3 + 2e-5 * batch_tokens + 5e-9 * context_tokens


def echo_output(request: GenRequest, max_tokens: int) -> tuple[tuple[int, ...], str]:
    """The prompt repeated up to ``max_tokens`` tokens, cut after a stop token."""
    prompt = request.prompt_ids
    stops = set(request.sampling.stop_token_ids)
    out: list[int] = []
    for i in range(max_tokens):
        t = prompt[i % len(prompt)]
        out.append(t)
        if t in stops:
            return tuple(out), "stop"
    return tuple(out), "length" if max_tokens == request.sampling.max_tokens else "stop"


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def _check_int(what: str, value: int, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{what} must be an int >= {low}, got {value!r}")


class SimulatedBackend:
    """A replica that takes simulated time. See the module docstring.

    * ``step_time``: the cost model; ``clock``: ``RealClock()`` by default.
    * ``output_len(request)``: tokens to generate before stopping on its own
      (``None``: ``max_tokens``); the result is ``length`` only when it reaches
      ``max_tokens``. A stop token id among the outputs ends it earlier.
    * ``vocab_size``: outputs are in ``[0, vocab_size)``.
    * ``kv_blocks_total`` x ``block_size``: the KV capacity reported by ``load()``.
    * ``max_trajectories``: finished trajectories held for ``continues``.
    * ``fail_after_n``: the first ``n`` ``generate`` calls run, the next one
      crashes the replica (once; ``set_down(False)`` revives it for good).
    """

    def __init__(
        self,
        name: str,
        step_time: StepTime = default_step_time,
        *,
        clock: Clock | None = None,
        output_len: Callable[[GenRequest], int] | None = None,
        vocab_size: int = 32_000,
        kv_blocks_total: int = 4096,
        block_size: int = 16,
        max_trajectories: int = 10_000,
        fail_after_n: int | None = None,
    ) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"a backend name must be a non-empty string, got {name!r}")
        _check_int("vocab_size", vocab_size, 1)
        _check_int("kv_blocks_total", kv_blocks_total, 1)
        _check_int("block_size", block_size, 1)
        _check_int("max_trajectories", max_trajectories, 0)
        if fail_after_n is not None:
            _check_int("fail_after_n", fail_after_n, 0)
        self.name = name
        self.step_time = step_time
        self.clock: Clock = clock if clock is not None else RealClock()
        self.output_len = output_len
        self.vocab_size = vocab_size
        self.kv_blocks_total = kv_blocks_total
        self.block_size = block_size
        self.max_trajectories = max_trajectories
        self.fail_after_n = fail_after_n
        self.down = False
        self.num_calls = 0  # generate calls received
        self.num_completed = 0
        self.num_failed = 0
        self.history: deque[tuple[tuple[int, ...], str | None]] = deque(maxlen=10_000)
        self._crashed = False  # fail_after_n has fired
        self._crash = asyncio.Event()  # set when the replica goes down; then replaced
        self._inflight: dict[str, int] = {}  # request id -> tokens (prompt + output)
        self._held: OrderedDict[str, tuple[int, ...]] = OrderedDict()

    def __repr__(self) -> str:
        return f"SimulatedBackend({self.name!r}, down={self.down})"

    # ---- failure injection

    def set_down(self, down: bool) -> None:
        """Takes the replica down (in-flight requests fail, trajectories are lost) or
        brings it back up."""
        if down and not self.down:
            self._held.clear()
            self._crash.set()  # wakes the in-flight requests, which then fail
            self._crash = asyncio.Event()
        self.down = down

    def _check_up(self) -> None:
        if self.down:
            raise ReplicaUnavailable(f"{self.name} is down")

    # ---- generation

    def tokens(self, request: GenRequest, context: Sequence[int]) -> tuple[
            tuple[int, ...], tuple[float, ...], str]:
        """The deterministic output of ``request`` over its whole ``context``."""
        sp = request.sampling
        want = sp.max_tokens
        if self.output_len is not None:
            want = max(1, min(sp.max_tokens, int(self.output_len(request))))
        base = (len(context) * 131 + context[-1] * 31 + (sp.seed or 0) * 7) % self.vocab_size
        stops = set(sp.stop_token_ids)
        out: list[int] = []
        reason = "length" if want == sp.max_tokens else "stop"
        for i in range(want):
            t = (base + 17 * i + 1) % self.vocab_size
            out.append(t)
            if t in stops:
                reason = "stop"
                break
        logprobs = tuple(-(0.05 + (t % 10) / 20) for t in out) if sp.logprobs else ()
        return tuple(out), logprobs, reason

    def delay(self, new_tokens: int, context_tokens: int, num_out: int) -> float:
        """Seconds to serve a request: one prefill step of ``new_tokens`` and
        ``num_out`` decode steps batched with what is in flight now."""
        batch = len(self._inflight) + 1
        context = sum(self._inflight.values()) + context_tokens + num_out
        return self.step_time(new_tokens, context_tokens) + num_out * self.step_time(
            batch, context)

    async def generate(self, request: GenRequest) -> GenResult:
        self.num_calls += 1
        if self.fail_after_n is not None and not self._crashed \
                and self.num_calls > self.fail_after_n:
            self._crashed = True
            self.set_down(True)
        self._check_up()
        rid = request.request_id
        if rid in self._inflight:
            raise ValueError(f"request {rid} is already in flight on {self.name}")
        held: tuple[int, ...] = ()
        if request.trajectory_id is not None:
            held = self._held.pop(request.trajectory_id, ())
        if request.continues and not held:
            raise UnknownTrajectory(
                f"request {rid}: trajectory {request.trajectory_id} is not held by "
                f"{self.name}; send the whole context")
        if request.continues:
            context, cached = (*held, *request.prompt_ids), len(held)
        else:  # the whole context: what it shares with the held one is cached
            context, cached = request.prompt_ids, _common_prefix(held, request.prompt_ids)
        output, logprobs, reason = self.tokens(request, context)
        seconds = self.delay(len(context) - cached, len(context), len(output))
        crash = self._crash
        start = self.clock.now()
        self._inflight[rid] = len(context) + len(output)
        try:
            await self._sleep_unless_crash(max(seconds, 0.0), crash)
        finally:
            del self._inflight[rid]
        if crash.is_set():
            self.num_failed += 1
            raise ReplicaUnavailable(f"{self.name} went down during request {rid}")
        if request.trajectory_id is not None and self.max_trajectories > 0:
            self._held[request.trajectory_id] = (*context, *output)
            while len(self._held) > self.max_trajectories:
                self._held.popitem(last=False)
        self.num_completed += 1
        return GenResult(
            request_id=rid, output_ids=output, logprobs=logprobs, finish_reason=reason,
            num_prompt_tokens=len(context), num_cached_tokens=cached,
            num_forward_passes=len(output), total_s=self.clock.now() - start,
        )

    async def _sleep_unless_crash(self, seconds: float, crash: asyncio.Event) -> None:
        sleep = asyncio.ensure_future(self.clock.sleep(seconds))
        woken = asyncio.ensure_future(crash.wait())
        try:
            await asyncio.wait({sleep, woken}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            sleep.cancel()
            woken.cancel()

    # ---- the rest of the contract

    @property
    def num_in_flight(self) -> int:
        return len(self._inflight)

    async def load(self) -> ReplicaLoad:
        self._check_up()
        tokens = sum(self._inflight.values())
        used = sum(math.ceil(n / self.block_size) for n in self._inflight.values())
        return ReplicaLoad(
            num_running=len(self._inflight), num_waiting=0, tokens_in_flight=tokens,
            kv_blocks_used=min(used, self.kv_blocks_total),
            kv_blocks_total=self.kv_blocks_total, block_size=self.block_size)

    async def health(self) -> bool:
        return not self.down

    async def add_history(self, items: Sequence[tuple[Sequence[int], str | None]]) -> None:
        self._check_up()
        for ids, group in items:
            self.history.append((tuple(ids), group))

    async def close(self) -> None:
        self.set_down(True)


class InstantBackend:
    """A replica that answers at once (no await inside ``generate``) with the prompt
    echoed up to ``min(max_tokens, max_output_tokens)`` tokens: for measuring the
    router's own overhead. Accepts ``continues`` (it needs no context)."""

    def __init__(self, name: str, max_output_tokens: int = 16) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"a backend name must be a non-empty string, got {name!r}")
        _check_int("max_output_tokens", max_output_tokens, 1)
        self.name = name
        self.max_output_tokens = max_output_tokens
        self.down = False
        self.num_requests = 0
        self.num_history_items = 0

    def __repr__(self) -> str:
        return f"InstantBackend({self.name!r})"

    def set_down(self, down: bool) -> None:
        self.down = down

    async def generate(self, request: GenRequest) -> GenResult:
        if self.down:
            raise ReplicaUnavailable(f"{self.name} is down")
        self.num_requests += 1
        n = min(request.sampling.max_tokens, self.max_output_tokens)
        output, reason = echo_output(request, n)
        logprobs = (0.0,) * len(output) if request.sampling.logprobs else ()
        return GenResult(request_id=request.request_id, output_ids=output, logprobs=logprobs,
                         finish_reason=reason, num_prompt_tokens=len(request.prompt_ids),
                         num_forward_passes=len(output))

    async def load(self) -> ReplicaLoad:
        if self.down:
            raise ReplicaUnavailable(f"{self.name} is down")
        return ReplicaLoad(num_running=0, num_waiting=0, tokens_in_flight=0,
                           kv_blocks_used=0, kv_blocks_total=1 << 20, block_size=16)

    async def health(self) -> bool:
        return not self.down

    async def add_history(self, items: Sequence[tuple[Sequence[int], str | None]]) -> None:
        self.num_history_items += len(items)

    async def close(self) -> None:
        """Nothing to release."""
