"""The HTTP/1.1 server ``war route`` runs on.

Knows: HTTP/1.1 on asyncio protocols with ``httptools``' request parser (the C parser
uvicorn uses): keep-alive, pipelined requests answered in order, content-length and
chunked request bodies, ``Expect: 100-continue``, HTTP/1.0 and ``Connection: close``,
an idle keep-alive timeout, a body size limit (413), a head size limit (431),
malformed requests (400, then the connection closes; requests before them are answered
first), and a graceful shutdown on SIGINT/SIGTERM. An HTTP/1.0 connection closes after
each answer (HTTP/1.0's keep-alive is not offered), and trailers of a chunked body are
not taken for headers. Requests matching
a *fast route* (``FastRoute``: the router's ``POST /v1/completions``) go straight to
its handler as ``(body, headers, respond)`` (it may answer before it returns); a client
hanging up cancels the handler's task.
Every other request goes to the ASGI app (FastAPI's ``/health``, ``/metrics``, ...),
whose lifespan runs around the server. Responses from the app may stream (chunked).
The ASGI side is ``edge_asgi``; the bytes of responses are ``edge_wire``'s.

Does not know: TLS, HTTP/2 or protocol upgrades (an upgrade is ignored: the request, its
body read, is answered over HTTP/1.1 and the connection closed), request bodies streamed
to the app
(bodies are read whole, within the limit), or what any request means.

Why it exists: at a few thousand routed requests a second on one core, uvicorn's ASGI
layer plus a task per call watching for the client hanging up cost more CPU than the
routing decision and the call to the replica together; the router is a single
process whose CPU per request bounds the fleet's request rate.
"""

from __future__ import annotations

import asyncio
import logging
import math
import signal
import time
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, cast

import httptools
from starlette.types import ASGIApp

from war.router.edge_asgi import Exchange, Lifespan, http_scope
from war.router.edge_wire import address, error_json, json_response, split_target

log = logging.getLogger("war.router.edge")

_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"

Respond = Callable[[int, bytes], None]
Handler = Callable[[bytes, Mapping[str, str], Respond], Awaitable[tuple[int, bytes] | None]]


@dataclass(frozen=True)
class FastRoute:
    """A route served without ASGI. ``handle(body, headers, respond)`` -> (status, JSON
    body), or None after calling ``respond(status, JSON body)`` once itself: a handler
    answers early that way when it has work left after the answer (its client goes on
    meanwhile; the connection's next request waits for the handler to return).
    ``headers`` have lower-case names. ``too_large()`` -> (413, JSON body), for a body
    over the limit (so that the route can count it). ``authorize(headers)`` -> None
    to serve, or (status, JSON body, extra headers) to refuse."""

    handle: Handler
    too_large: Callable[[], tuple[int, bytes]]
    authorize: Callable[[Mapping[str, str]], tuple[int, bytes, dict[str, str]] | None] = (
        lambda headers: None)


@dataclass(frozen=True)
class EdgeConfig:
    """``max_body_bytes``: larger request bodies get a 413 and the connection closes.
    ``keepalive_s``: an idle connection closes after this long (above a client pool's
    usual 4 s, as uvicorn's 5 s). ``read_timeout_s``: a connection whose request has
    arrived only in part closes when no byte of it comes for this long (a slow upload
    that keeps sending is not cut). ``shutdown_grace_s``: how long a shutdown waits for
    requests in flight before cancelling them. ``max_queued``: pipelined requests
    parsed ahead of the one being answered before the connection stops reading.
    ``max_header_bytes``: a request line and headers larger than this get a 431 and
    the connection closes (counted from the read after the one the head began in: a
    head is never refused below the limit, and one in a single read passes)."""

    max_body_bytes: int = 64 << 20
    keepalive_s: float = 5.0
    read_timeout_s: float = 30.0
    shutdown_grace_s: float = 10.0
    max_queued: int = 16
    max_header_bytes: int = 64 << 10

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_queued", "max_header_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):  # (a NaN: no limit)
                raise ValueError(f"{name} must be an int, got {value!r}")
        if self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1, got {self.max_body_bytes}")
        for name in ("keepalive_s", "read_timeout_s", "shutdown_grace_s"):
            # (inf: an idle or stalled client would hold its connection forever)
            if not 0 < getattr(self, name) < math.inf:
                raise ValueError(f"{name} must be a finite number > 0, "
                                 f"got {getattr(self, name)}")
        if self.max_queued < 1:
            raise ValueError(f"max_queued must be >= 1, got {self.max_queued}")
        if self.max_header_bytes < 1:
            raise ValueError(f"max_header_bytes must be >= 1, got {self.max_header_bytes}")


