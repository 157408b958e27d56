"""A lean HTTP/1.1 client for the calls WAR makes to replicas, many times a second.

Knows: one origin (scheme, host, port), a pool of keep-alive connections to it (at
most ``max_connections``, idle ones closed after ``keepalive_s``, by the pool's next
call), how to write a request with a whole body in one write, and how to read a
response with ``httptools``' parser (the C parser uvicorn uses: content-length, chunked or
connection-delimited bodies). Every call has a total timeout and a connect timeout.
A pooled connection found closed (the server's FIN read, the transport closing) is
not used. A call whose request was not written at all goes on a new connection; one
that was written and then lost its connection before any byte of the answer arrived
(the server had closed it while idle, crossing the request) is sent once more on a
new connection only if it is idempotent (GET and HEAD, or ``idempotent=True``): the
server may have received a POST and be running it (a generation), and a second copy
on the same replica, unknown to the caller, would run it twice, so a POST's call
raises ``ConnectionClosed`` (with ``sent``) and the caller decides.
An answer larger than ``max_response_bytes`` fails its call rather than filling
memory; a connection that receives an answer no call asked for is dropped.

Does not know: redirects, proxies, cookies, compression, HTTP/2, streaming bodies,
or what the calls mean (``war.backends.http`` maps answers and errors). It exists
because at a hundred agent turns in flight the HTTP client was a large share of the
rollout driver's and the router's CPU time: per call it costs about a third of an
``aiohttp`` client's time and a tenth of an ``httpx`` one's.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import ssl as _ssl
import time
from collections import deque
from dataclasses import dataclass
from typing import cast

import httptools

# An answer larger than this (head and body) fails the call: a completion with
# logprobs for a long output is a few MB; more is a broken or hostile server.
DEFAULT_MAX_RESPONSE_BYTES = 256 << 20


class TransportError(Exception):
    """The call failed below HTTP: connection refused, reset or closed, or an answer
    that is not HTTP."""


class ConnectionClosed(TransportError):
    """The server closed the connection before its answer was complete.

    ``sent``: whether any byte of the request was written (False: the server surely
    has not received it); ``before_answer``: no byte of the answer had arrived."""

    def __init__(self, message: str, *, sent: bool = True, before_answer: bool = False
                 ) -> None:
        super().__init__(message)
        self.sent = sent
        self.before_answer = before_answer


# methods sent again after a connection lost before their answer (RFC 9110 9.2.2)
_IDEMPOTENT = frozenset({"GET", "HEAD", "OPTIONS"})


@dataclass(frozen=True)
class Response:
    status: int
    reason: str
    body: bytes


class _Connection(asyncio.Protocol):
    """One keep-alive connection; one call at a time."""

    def __init__(self, max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.idle_since = 0.0
        self.reused = False
        self.max_response_bytes = max_response_bytes
        self._received = 0  # bytes of the current call's answer, interim ones included
        self._waiter: asyncio.Future[Response] | None = None
        self._reset()

    def _reset(self) -> None:
        self._reason = b""
        self._chunks: list[bytes] = []
        self._headers_done = False
        self._delimited = False  # content-length or chunked: the end is known
        self._close_after = False
        self._got_bytes = False

    # -- asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        self._got_bytes = True
        self._received += len(data)
        if self._received > self.max_response_bytes:
            self._fail(TransportError(
                f"the answer is larger than {self.max_response_bytes} bytes"))
            self.abort()
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as e:
            self._fail(TransportError(f"invalid HTTP answer: {e}"))
            self.close()
        except httptools.HttpParserUpgrade:  # (not an HttpParserError)
            self._fail(TransportError("invalid HTTP answer: a protocol upgrade"))
            self.close()

    def eof_received(self) -> bool | None:
        self.closed = True  # (the server closed its side: not to be used again)
        return None  # (the transport closes; ``connection_lost`` ends a call under way)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        waiter = self._waiter
        if waiter is None or waiter.done():
            return
        if self._headers_done and not self._delimited and exc is None:
            self._complete()  # the body ended with the connection (a reset is a failure)
            return
        what = "reset" if exc is not None else "closed"
        self._fail(ConnectionClosed(f"connection {what} before the answer was complete"
                                    + (f" ({exc})" if exc is not None else ""),
                                    before_answer=not self._got_bytes))

    # -- httptools callbacks

    def on_message_begin(self) -> None:
        if self._waiter is None:
            # an answer no call asked for: what follows it on this connection cannot
            # be told apart from the next call's answer
            self.abort()

    def on_status(self, status: bytes) -> None:
        self._reason += status

    def on_header(self, name: bytes, value: bytes) -> None:
        key = name.lower()
        if key == b"content-length" or (key == b"transfer-encoding"
                                        and b"chunked" in value.lower()):
            self._delimited = True
        elif key == b"connection" and value.strip().lower() == b"close":
            self._close_after = True

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if 100 <= status < 200:  # an interim answer: the real one follows
            self._reset()
            self._got_bytes = True  # (the server has the request: no retry)
            return
        self._headers_done = True
        if status in (204, 304):
            self._delimited = True

    def on_body(self, body: bytes) -> None:
        self._chunks.append(body)

    def on_message_complete(self) -> None:
        if self._headers_done:
            if not self.parser.should_keep_alive():
                self._close_after = True
            self._complete()

    # -- calls

    def _complete(self) -> None:
        waiter = self._waiter
        response = Response(self.parser.get_status_code(),
                            self._reason.decode("latin-1", errors="replace"),
                            b"".join(self._chunks))
        close = self._close_after
        self._waiter = None
        self._reset()
        if close:
            self.close()
        if waiter is not None and not waiter.done():
            waiter.set_result(response)

    def _fail(self, exc: Exception) -> None:
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_exception(exc)

    def send(self, data: bytes) -> asyncio.Future[Response]:
        """Writes a request; its answer's future. ``ConnectionClosed`` (``sent``
        False), nothing written, if the connection is closed or closing."""
        assert self.transport is not None and self._waiter is None
        if self.closed or self.transport.is_closing():
            self.closed = True
            raise ConnectionClosed("connection closed before the request was sent",
                                   sent=False, before_answer=True)
        self._reset()
        self._received = 0
        self._waiter = asyncio.get_running_loop().create_future()
        self.transport.write(data)
        return self._waiter

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    def abort(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()


class Pool:
    """Keep-alive connections to one origin; ``request`` sends one call.

    ``host`` may be a name or an address (IPv6 without brackets); ``tls`` is an
    ``ssl.SSLContext`` for https; an answer over ``max_response_bytes`` fails its
    call. The pool belongs to the event loop it first runs in."""

    def __init__(self, host: str, port: int, *, tls: _ssl.SSLContext | None = None,
                 max_connections: int = 512, keepalive_s: float = 4.0,
                 max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES) -> None:
        if max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {max_connections}")
        if max_response_bytes < 1:
            raise ValueError(f"max_response_bytes must be >= 1, got {max_response_bytes}")
        self.max_response_bytes = max_response_bytes
        self.max_connections = max_connections
        self.host = host
        self.port = port
        self.tls = tls
        self.keepalive_s = keepalive_s
        authority = f"[{host}]" if ":" in host else host
        default = 443 if tls is not None else 80
        self.authority = authority if port == default else f"{authority}:{port}"
        self._idle: deque[_Connection] = deque()
        # connection slots: free ones, and the calls waiting for one in order (a counter
        # and a queue: ``asyncio.Semaphore`` cost a few microseconds a call)
        self._free = max_connections
        self._slot_waiters: deque[asyncio.Future[None]] = deque()
        self._closed = False
        self._heads: dict[tuple[str, str, tuple[tuple[str, str], ...]], bytes] = {}
        # Calls in flight (their answers' futures) and their deadlines, watched by one
        # timer at the earliest deadline: a timer per call cost more than the rest of
        # the call's bookkeeping.
        self._deadlines: dict[asyncio.Future[Response], float] = {}
        self._watch: asyncio.TimerHandle | None = None
        self._watch_at = math.inf

    async def request(self, method: str, target: str, *, body: bytes | None = None,
                      headers: tuple[tuple[str, str], ...] = (), timeout_s: float,
                      connect_timeout_s: float, idempotent: bool | None = None
                      ) -> Response:
        """One call. Raises ``TimeoutError`` past ``timeout_s`` (the connection, if any,
        is dropped), ``TransportError`` or ``OSError`` when the call fails below HTTP.

        ``idempotent`` (default: by the method, GET, HEAD and OPTIONS): whether the call
        may be sent again after a pooled connection was lost before any byte of its
        answer, the request written (the server may have received it). A call whose
        request was not written at all is always sent on a new connection."""
        if self._closed:
            raise TransportError("the pool is closed")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        data = self._encode(method, target, body, headers)
        if self._free > 0 and not self._slot_waiters:
            self._free -= 1
        else:  # every connection is busy: wait for one, within the time
            await self._wait_for_slot(deadline)
        try:
            conn = self._take_idle()
            if conn is None:
                conn = await self._connect(connect_timeout_s, deadline)
            try:
                return await self._exchange(conn, data, deadline)
            except ConnectionClosed as e:
                # Not written: the server has nothing of it. Written on a connection the
                # server closed while idle, no answer begun: probably not processed,
                # but only an idempotent call may be sent again to find out.
                if e.sent and not (conn.reused and e.before_answer and (
                        method in _IDEMPOTENT if idempotent is None else idempotent)):
                    raise
            conn = await self._connect(connect_timeout_s, deadline)
            return await self._exchange(conn, data, deadline)
        finally:
            self._release_slot()

    async def _wait_for_slot(self, deadline: float) -> None:
        """Takes a connection slot when one is released (first come, first served), or
        raises ``TimeoutError`` at ``deadline``."""
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._slot_waiters.append(waiter)
        try:
            async with asyncio.timeout_at(deadline):
                await waiter
        except BaseException as e:
            if waiter.done() and not waiter.cancelled():
                self._release_slot()  # handed a slot, but gone before using it: pass it on
            else:
                waiter.cancel()
                with contextlib.suppress(ValueError):
                    self._slot_waiters.remove(waiter)
            if isinstance(e, TimeoutError):  # (the client's own limit, not the server)
                raise TimeoutError(f"no free connection in time (all {self.max_connections} "
                                   "in use)") from e
            raise

    def _release_slot(self) -> None:
        """Hands a slot to the first call still waiting, else frees it."""
        waiters = self._slot_waiters
        while waiters:
            waiter = waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
        self._free += 1

    async def _exchange(self, conn: _Connection, data: bytes, deadline: float) -> Response:
        # The watch fails the answer's future at the deadline: cheaper than an
        # ``asyncio.timeout`` scope (which cancels the task and uncancels it after).
        waiter = conn.send(data)
        deadlines = self._deadlines
        deadlines[waiter] = deadline
        if deadline < self._watch_at:
            self._arm_watch(deadline)
        try:
            response = await waiter
        except BaseException:
            conn.abort()  # cancelled, timed out or failed mid-call: its state is unknown
            raise
        finally:
            del deadlines[waiter]
        if self._closed:
            conn.close()  # the pool was closed during the call
        elif not conn.closed:
            conn.idle_since = time.monotonic()
            conn.reused = True
            self._idle.append(conn)
        return response

    def _arm_watch(self, when: float) -> None:
        if self._watch is not None:
            self._watch.cancel()
        self._watch = asyncio.get_running_loop().call_at(when, self._on_watch)
        self._watch_at = when

    def _on_watch(self) -> None:
        """Fails the calls whose deadline has come; watches for the next deadline."""
        self._watch, self._watch_at = None, math.inf
        # (a timer may fire a hair before its time by the loop's clock)
        now = asyncio.get_running_loop().time() + 1e-3
        after = math.inf
        for waiter, deadline in list(self._deadlines.items()):
            if deadline <= now:
                if not waiter.done():
                    waiter.set_exception(TimeoutError("no answer in time"))
            elif deadline < after:
                after = deadline
        if after < math.inf:
            self._arm_watch(after)

    def _take_idle(self) -> _Connection | None:
        idle, now = self._idle, time.monotonic()
        # Connections enter on the right as they are released, so the deque is in
        # order of idle time: the expired ones are on the left (closed here, also while
        # calls keep taking the most recent), and none is left among the others.
        while idle and now - idle[0].idle_since > self.keepalive_s:
            idle.popleft().close()
        while idle:
            conn = idle.pop()  # the most recently used: least likely to be stale
            if conn.closed or conn.transport is None or conn.transport.is_closing():
                conn.closed = True
                continue
            return conn
        return None

    async def _connect(self, timeout_s: float, deadline: float) -> _Connection:
        """A new connection, within ``timeout_s`` and before the call's ``deadline``."""
        loop = asyncio.get_running_loop()
        timeout_s = min(timeout_s, deadline - loop.time())
        if timeout_s <= 0:
            raise TimeoutError("the call ran out of time before connecting")
        limit = self.max_response_bytes
        try:
            _, conn = await asyncio.wait_for(loop.create_connection(
                lambda: _Connection(limit), self.host, self.port, ssl=self.tls,
                server_hostname=self.host if self.tls is not None else None), timeout_s)
        except TimeoutError as e:  # (the call's own time out says "no answer in time")
            raise TimeoutError(f"no connection within {timeout_s:.3g} s") from e
        return conn

    def _encode(self, method: str, target: str, body: bytes | None,
                headers: tuple[tuple[str, str], ...]) -> bytes:
        key = (method, target, headers)
        head = self._heads.get(key)
        if head is None:  # the head up to the body's length, the same for every call
            lines = [f"{method} {target} HTTP/1.1", f"Host: {self.authority}",
                     "Accept: application/json"]
            lines += [f"{k}: {v}" for k, v in headers]
            head = ("\r\n".join(lines) + "\r\n").encode("latin-1")
            if len(self._heads) >= 64:
                self._heads.clear()
            self._heads[key] = head
        if body is None:
            return head + b"\r\n"
        return b"%bContent-Length: %d\r\n\r\n%b" % (head, len(body), body)

    def close(self) -> None:
        """Closes the idle connections; busy ones close when their call ends."""
        self._closed = True
        while self._idle:
            self._idle.pop().close()
        if self._watch is not None and not self._deadlines:
            self._watch.cancel()
            self._watch, self._watch_at = None, math.inf


__all__ = ["ConnectionClosed", "Pool", "Response", "TransportError"]
