"""The HTTP/1.1 server ``war route`` runs on.

Knows: HTTP/1.1 on asyncio protocols with ``httptools``' request parser (the C parser
uvicorn uses): keep-alive, pipelined requests answered in order, content-length and
chunked request bodies, ``Expect: 100-continue``, HTTP/1.0 and ``Connection: close``,
an idle keep-alive timeout, a body size limit (413), malformed requests (400, then
the connection closes), and a graceful shutdown on SIGINT/SIGTERM. Requests matching
a *fast route* (``FastRoute``: the router's ``POST /v1/completions``) go straight to
its handler as ``(body, headers)``; a client hanging up cancels the handler's task.
Every other request goes to the ASGI app (FastAPI's ``/health``, ``/metrics``, ...),
whose lifespan runs around the server. Responses from the app may stream (chunked).

Does not know: TLS, HTTP/2 or protocol upgrades (an upgrade is ignored: the request is
answered over HTTP/1.1 and the connection closed), request bodies streamed to the app
(bodies are read whole, within the limit), or what any request means.

Why it exists: at a few thousand routed requests a second on one core, uvicorn's ASGI
layer plus a task per call watching for the client hanging up cost more CPU than the
routing decision and the call to the replica together; the router is a single
process whose CPU per request bounds the fleet's request rate.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from email.utils import formatdate
from http import HTTPStatus
from typing import Any, cast
from urllib.parse import unquote

import httptools
from starlette.types import ASGIApp, Message

log = logging.getLogger("war.router.edge")

Handler = Callable[[bytes, Mapping[str, str]], Awaitable[tuple[int, bytes]]]


@dataclass(frozen=True)
class FastRoute:
    """A route served without ASGI. ``handle(body, headers)`` -> (status, JSON body);
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
    usual 4 s, as uvicorn's 5 s). ``shutdown_grace_s``: how long a shutdown waits for
    requests in flight before cancelling them. ``max_queued``: pipelined requests
    parsed ahead of the one being answered before the connection stops reading."""

    max_body_bytes: int = 64 << 20
    keepalive_s: float = 5.0
    shutdown_grace_s: float = 10.0
    max_queued: int = 16

    def __post_init__(self) -> None:
        if self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1, got {self.max_body_bytes}")
        for name in ("keepalive_s", "shutdown_grace_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.max_queued < 1:
            raise ValueError(f"max_queued must be >= 1, got {self.max_queued}")


_REASONS = {s.value: s.phrase for s in HTTPStatus} | {499: "Client Closed Request"}
_date_cache: tuple[int, bytes] = (0, b"")


def _date() -> bytes:
    global _date_cache
    now = int(time.time())
    if _date_cache[0] != now:
        _date_cache = (now, formatdate(now, usegmt=True).encode())
    return _date_cache[1]


def _head(status: int, headers: list[tuple[bytes, bytes]], keep_alive: bool) -> bytes:
    lines = [b"HTTP/1.1 %d %s" % (status, _REASONS.get(status, "Unknown").encode()),
             b"date: " + _date()]
    lines += [name + b": " + value for name, value in headers]
    if not keep_alive:
        lines.append(b"connection: close")
    return b"\r\n".join(lines) + b"\r\n\r\n"


def _json_response(status: int, body: bytes, keep_alive: bool,
                   extra: Mapping[str, str] | None = None) -> bytes:
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(body)).encode())]
    if extra:
        headers += [(k.lower().encode(), v.encode()) for k, v in extra.items()]
    return _head(status, headers, keep_alive) + body


def _plain_error(status: int, message: str) -> bytes:
    return (b'{"error": {"message": "%s", "type": "invalid_request_error", "param": null, '
            b'"code": null}}' % message.replace('"', "'").encode())


@dataclass
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
        self.task: asyncio.Task[None] | None = None
        self.closed = False
        self.closing = False  # answer what is being answered, then close
        self.paused = False
        self.gone: asyncio.Future[None] | None = None  # set when the client hangs up
        self._idle: asyncio.TimerHandle | None = None
        self._idle_since: float | None = None  # None: busy
        self._reset()

    def _reset(self) -> None:
        self._url = b""
        self._headers: list[tuple[bytes, bytes]] = []
        self._body: list[bytes] = []
        self._size = 0
        self._refused = False
        self._length: bytes | None = None  # the first Content-Length
        self._expect = False  # Expect: 100-continue

    # -- asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        self.edge.connections.add(self)
        self._arm_idle()

    def data_received(self, data: bytes) -> None:
        self._disarm_idle()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            # An upgrade (h2c, websocket) is not offered: answer what was parsed over
            # HTTP/1.1 and close; the parser cannot go on after an upgrade.
            self.closing = True
            if not self.queue and self.task is None:
                self._refuse(400, "protocol upgrades are not supported")
        except httptools.HttpParserError as e:
            self._refuse(400, f"malformed HTTP request: {e}")

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.queue.clear()
        self._cancel_idle()
        self.edge.connections.discard(self)
        if self.gone is not None and not self.gone.done():
            self.gone.set_result(None)
        if self.task is not None:
            self.task.cancel()  # the client hung up: abandon its request's work

    # -- httptools callbacks

    def on_message_begin(self) -> None:
        self._reset()

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
        length = self._length
        if length is not None and length.isdigit() \
                and int(length) > self.edge.config.max_body_bytes:
            self._too_large()
            return
        if self._expect and self.transport is not None:
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        if self._refused:
            return
        self._size += len(body)
        if self._size > self.edge.config.max_body_bytes:
            self._too_large()
            return
        self._body.append(body)

    def on_message_complete(self) -> None:
        if self._refused or self.closing:  # nothing after a refusal or a close is answered
            return
        path, query = _split_target(self._url)
        request = _Request(
            method=self.parser.get_method(), raw_path=path, query=query,
            headers=self._headers, body=b"".join(self._body),
            keep_alive=self.parser.should_keep_alive(),
            http_version=self.parser.get_http_version())
        self.queue.append(request)
        if len(self.queue) >= self.edge.config.max_queued and not self.paused \
                and self.transport is not None:
            self.transport.pause_reading()
            self.paused = True
        self._next()

    # -- answering

    def _next(self) -> None:
        if self.task is not None or self.closed:
            return
        if not self.queue:
            if self.closing:
                self._close()
            else:
                self._arm_idle()
            return
        if self.paused and not self.closing and len(self.queue) < self.edge.config.max_queued \
                and self.transport is not None:
            self.transport.resume_reading()
            self.paused = False
        request = self.queue.popleft()
        self.task = self.loop.create_task(self._answer_then_next(request))

    async def _answer_then_next(self, request: _Request) -> None:
        """Answers ``request``, then starts on the next one (the task's last step, which
        saves a done-callback's turn of the loop per request)."""
        try:
            await self._answer(request)
        except asyncio.CancelledError:  # the client hung up, or the server is stopping
            self.task = None
            raise
        except Exception:
            log.exception("answering a request failed")
            self.task = None
            self._close()
            return
        self.task = None
        self._next()

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
            self._write(_json_response(status, body, keep_alive, extra))
            return
        status, body = await route.handle(request.body, headers)
        self._write(_json_response(status, body, keep_alive))

    async def _answer_asgi(self, request: _Request, keep_alive: bool) -> None:
        edge = self.edge
        transport = self.transport
        assert transport is not None, "answering before the connection was made"
        scope: dict[str, Any] = {
            "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": request.http_version, "scheme": "http",
            "method": request.method.decode("latin-1"),
            "path": unquote(request.raw_path.decode("latin-1")),
            "raw_path": request.raw_path, "query_string": request.query, "root_path": "",
            "headers": request.headers, "server": edge.sockname,
            "client": _address(transport.get_extra_info("peername")),
            "state": dict(edge.state),
        }
        body_sent = False
        started = False
        done = False
        chunked = False
        head_only = request.method == b"HEAD"
        pending: list[tuple[int, list[tuple[bytes, bytes]]]] = []  # the start, unsent

        async def receive() -> Message:
            nonlocal body_sent
            if not body_sent:
                body_sent = True
                return {"type": "http.request", "body": request.body, "more_body": False}
            if self.gone is None:
                self.gone = self.loop.create_future()
            if not self.closed:
                await self.gone
            return {"type": "http.disconnect"}

        async def send(message: Message) -> None:
            nonlocal started, done, chunked
            if self.closed or done:
                return
            if message["type"] == "http.response.start":
                assert not started, "the app started its response twice"
                started = True
                status = int(message["status"])
                headers = [(bytes(k).lower(), bytes(v)) for k, v in message.get("headers", [])]
                pending.append((status, headers))
                return
            if message["type"] != "http.response.body":
                return
            assert started, "the app sent a body before starting its response"
            body = bytes(message.get("body", b""))
            more = bool(message.get("more_body", False))
            if pending:
                status, headers = pending.pop()
                has_length = any(k == b"content-length" for k, _ in headers)
                if not has_length:
                    if more:
                        chunked = True
                        headers.append((b"transfer-encoding", b"chunked"))
                    else:
                        headers.append((b"content-length", str(len(body)).encode()))
                head = _head(status, headers, keep_alive)
                self._write(head if head_only else head + (_chunk(body) if chunked else body))
            elif not head_only:
                self._write(_chunk(body) if chunked else body)
            if not more:
                done = True
                if chunked and not head_only:
                    self._write(b"0\r\n\r\n")

        try:
            await edge.app(scope, receive, send)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("the app failed on %s %s", scope["method"], scope["path"])
            if not started:
                self._write(_json_response(500, _plain_error(500, "internal server error"),
                                           False))
            self.closing = True
            return
        if not done:  # the app returned without finishing its response
            if not started:
                self._write(_json_response(500, _plain_error(
                    500, "the app sent no response"), False))
            self.closing = True

    # -- helpers

    def _write(self, data: bytes) -> None:
        if self.transport is not None and not self.closed:
            self.transport.write(data)

    def _refuse(self, status: int, message: str) -> None:
        self._write(_json_response(status, _plain_error(status, message), False))
        self._close()

    def _too_large(self) -> None:
        """Answers 413 (after the requests before it) and closes: the rest of the body
        is not read."""
        self._refused = True
        method = self.parser.get_method()
        path, _ = _split_target(self._url)
        route = self.edge.routes.get((method, path))
        if route is not None:
            status, body = route.too_large()
        else:
            status = 413
            body = _plain_error(413, f"request body larger than "
                                     f"{self.edge.config.max_body_bytes} bytes")
        self.queue.append(_Request(method, path, b"", [], b"", False, "1.1",
                                   preset=_json_response(status, body, False)))
        self.closing = True
        if self.transport is not None and not self.paused:
            self.transport.pause_reading()
            self.paused = True
        self._next()

    # The keep-alive timer is armed once per idle period, not once per request: it
    # checks, when it fires, whether the connection has been idle for long enough.

    def _arm_idle(self) -> None:
        self._idle_since = self.loop.time()
        if self._idle is None and not self.closed:
            self._idle = self.loop.call_later(self.edge.config.keepalive_s, self._idle_check)

    def _disarm_idle(self) -> None:
        self._idle_since = None

    def _idle_check(self) -> None:
        self._idle = None
        if self.closed or self._idle_since is None:
            return  # busy: re-armed when it goes idle again
        left = self._idle_since + self.edge.config.keepalive_s - self.loop.time()
        if left <= 0 and self.task is None and not self.queue:
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
        if self.task is None:
            self._close()


def _split_target(url: bytes) -> tuple[bytes, bytes]:
    """(path, query) of a request target (an absolute URL's path too)."""
    if not url:
        return b"/", b""
    if url[0:1] == b"/" and b"?" not in url and b"#" not in url:
        return url, b""  # the common case, without a parse
    parsed = httptools.parse_url(url)
    return parsed.path or b"/", parsed.query or b""


def _address(peer: Any) -> tuple[str, int] | None:
    """(host, port) of a socket address (IPv6 ones have four fields)."""
    if isinstance(peer, tuple) and len(peer) >= 2:
        return (str(peer[0]), int(peer[1]))
    return None


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data) if data else b""


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
        self._lifespan: _Lifespan | None = None

    async def start(self, host: str, port: int) -> tuple[str, int]:
        """Runs the app's lifespan startup and listens; returns the bound address."""
        self._lifespan = _Lifespan(self.app, self.state)
        await self._lifespan.startup()
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _Connection(self), host, port)
        sock = self._server.sockets[0].getsockname()
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
        for conn in list(self.connections):
            if conn.task is not None:
                conn.task.cancel()
            if conn.transport is not None:
                conn.transport.abort()
        if self._server is not None:
            await self._server.wait_closed()
        if self._lifespan is not None:
            await self._lifespan.shutdown()


