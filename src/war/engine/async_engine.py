"""Driving a replica ``Engine`` from asyncio.

Knows: how to own an engine from one background thread (it is not thread-safe),
how to pass work to that thread (a FIFO command queue it drains between steps),
how to hand results back to asyncio futures (``loop.call_soon_threadsafe``), how
to abort a request whose awaiting task was cancelled, and what to do when a step
fails (fail the in-flight requests, keep serving) or the thread's own loop does (fail
every request, queued or in flight, and refuse new ones, as if closed). Keeps cheap
snapshots of the engine's load and counters for other threads.

Does not know HTTP (``war.engine.server``), metrics formats (``war.engine.metrics``),
routing, or how the engine schedules, drafts and samples; it only calls the
engine's public methods.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import threading
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Protocol, TypeVar, runtime_checkable

import torch

from war.engine.model_config import ModelConfig
from war.engine.stats import EngineStats
from war.types import GenRequest, GenResult, ReplicaLoad

log = logging.getLogger(__name__)

T = TypeVar("T")


class EngineLike(Protocol):
    """The part of ``war.engine.engine.Engine`` that ``AsyncEngine`` and the server use."""

    @property
    def model_config(self) -> ModelConfig: ...

    @property
    def tokenizer(self) -> Any: ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def weight_version(self) -> int: ...

    @property
    def stats(self) -> EngineStats: ...

    def add_request(self, request: GenRequest) -> None: ...

    def abort(self, request_id: str) -> GenResult | None: ...

    def step(self) -> list[GenResult]: ...

    def has_unfinished(self) -> bool: ...

    def load(self) -> ReplicaLoad: ...

    def add_history(self, token_ids: Sequence[int], group_id: str | None = None) -> None: ...

    def observe_rl_step(self, rl_step: int) -> None: ...

    def load_weights(self, weights: Mapping[str, torch.Tensor] | str | Path) -> int: ...

    def finish_trajectory(self, trajectory_id: str) -> bool: ...

    def wait_s(self) -> float | None: ...


@runtime_checkable
class BatchEngine(Protocol):
    """What ``Engine`` offers beyond ``EngineLike`` for requests of several prompts and
    continuing requests; ``AsyncEngine`` uses it where the engine has it."""

    def add_requests(self, requests: Sequence[GenRequest]) -> None: ...

    def held_length(self, trajectory_id: str) -> int | None: ...


class EngineClosedError(RuntimeError):
    """The ``AsyncEngine`` is closed (or closed while the request was in flight)."""


class DuplicateRequestError(ValueError):
    """A request's id is that of one already in flight (a conflict, not a bad request)."""


class EngineStepError(RuntimeError):
    """``Engine.step()`` raised while the request was in flight; ``__cause__`` is the error.

    A separate type so that callers can tell a failed step (the server's fault)
    from a request the engine refused (``ValueError``: the caller's fault).
    """


@dataclass(frozen=True)
class _Waiter:
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[Any]


_PENDING = object()  # a command's value that says "the result comes later"


@dataclass(frozen=True)
class _Command:
    fn: Callable[[EngineLike], object]
    waiter: _Waiter | None


def _settle(future: asyncio.Future[Any], value: object, error: BaseException | None) -> None:
    if future.done():  # cancelled by its awaiter meanwhile
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(value)


def _deliver(waiter: _Waiter, value: object = None, error: BaseException | None = None) -> None:
    # RuntimeError: the awaiter's event loop is closed, so nobody is listening.
    with contextlib.suppress(RuntimeError):
        waiter.loop.call_soon_threadsafe(_settle, waiter.future, value, error)