@dataclass(slots=True)
class _Request:
    method: bytes
    raw_path: bytes
    query: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes
    keep_alive: bool
    http_version: str
    preset: bytes | None = None  # an answer decided while parsing (a 413)


class _Connection(asyncio.Protocol):
    """One client connection: parses requests, answers them one at a time, in order."""

    def __init__(self, edge: Edge) -> None:
        self.edge = edge
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.queue: deque[_Request] = deque()
        self.task: asyncio.Task[None] | None = None  # answers the queue, one at a time
        self._cancelled: asyncio.Task[None] | None = None  # the task this cancelled
        self.busy = False  # a request is being answered
        self._wake: asyncio.Future[None] | None = None  # the task waits for a request
        self.closed = False
        self.closing = False  # answer what is being answered, then close
        self.paused = False
        self.gone: asyncio.Future[None] | None = None  # set when the client hangs up
        self.exchange: Exchange | None = None  # the ASGI answer under way
        self._idle: asyncio.TimerHandle | None = None
        self._idle_since: float | None = None  # None: busy
        self._idle_limit = edge.config.keepalive_s  # how long it may stay as it is
        self._in_message = False  # a request has begun arriving and is not complete
        self._in_head = False  # ... and its headers are not complete
        self._fields: list[tuple[bytes, bytes]] = []  # the headers, without trailers
        # an upgrade request whose body is still to be read (``_read_upgrade_body``):
        # its method, target, headers and HTTP version
        self._upgrading: tuple[bytes, bytes, list[tuple[bytes, bytes]], str] | None = None
        self._upgraded = False  # an upgrade request was read whole: the last one
        self._reset()

    def _reset(self) -> None:
        self._url = b""
        self._headers: list[tuple[bytes, bytes]] = []
        self._body: list[bytes] = []
        self._size = 0
        self._refused = False
        self._length: bytes | None = None  # the first Content-Length
        self._expect = False  # Expect: 100-continue, not yet answered
        self._head_bytes = 0  # bytes of the head read after the read it began in

    # -- asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        self.edge.connections.add(self)
        self._arm_idle()

    def data_received(self, data: bytes) -> None:
        self._disarm_idle()
        if self._upgraded or self.closing:  # nothing after the connection's last request
            return  # is read (an upgrade, a refusal, ``Connection: close``)
        if self._in_head:
            self._head_bytes += len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade as e:
            # An upgrade (h2c, websocket) is not offered: the request is answered over
            # HTTP/1.1 and the connection closes after it. The parser stops there, having
            # skipped the request's body (``on_message_complete``): a parser of its own
            # reads it, from the bytes after the head on.
            if self._upgrading is not None:
                self._read_upgrade_body(data[int(e.args[0]):])
                return
            self.closing = True
            if not self.queue and not self.busy and not self._upgraded:
                self._refuse(400, "protocol upgrades are not supported")
            return
        except httptools.HttpParserError as e:
            if self._upgraded:  # (bytes after an upgrade request are not read)
                return
            self._fail(400, f"malformed HTTP request: {e}")
            return
        if self._in_head and self._head_bytes > self.edge.config.max_header_bytes:
            self._fail(431, f"request headers larger than "
                            f"{self.edge.config.max_header_bytes} bytes")
            return
        if not self.busy and not self.queue and not self.closed:
            # nothing to answer yet: the rest of a request must keep coming (or, with
            # none begun, the connection is idle)
            self._arm_idle(self.edge.config.read_timeout_s if self._in_message else None)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.queue.clear()
        self._cancel_idle()
        self.edge.connections.discard(self)
        if self.gone is not None and not self.gone.done():
            self.gone.set_result(None)
        # The client hung up: abandon its request's work.
        self.cancel_task()

    def cancel_task(self) -> None:
        """Cancels the connection's task, once (a second cancel would also cut short the
        cleanup of a request a stopping server has cancelled). Told by this
        connection's own record, not by the task's ``cancelling()``: the router cancels
        a task awaiting a replica that failed its health check, and takes that back
        (``Router.route``), so a hang-up meanwhile must still cancel it."""
        task = self.task
        if task is not None and task is not self._cancelled:
            self._cancelled = task
            task.cancel()

    # -- httptools callbacks

    def on_message_begin(self) -> None:
        self._reset()
        self._in_message = True
        self._in_head = True

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        self._headers.append((name, value))
        if name == b"content-length" and self._length is None:
            self._length = value
        elif name == b"expect":
            self._expect = value.lower() == b"100-continue"

    def on_headers_complete(self) -> None:
        self._in_head = False
        # (what ``on_header`` gets from now on is a chunked body's trailers)
        self._fields, self._headers = self._headers, []
        length = self._length
        if length is not None and length.isdigit() \
                and int(length) > self.edge.config.max_body_bytes:
            self._too_large()
            return
        if self._expect and not self.busy and not self.queue:
            # (else it waits for the answers before it: ``_next``)
            self._expect = False
            self._write(_CONTINUE)

    def on_body(self, body: bytes) -> None:
        if self._refused:
            return
        self._size += len(body)
        if self._size > self.edge.config.max_body_bytes:
            self._too_large()
            return
        self._body.append(body)

    def on_message_complete(self) -> None:
        self._in_message = False
        if self._refused or self.closing:  # nothing after a refusal or a close is answered
            return
        parser = self.parser
        headers = self._fields
        upgrading = self._upgrading
        if upgrading is not None:  # the body of an upgrade request, read: the last request
            self._upgrading = None
            self._upgraded = True
            method, target, headers, version = upgrading
            keep_alive = False
        elif parser.should_upgrade() and parser.get_method() != b"CONNECT":
            # (httptools skipped the body; it is read once the parser stops, in
            # ``data_received``. A CONNECT has no body: what follows is the tunnel's.)
            self._upgrading = (parser.get_method(), self._url, headers,
                               parser.get_http_version())
            return
        else:
            method, target = parser.get_method(), self._url
            keep_alive, version = parser.should_keep_alive(), parser.get_http_version()
            if keep_alive and version == "1.0":
                # an HTTP/1.0 client keeps the connection only when the answer says
                # ``keep-alive``: the answers here say ``close`` instead
                keep_alive = False
        path, query = split_target(target)
        body = self._body
        request = _Request(  # (positional: method, path, query, headers, body, keep-alive,
            # HTTP version)
            method, path, query, headers, body[0] if len(body) == 1 else b"".join(body),
            keep_alive, version)
        self.queue.append(request)
        if self._upgraded:
            # the last request: what the client sends after it is not read
            self.closing = True
            if not self.paused and self.transport is not None:
                self.transport.pause_reading()
                self.paused = True
        if len(self.queue) >= self.edge.config.max_queued and not self.paused \
                and self.transport is not None:
            self.transport.pause_reading()
            self.paused = True
        self._next()

    def _read_upgrade_body(self, rest: bytes) -> None:
        """Reads the body of the upgrade request ``_upgrading`` (``rest``: the bytes
        after its head) with a new parser, fed a head of the request's own framing
        headers (``Content-Length``, ``Transfer-Encoding``) and no upgrade: its body is
        read as any other, within the size limit (413) and the read timeout, and
        ``on_message_complete`` queues the request as the connection's last."""
        assert self._upgrading is not None
        method, target, headers, _ = self._upgrading
        framing = b"".join(b"%s: %s\r\n" % (k, v) for k, v in headers
                           if k in (b"content-length", b"transfer-encoding"))
        self.parser = httptools.HttpRequestParser(self)
        self.data_received(b"%s %s HTTP/1.1\r\n%s\r\n" % (method, target, framing) + rest)

    # -- answering

    def _next(self) -> None:
        if self.busy or self.closed:
            return
        if not self.queue:
            if self.closing:
                self._close()
            elif self._in_message:
                # a next request already arriving must keep coming (the read timeout)
                if self._expect and not self._in_head:
                    # its 100 Continue, held back until the answers before it were out
                    self._expect = False
                    self._write(_CONTINUE)
                self._arm_idle(self.edge.config.read_timeout_s)
            else:
                self._arm_idle()  # none begun: the connection is idle (the keep-alive one)
            return
        if self.paused and not self.closing and len(self.queue) < self.edge.config.max_queued \
                and self.transport is not None:
            self.transport.resume_reading()
            self.paused = False
        self.busy = True  # (the task takes the queue's head when it next runs)
        wake = self._wake
        if wake is not None:
            self._wake = None
            wake.set_result(None)
        elif self.task is None:
            self.task = self.loop.create_task(self._answer_queue())

    async def _answer_queue(self) -> None:
        """The connection's task: answers queued requests in order, then waits for the
        next (one task per connection, not per request: a request on a kept-alive
        connection wakes it instead of paying for a new task)."""
        try:
            while True:
                if not self.busy:
                    self._wake = self.loop.create_future()
                    await self._wake
                request = self.queue.popleft()
                try:
                    await self._answer(request)
                except Exception:  # (a cancellation: the client hung up or the server
                    # stops, passes through: it is not an Exception)
                    log.exception("answering a request failed")
                    self._close()
                    return
                self.busy = False
                self._next()
                if self.closed:
                    return
        finally:
            self.busy = False
            self.task = None
            self._wake = None

    async def _answer(self, request: _Request) -> None:
        # the last answer on this connection says so (``connection: close``)
        last = not request.keep_alive or self.edge.stopping or (self.closing and not self.queue)
        route = self.edge.routes.get((request.method, request.raw_path))
        if request.preset is not None:
            self._write(request.preset)
        elif route is not None:
            await self._answer_fast(route, request, not last)
        else:
            await self._answer_asgi(request, not last)
        if last:
            self.closing = True
            self.queue.clear()

    async def _answer_fast(self, route: FastRoute, request: _Request, keep_alive: bool) -> None:
        # the first of repeated headers wins, as in Starlette's ``Headers.get``
        headers = {k.decode("latin-1"): v.decode("latin-1")
                   for k, v in reversed(request.headers)}
        refusal = route.authorize(headers)
        if refusal is not None:
            status, body, extra = refusal
            self._write(json_response(status, body, keep_alive, extra))
            return
        answered = False

        def respond(status: int, body: bytes) -> None:
            nonlocal answered
            if answered:
                raise RuntimeError("a fast route answered twice")
            answered = True
            # a stop that came meanwhile makes this the last answer: it says so
            self._write(json_response(status, body, keep_alive and not self.closing))

        try:
            out = await route.handle(request.body, headers, respond)
        except Exception:
            if not answered:  # the client learns it failed (as from the ASGI side)
                self._write(json_response(500, error_json(500, "internal server error"),
                                          False))
            raise
        if out is not None:
            respond(*out)
        elif not answered:
            self._write(json_response(500, error_json(500, "the route sent no response"),
                                      False))
            raise RuntimeError("a fast route returned without answering")

    async def _answer_asgi(self, request: _Request, keep_alive: bool) -> None:
        transport = self.transport
        assert transport is not None, "answering before the connection was made"
        edge = self.edge
        scope = http_scope(request.method, request.raw_path, request.query, request.headers,
                           request.http_version, edge.sockname,
                           address(transport.get_extra_info("peername")), edge.state)
        exchange = Exchange(edge.app, scope, request.body, keep_alive, self._write,
                            lambda: self.closed, self._gone)
        self.exchange = exchange
        try:
            if not await exchange.run():
                self.closing = True
        finally:
            self.exchange = None

    async def _gone(self) -> None:
        """Returns when the client hangs up."""
        if self.gone is None:
            self.gone = self.loop.create_future()
        if not self.closed:
            await self.gone

    # -- helpers

    def _write(self, data: bytes) -> None:
        if self.transport is not None and not self.closed:
            self.transport.write(data)

    def _refuse(self, status: int, message: str) -> None:
        self._write(json_response(status, error_json(status, message), False))
        self._close()

    def _fail(self, status: int, message: str) -> None:
        """Answers ``status`` (after the requests before it) and closes: nothing more is
        read."""
        self._last_answer(json_response(status, error_json(status, message), False))

    def _last_answer(self, answer: bytes, method: bytes = b"", path: bytes = b"") -> None:
        """Queues ``answer`` behind the requests before it as the connection's last and
        stops reading."""
        self.queue.append(_Request(method, path, b"", [], b"", False, "1.1", preset=answer))
        self.closing = True
        if self.transport is not None and not self.paused:
            self.transport.pause_reading()
            self.paused = True
        self._next()

    def _too_large(self) -> None:
        """Answers 413 (after the requests before it) and closes: the rest of the body
        is not read."""
        self._refused = True
        method = self.parser.get_method()
        path, _ = split_target(self._url)
        route = self.edge.routes.get((method, path))
        if route is not None:
            status, body = route.too_large()
        else:
            status = 413
            limit = self.edge.config.max_body_bytes
            body = error_json(413, f"request body larger than {limit} bytes")
        self._last_answer(json_response(status, body, False), method, path)

    # The keep-alive timer is armed once per idle period, not once per request: it
    # checks, when it fires, whether the connection has been idle for long enough.

    def _arm_idle(self, limit: float | None = None) -> None:
        now = self.loop.time()
        self._idle_since = now
        self._idle_limit = self.edge.config.keepalive_s if limit is None else limit
        if self.closed:
            return
        if self._idle is not None and self._idle.when() > now + self._idle_limit:
            self._idle.cancel()  # a shorter limit than the timer's: fire sooner
            self._idle = None
        if self._idle is None:
            self._idle = self.loop.call_at(now + self._idle_limit, self._idle_check)

    def _disarm_idle(self) -> None:
        self._idle_since = None

    def _idle_check(self) -> None:
        self._idle = None
        if self.closed or self._idle_since is None:
            return  # busy: re-armed when it goes idle again
        left = self._idle_since + self._idle_limit - self.loop.time()
        if left <= 0 and not self.busy and not self.queue:
            self._close()
        else:
            self._idle = self.loop.call_later(max(left, 0.01), self._idle_check)

    def _cancel_idle(self) -> None:
        self._idle_since = None
        if self._idle is not None:
            self._idle.cancel()
            self._idle = None

    def _close(self) -> None:
        self._cancel_idle()
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()

    def shutdown(self) -> None:
        """Stops after the request being answered (closes now when idle)."""
        self.closing = True
        self.queue.clear()
        if self.exchange is not None:  # an answer not yet started says it is the last
            self.exchange.keep_alive = False
        if not self.busy:
            self._close()