class _Lifespan:
    """The ASGI lifespan protocol around the server (startup failures raise)."""

    def __init__(self, app: ASGIApp, state: dict[str, Any]) -> None:
        self.app = app
        self.state = state
        self._inbox: asyncio.Queue[Message] = asyncio.Queue()
        self._started: asyncio.Future[None] | None = None
        self._stopped: asyncio.Future[None] | None = None
        self._task: asyncio.Task[None] | None = None

    async def startup(self) -> None:
        loop = asyncio.get_running_loop()
        self._started, self._stopped = loop.create_future(), loop.create_future()
        self._task = loop.create_task(self._run())
        await self._inbox.put({"type": "lifespan.startup"})
        await self._started

    async def shutdown(self) -> None:
        if self._task is None or self._task.done():
            return
        await self._inbox.put({"type": "lifespan.shutdown"})
        assert self._stopped is not None
        await asyncio.wait({self._stopped, self._task}, return_when=asyncio.FIRST_COMPLETED)
        if self._stopped.done() and self._stopped.exception() is not None:
            raise cast(BaseException, self._stopped.exception())

    async def _run(self) -> None:
        assert self._started is not None and self._stopped is not None
        scope = {"type": "lifespan", "asgi": {"version": "3.0", "spec_version": "2.0"},
                 "state": self.state}
        try:
            await self.app(scope, self._inbox.get, self._send)
        except BaseException as e:
            for fut in (self._started, self._stopped):
                if not fut.done():
                    fut.set_exception(RuntimeError(f"the app's lifespan failed: {e!r}"))
            if not isinstance(e, Exception):
                raise
        finally:
            for fut in (self._started, self._stopped):
                if not fut.done():
                    fut.set_result(None)  # the app has no lifespan: nothing to wait for

    async def _send(self, message: Message) -> None:
        assert self._started is not None and self._stopped is not None
        kind = message["type"]
        if kind == "lifespan.startup.complete":
            self._started.set_result(None)
        elif kind == "lifespan.startup.failed":
            self._started.set_exception(RuntimeError(
                f"the app failed to start: {message.get('message', '')}"))
        elif kind == "lifespan.shutdown.complete":
            self._stopped.set_result(None)
        elif kind == "lifespan.shutdown.failed":
            self._stopped.set_exception(RuntimeError(
                f"the app failed to shut down: {message.get('message', '')}"))


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


__all__ = ["Edge", "EdgeConfig", "FastRoute", "serve"]