class AsyncEngine:
    """Runs ``engine`` in one background thread; use it from any event loop.

    The thread owns the engine: every call on it (``add_request``, ``abort``,
    ``step``, ``load_weights``...) happens there. Commands are run in the order
    they were submitted, between steps. The thread sleeps on a condition while
    there is neither a command nor an unfinished request.

    ``start()`` (or ``async with``) starts the thread; ``close()`` stops it, and
    requests still in flight then fail with ``EngineClosedError`` (they are
    aborted in the engine). ``load()`` and ``stats()`` are snapshots taken by the
    thread after each step and each batch of commands; any thread may read them.
    """

    def __init__(self, engine: EngineLike, *, join_timeout_s: float = 60.0) -> None:
        self._engine = engine
        self._join_timeout_s = join_timeout_s
        self._cond = threading.Condition()
        self._commands: deque[_Command] = deque()  # guarded by _cond
        self._taken: deque[_Command] = deque()  # taken from _commands, not run yet; thread only
        self._closing = False  # guarded by _cond; no command is accepted once set
        self._closed = "the AsyncEngine is closed"  # why, for those refused then
        self._thread: threading.Thread | None = None
        self._inflight: dict[str, _Waiter] = {}  # only the engine thread touches it
        self._outbox: list[tuple[_Waiter, object, BaseException | None]] = []  # thread only
        self._load = engine.load()
        self._stats = copy.copy(engine.stats)
        self._weight_version = engine.weight_version

    # ------------------------------------------------------------ lifecycle

    @property
    def engine(self) -> EngineLike:
        """The driven engine. Only its immutable attributes (``model_config``,
        ``tokenizer``, ``max_model_len``) may be read from outside the thread."""
        return self._engine

    @property
    def is_running(self) -> bool:
        """True between ``start()`` and ``close()`` while the thread is alive."""
        thread = self._thread
        return thread is not None and thread.is_alive() and not self._closing

    def start(self) -> None:
        """Starts the engine thread (idempotent). Raises ``EngineClosedError`` after close."""
        with self._cond:
            if self._closing:
                raise EngineClosedError(self._closed)
            if self._thread is not None:
                return
            self._thread = threading.Thread(
                target=self._run, name="war-engine", daemon=True)
            self._thread.start()

    async def close(self) -> None:
        """Stops the thread after the commands already submitted; fails in-flight
        requests with ``EngineClosedError``. Waits for the thread (bounded by
        ``join_timeout_s``: a step in progress is finished first). Idempotent."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None and thread.is_alive():
            await asyncio.to_thread(thread.join, self._join_timeout_s)
            if thread.is_alive():
                log.error("engine thread did not stop within %.1f s", self._join_timeout_s)

    async def __aenter__(self) -> AsyncEngine:
        self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    # ------------------------------------------------------------ snapshots

    def load(self) -> ReplicaLoad:
        """The engine's load after its latest step or command (thread-safe, cheap)."""
        return self._load

    def stats(self) -> EngineStats:
        """A copy of the engine's counters after its latest step or command."""
        return copy.copy(self._stats)

    @property
    def weight_version(self) -> int:
        """The engine's weight version after its latest command."""
        return self._weight_version

    # ------------------------------------------------------------ requests

    async def generate(self, request: GenRequest) -> GenResult:
        """Generates ``request`` to the end. ``ValueError`` from ``add_request``
        propagates; cancelling the awaiting task aborts the request in the engine."""
        waiter = self._waiter()
        rid = request.request_id

        def add(engine: EngineLike) -> object:
            if rid in self._inflight:
                raise DuplicateRequestError(f"request {rid} is already in flight")
            engine.add_request(request)
            self._inflight[rid] = waiter
            return _PENDING

        self._submit(add, waiter)
        try:
            result: GenResult = await waiter.future
        except asyncio.CancelledError:
            self._abort_later(rid, waiter)
            raise
        return result

    async def generate_all(self, requests: Sequence[GenRequest]) -> list[GenResult]:
        """Generates several requests; results in the order given. They are admitted
        together: if the engine refuses one (``ValueError``), none is admitted and
        nothing has changed (an engine without ``add_requests`` gets them one by one,
        and those admitted before the refused one are aborted). If one fails later, or
        the awaiting task is cancelled, the others are aborted."""
        reqs = list(requests)
        waiters = [self._waiter() for _ in reqs]

        def add(engine: EngineLike) -> None:
            dup = next((r.request_id for r in reqs if r.request_id in self._inflight), None)
            if dup is not None:
                raise DuplicateRequestError(f"request {dup} is already in flight")
            if isinstance(engine, BatchEngine):
                engine.add_requests(reqs)
            else:
                for i, r in enumerate(reqs):
                    try:
                        engine.add_request(r)
                    except Exception:
                        for before in reqs[:i]:
                            with contextlib.suppress(Exception):  # the refusal is the news
                                engine.abort(before.request_id)
                        raise
            for r, waiter in zip(reqs, waiters, strict=True):
                self._inflight[r.request_id] = waiter

        admitted = self._waiter()
        self._submit(add, admitted)
        try:
            await admitted.future
            return list(await asyncio.gather(*(w.future for w in waiters)))
        except BaseException:
            done = admitted.future.done() and not admitted.future.cancelled()
            refused = done and admitted.future.exception() is not None
            for r, waiter in zip(reqs, waiters, strict=True):
                if waiter.future.done():
                    if not waiter.future.cancelled():
                        waiter.future.exception()  # retrieved: asyncio need not warn
                else:
                    waiter.future.cancel()  # its result, if any, is dropped
                if not refused:  # admitted, or may still be: abort what is left
                    self._abort_later(r.request_id, waiter)
            raise

    async def held_length(self, trajectory_id: str) -> int | None:
        """How many tokens the engine holds for the trajectory, which a continuing
        request's prompt is appended to (None: none, or the engine cannot tell)."""

        def held(engine: EngineLike) -> int | None:
            if isinstance(engine, BatchEngine):
                return engine.held_length(trajectory_id)
            return None

        return await self.call(held)

    async def abort(self, request_id: str) -> GenResult | None:
        """Aborts a request; its ``generate`` call returns the partial result
        (``finish_reason == "abort"``). Returns that result (None if unknown)."""

        def abort(engine: EngineLike) -> GenResult | None:
            result = engine.abort(request_id)
            waiter = self._inflight.pop(request_id, None)
            if waiter is not None and result is not None:
                self._post(waiter, result)
            return result

        return await self.call(abort)

    async def add_history(self, token_ids: Sequence[int], group_id: str | None = None) -> None:
        """Adds a completed response (from another replica) to the draft history."""
        ids = list(token_ids)
        await self.call(lambda engine: engine.add_history(ids, group_id))

    async def observe_rl_step(self, rl_step: int) -> None:
        """Advances the draft history's window of RL steps."""
        await self.call(lambda engine: engine.observe_rl_step(rl_step))

    async def finish_trajectory(self, trajectory_id: str) -> bool:
        """The trajectory has ended: the engine releases the KV held for it."""
        return await self.call(lambda engine: engine.finish_trajectory(trajectory_id))

    async def load_weights(self, weights: Mapping[str, torch.Tensor] | str | Path) -> int:
        """Loads new weights between steps; returns the new weight version."""
        return await self.call(lambda engine: engine.load_weights(weights))

    async def call(self, fn: Callable[[EngineLike], T]) -> T:
        """Runs ``fn(engine)`` on the engine thread between steps; returns its value
        (or raises its exception)."""
        waiter = self._waiter()
        self._submit(fn, waiter)
        result: T = await waiter.future
        return result

    # ------------------------------------------------------------ internals

    def _waiter(self) -> _Waiter:
        loop = asyncio.get_running_loop()
        return _Waiter(loop, loop.create_future())

    def _submit(self, fn: Callable[[EngineLike], object], waiter: _Waiter | None) -> None:
        with self._cond:
            if self._closing:
                raise EngineClosedError(self._closed)
            if self._thread is None:
                raise RuntimeError("the AsyncEngine is not started: call start() first")
            self._commands.append(_Command(fn, waiter))
            self._cond.notify()

    def _abort_later(self, rid: str, waiter: _Waiter) -> None:
        """Queues the abort of a cancelled request (if it is still this waiter's)."""

        def abort(engine: EngineLike) -> None:
            if self._inflight.get(rid) is waiter:
                del self._inflight[rid]
                engine.abort(rid)

        with contextlib.suppress(RuntimeError):  # closed: close() aborts whatever is left
            self._submit(abort, None)

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as e:  # a bug here, not in a step: nothing would answer again
            log.exception("the engine thread failed; failing every request")
            self._die(e)

    def _die(self, cause: BaseException) -> None:
        """The loop itself raised: fails the in-flight requests and the queued commands
        with ``EngineClosedError`` (the replica is gone, as after ``close()``), and
        refuses every later submission, so that no await is left pending forever."""
        why = f"the engine thread failed: {type(cause).__name__}: {cause}"
        error = EngineClosedError(why)
        error.__cause__ = cause
        with self._cond:
            self._closing = True  # _submit refuses from now on; is_running is False
            self._closed = f"the AsyncEngine is closed: {why}"
            commands = [*self._taken, *self._commands]
            self._taken.clear()
            self._commands.clear()
        inflight = list(self._inflight.items())
        self._inflight.clear()
        for rid, waiter in inflight:
            with contextlib.suppress(Exception):  # best effort: the engine may be broken
                self._engine.abort(rid)
            self._post(waiter, error=error)
        for command in commands:
            if command.waiter is not None:
                self._post(command.waiter, error=error)
        self._flush()

    def _loop(self) -> None:
        stalled = False  # a step failed and left work behind: wait for a command
        held: float | None = None  # the last step ran nothing: held KV (seconds left)
        while True:
            busy = self._has_work() and not stalled
            with self._cond:
                if busy and held is not None:
                    # Held contexts fill the KV: wait for a command (a trajectory's
                    # next turn) or the first hold's expiry, then step again.
                    if not self._commands and not self._closing:
                        # A hold may be longer than a wait can be ("hold forever").
                        self._cond.wait(timeout=min(held, threading.TIMEOUT_MAX))
                else:
                    while not self._commands and not self._closing and not busy:
                        self._cond.wait()
                got = bool(self._commands)
                self._taken.extend(self._commands)
                self._commands.clear()
                closing = self._closing
            if got:
                stalled = False
                while self._taken:
                    self._execute(self._taken.popleft())
            if closing:
                self._shutdown()
                return
            # Snapshot first, then wake the awaiters: what they read is never older.
            # Commands are answered before the next (maybe long) step.
            if got:
                self._snapshot()
                self._flush()
            held = None
            if not stalled and self._has_work():
                stalled = self._step()
                held = self._wait_s()
                self._snapshot()
                self._flush()

    def _post(self, waiter: _Waiter, value: object = None,
              error: BaseException | None = None) -> None:
        """Queues a settlement; ``_flush`` sends it after the next snapshot."""
        self._outbox.append((waiter, value, error))

    def _flush(self) -> None:
        outbox, self._outbox = self._outbox, []
        for waiter, value, error in outbox:
            _deliver(waiter, value, error)

    def _has_work(self) -> bool:
        try:
            return self._engine.has_unfinished()
        except Exception:
            log.exception("engine.has_unfinished() failed")
            return False

    def _wait_s(self) -> float | None:
        try:
            return self._engine.wait_s()
        except Exception:
            log.exception("engine.wait_s() failed")
            return None

    def _execute(self, command: _Command) -> None:
        try:
            value = command.fn(self._engine)
        except Exception as e:
            if command.waiter is not None:
                self._post(command.waiter, error=e)
            else:
                log.exception("engine command failed")
            return
        if command.waiter is not None and value is not _PENDING:
            self._post(command.waiter, value)

    def _step(self) -> bool:
        """One engine step; returns True if it failed and left unfinished work."""
        engine = self._engine
        try:
            results = engine.step()
        except Exception as e:
            log.exception("engine step failed; failing %d in-flight request(s)",
                          len(self._inflight))
            error = EngineStepError(f"engine step failed: {type(e).__name__}: {e}")
            error.__cause__ = e
            inflight = list(self._inflight.items())
            self._inflight.clear()
            for rid, waiter in inflight:
                try:
                    engine.abort(rid)
                except Exception:
                    log.exception("aborting request %s after a failed step failed", rid)
                self._post(waiter, error=error)
            return self._has_work()
        for result in results:
            done = self._inflight.pop(result.request_id, None)
            if done is not None:
                self._post(done, result)
        return False

    def _snapshot(self) -> None:
        engine = self._engine
        try:
            self._load = engine.load()
            self._stats = copy.copy(engine.stats)
            self._weight_version = engine.weight_version
        except Exception:
            log.exception("taking the engine's load snapshot failed")

    def _shutdown(self) -> None:
        inflight = list(self._inflight.items())
        self._inflight.clear()
        error = EngineClosedError("the AsyncEngine was closed while the request was in flight")
        for rid, waiter in inflight:
            try:
                self._engine.abort(rid)
            except Exception:
                log.exception("aborting request %s at close failed", rid)
            self._post(waiter, error=error)
        self._snapshot()
        self._flush()