class Edge:
    """The server: ``app`` (ASGI) behind ``routes`` ((method, path) -> ``FastRoute``)."""

    def __init__(self, app: ASGIApp, routes: Mapping[tuple[str, str], FastRoute],
                 config: EdgeConfig | None = None) -> None:
        self.app = app
        self.routes = {(m.upper().encode(), p.encode()): r for (m, p), r in routes.items()}
        self.config = config if config is not None else EdgeConfig()
        self.connections: set[_Connection] = set()
        self.state: dict[str, Any] = {}
        self.sockname: tuple[str, int] | None = None
        self.stopping = False
        self._server: asyncio.AbstractServer | None = None
        self._lifespan: Lifespan | None = None

    async def start(self, host: str, port: int) -> tuple[str, int]:
        """Binds, runs the app's lifespan startup, then accepts connections; returns the
        bound address. A bind that fails (``OSError``: the port is taken) starts
        nothing; a startup that fails (``RuntimeError``) closes the socket."""
        loop = asyncio.get_running_loop()
        server = await loop.create_server(lambda: _Connection(self), host, port,
                                          start_serving=False)
        try:
            self._lifespan = Lifespan(self.app, self.state)
            await self._lifespan.startup()
        except BaseException:
            server.close()
            await server.wait_closed()
            raise
        self._server = server
        await server.start_serving()
        sock = server.sockets[0].getsockname()
        self.sockname = (str(sock[0]), int(sock[1]))
        return self.sockname

    async def stop(self) -> None:
        """Stops listening, lets requests in flight finish (up to the grace period),
        closes every connection, then runs the lifespan shutdown."""
        self.stopping = True
        if self._server is not None:
            self._server.close()
        for conn in list(self.connections):
            conn.shutdown()
        deadline = time.monotonic() + self.config.shutdown_grace_s
        while self.connections and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        tasks = []
        for conn in list(self.connections):
            if conn.task is not None:
                tasks.append(conn.task)
                conn.cancel_task()
            if conn.transport is not None:
                conn.transport.abort()
        if tasks:  # (their cleanup may still use the app: it runs before its shutdown)
            await asyncio.wait(tasks, timeout=self.config.shutdown_grace_s)
        if self._server is not None:
            await self._server.wait_closed()
        if self._lifespan is not None:
            await self._lifespan.shutdown()


async def serve(edge: Edge, host: str, port: int,
                ready: Callable[[tuple[str, int]], None] | None = None) -> None:
    """Serves until SIGINT or SIGTERM (or cancellation), then stops gracefully.
    ``ready(address)`` is called once listening."""
    address = await edge.start(host, port)
    log.info("serving on http://%s:%d", *address)
    if ready is not None:
        ready(address)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    installed = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, stop.set)
            installed.append(sig)
        except (NotImplementedError, RuntimeError, ValueError):  # not the main thread
            pass
    try:
        await stop.wait()
    finally:
        for sig in installed:
            loop.remove_signal_handler(sig)
        await edge.stop()
        log.info("stopped")


__all__ = ["Edge", "EdgeConfig", "FastRoute", "Handler", "Respond", "serve"]
