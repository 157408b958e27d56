"""``war.router.edge``: the HTTP/1.1 server of ``war route``, over loopback sockets.

Fast routes and the ASGI fallback, keep-alive and pipelining (answers in order),
chunked and ``Expect: 100-continue`` request bodies, HTTP/1.0, ``Connection: close``,
413 and 400 (the connection closes, the server keeps serving), streamed ASGI
responses, HEAD, a client hanging up (the fast handler is cancelled), the idle
timeout, the lifespan, a graceful stop, and the router's app served by it."""

from __future__ import annotations

import asyncio
import contextlib
import math
import select
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from typing import Any

import httpx
import orjson
import pytest
from fastapi import FastAPI
from fastapi.responses import StreamingResponse
from test_router_server import KEY, FirstHealthy, Scripted

from war.router.edge import Edge, EdgeConfig, FastRoute, Respond
from war.router.router import Router
from war.router.server import create_router_app
from war.types import GenRequest, GenResult


class Echo:
    """A fast route that echoes its body and headers; ``hold`` keeps it waiting until
    released (to test hang-ups and ordering)."""

    def __init__(self) -> None:
        self.calls: list[tuple[bytes, dict[str, str]]] = []
        self.cancelled = 0
        self.too_large_calls = 0
        self.hold: asyncio.Event | None = None
        self.delays: dict[bytes, float] = {}

    async def handle(self, body: bytes, headers: Mapping[str, str],
                     respond: Respond) -> tuple[int, bytes] | None:
        self.calls.append((body, dict(headers)))
        try:
            if self.hold is not None:
                await self.hold.wait()
            await asyncio.sleep(self.delays.get(body, 0.0))
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        return 200, orjson.dumps({"body": body.decode(), "n": len(self.calls)})

    def too_large(self) -> tuple[int, bytes]:
        self.too_large_calls += 1
        return 413, b'{"error": "too large (route)"}'

    def route(self, key: str | None = None) -> FastRoute:
        def authorize(headers: Mapping[str, str]) -> tuple[int, bytes, dict[str, str]] | None:
            if key is None or headers.get("authorization") == f"Bearer {key}":
                return None
            return 401, b'{"error": "key"}', {"WWW-Authenticate": "Bearer"}
        return FastRoute(self.handle, self.too_large, authorize)


def side_app(events: list[str]) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[dict[str, Any]]:
        events.append("startup")
        yield {"greeting": "hi"}
        events.append("shutdown")

    app = FastAPI(lifespan=lifespan)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"ok": True}

    @app.post("/echo")
    async def echo(body: dict[str, Any]) -> dict[str, Any]:
        return body

    @app.get("/stream")
    async def stream() -> StreamingResponse:
        async def parts() -> AsyncIterator[bytes]:
            for i in range(3):
                yield f"part{i};".encode()
        return StreamingResponse(parts(), media_type="text/plain")

    @app.get("/slow")
    async def slow() -> dict[str, Any]:
        await asyncio.sleep(0.3)
        return {"slow": True}

    @app.get("/boom")
    async def boom() -> dict[str, Any]:
        raise RuntimeError("boom")

    return app


@contextlib.contextmanager
def running(app: Any, routes: Mapping[tuple[str, str], FastRoute],
            config: EdgeConfig | None = None) -> Iterator[tuple[str, int, Edge]]:
    """The edge on a free 127.0.0.1 port, its loop in a thread; stopped on exit."""
    edge = Edge(app, routes, config)
    ready = threading.Event()
    loop = asyncio.new_event_loop()
    stop: list[asyncio.Event] = []
    failure: list[BaseException] = []

    async def main() -> None:
        stop.append(asyncio.Event())
        try:
            await edge.start("127.0.0.1", 0)
        except BaseException as e:
            failure.append(e)
            ready.set()
            return
        ready.set()
        await stop[0].wait()
        await edge.stop()

    thread = threading.Thread(target=loop.run_until_complete, args=(main(),), daemon=True)
    thread.start()
    assert ready.wait(10), "the edge did not start"
    if failure:
        raise failure[0]
    assert edge.sockname is not None
    try:
        yield edge.sockname[0], edge.sockname[1], edge
    finally:
        loop.call_soon_threadsafe(stop[0].set)
        thread.join(20)
        loop.close()


def raw(port: int, data: bytes, *, wait_close: bool = True, timeout: float = 5.0) -> bytes:
    """Sends ``data`` on a new connection; returns what comes back until the server
    closes (or ``timeout``)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(data)
        out = b""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                chunk = s.recv(65536)
            except TimeoutError:
                break
            if not chunk:
                return out
            out += chunk
            if not wait_close and out.count(b"HTTP/1.1") >= 1 and b"\r\n\r\n" in out:
                break
        assert not wait_close, f"the server did not close the connection: {out!r}"
        return out


def wait_for(condition: Callable[[], bool], timeout: float = 5.0) -> bool:
    """Polls ``condition`` until it holds or ``timeout`` passes; returns it."""
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return condition()


def hang_up_once_started(port: int, data: bytes, started: Callable[[], bool]) -> None:
    """Sends ``data`` and closes the connection once ``started()`` holds."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(data)
        assert wait_for(started), "the request did not start"


def post(path: str, body: bytes, extra: str = "") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n{extra}\r\n"
            ).encode() + body


def test_fast_route_and_asgi_side_routes_with_lifespan() -> None:
    events: list[str] = []
    echo = Echo()
    with running(side_app(events), {("POST", "/v1/completions"): echo.route()}) as (h, p, _):
        assert events == ["startup"]
        with httpx.Client(base_url=f"http://{h}:{p}") as c:
            r = c.post("/v1/completions", content=b"abc",
                       headers={"X-Trajectory-Id": "t1", "content-type": "application/json"})
            assert r.status_code == 200 and r.json() == {"body": "abc", "n": 1}
            assert r.headers["content-type"] == "application/json" and "date" in r.headers
            assert echo.calls[0][1]["x-trajectory-id"] == "t1"  # lower-case names
            assert c.get("/health").json() == {"ok": True}
            assert c.post("/echo", json={"a": [1, 2]}).json() == {"a": [1, 2]}
            assert c.get("/nowhere").status_code == 404
            assert c.get("/v1/completions").status_code in (404, 405)  # GET: not the fast route
            # the same keep-alive connection served all of them
            assert c.post("/v1/completions", content=b"x").json()["n"] == 2
    assert events == ["startup", "shutdown"]


def test_pipelined_requests_are_answered_in_order() -> None:
    echo = Echo()
    echo.delays = {b"slow": 0.2}
    with running(side_app([]), {("POST", "/v1/completions"): echo.route()}) as (_, p, _e):
        data = (post("/v1/completions", b"slow") + post("/v1/completions", b"fast")
                + b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        out = raw(p, data)
    answers = out.split(b"HTTP/1.1 ")[1:]
    assert len(answers) == 3, out
    assert b'"body":"slow"' in answers[0] and b'"body":"fast"' in answers[1]
    assert b'{"ok":true}' in answers[2] and b"connection: close" in answers[2]


def test_chunked_bodies_expect_continue_and_http10() -> None:
    echo = Echo()
    with running(side_app([]), {("POST", "/v1/completions"): echo.route()}) as (_, p, _e):
        chunked = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
                   b"Connection: close\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n")
        assert b'"body":"abcde"' in raw(p, chunked)
        expect = "Expect: 100-continue\r\nConnection: close\r\n"
        out = raw(p, post("/v1/completions", b"hey", expect))
        assert out.startswith(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK") and b"hey" in out
        # HTTP/1.0 without keep-alive: answered, then closed
        out = raw(p, b"POST /v1/completions HTTP/1.0\r\nContent-Length: 2\r\n\r\nok")
        assert out.startswith(b"HTTP/1.1 200 OK") and b"connection: close" in out


def test_oversized_bodies_get_413_and_the_server_keeps_serving() -> None:
    echo = Echo()
    routes = {("POST", "/v1/completions"): echo.route()}
    with running(side_app([]), routes, EdgeConfig(max_body_bytes=10)) as (h, p, _):
        out = raw(p, post("/v1/completions", b"x" * 11))
        assert out.startswith(b"HTTP/1.1 413") and b"too large (route)" in out
        assert echo.too_large_calls == 1 and echo.calls == []
        # chunked past the limit; and a side route's 413 has a body of its own
        out = raw(p, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked"
                     b"\r\n\r\n6\r\nabcdef\r\n6\r\nghijkl\r\n0\r\n\r\n")
        assert out.startswith(b"HTTP/1.1 413") and echo.too_large_calls == 2
        out = raw(p, post("/echo", b"{" + b" " * 20 + b"}"))
        assert out.startswith(b"HTTP/1.1 413") and b"larger than 10 bytes" in out
        # a request answered before the oversized one on the same connection still is
        out = raw(p, post("/v1/completions", b"ok") + post("/v1/completions", b"y" * 50))
        assert out.count(b"HTTP/1.1 ") == 2 and b'"body":"ok"' in out
        assert b"HTTP/1.1 413" in out
        with httpx.Client(base_url=f"http://{h}:{p}") as c:
            assert c.post("/v1/completions", content=b"small").status_code == 200


def test_malformed_requests_and_upgrades() -> None:
    echo = Echo()
    with running(side_app([]), {("POST", "/v1/completions"): echo.route()}) as (h, p, _):
        out = raw(p, b"THIS IS NOT HTTP\r\n\r\n")
        assert out.startswith(b"HTTP/1.1 400") and b"malformed" in out
        out = raw(p, b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\n"
                     b"Upgrade: h2c\r\n\r\n")
        assert out.startswith(b"HTTP/1.1 200") and b'{"ok":true}' in out  # then closed
        with httpx.Client(base_url=f"http://{h}:{p}") as c:
            assert c.get("/health").status_code == 200


def test_upgrade_requests_are_answered_over_http11_with_their_body() -> None:
    # what ``curl --http2`` sends to an http:// URL: the upgrade is ignored, the body read
    echo = Echo()
    h2c = "Connection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\nHTTP2-Settings: AAMAAABk\r\n"
    with running(side_app([]), {("POST", "/v1/completions"): echo.route()},
                 EdgeConfig(max_body_bytes=32)) as (h, p, _):
        out = raw(p, post("/v1/completions", b"hello", h2c))
        assert out.startswith(b"HTTP/1.1 200") and b'"body":"hello"' in out
        assert b"connection: close" in out and out.count(b"HTTP/1.1 ") == 1
        assert echo.calls[-1][1]["upgrade"] == "h2c"  # the request's own headers
        # a chunked body arriving after the head, and with Expect: 100-continue
        with socket.create_connection(("127.0.0.1", p), timeout=5) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\n"
                         b"Upgrade: websocket\r\nExpect: 100-continue\r\n"
                         b"Transfer-Encoding: chunked\r\n\r\n")
            assert sock.recv(65536) == b"HTTP/1.1 100 Continue\r\n\r\n"
            sock.sendall(b"3\r\nabc\r\n")
            time.sleep(0.1)
            sock.sendall(b"2\r\nde\r\n0\r\n\r\n")
            got = b""
            while chunk := sock.recv(65536):
                got += chunk
        assert got.startswith(b"HTTP/1.1 200") and b'"body":"abcde"' in got
        # a request before it is answered; what comes after it is not read (the
        # connection closes after it, as documented)
        out = raw(p, post("/v1/completions", b"first") + post("/v1/completions", b"up", h2c)
                  + post("/v1/completions", b"after") + b"NOT HTTP\r\n\r\n")
        assert out.count(b"HTTP/1.1 200") == 2 and out.count(b"HTTP/1.1 ") == 2, out
        assert out.index(b'"body":"first"') < out.index(b'"body":"up"')
        assert b"after" not in out and [c[0] for c in echo.calls][-2:] == [b"first", b"up"]
        # the body's size limit holds for it too
        out = raw(p, post("/v1/completions", b"x" * 40, h2c))
        assert out.startswith(b"HTTP/1.1 413")
        out = raw(p, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\n"
                     b"Upgrade: h2c\r\nTransfer-Encoding: chunked\r\n\r\n"
                     b"20\r\n" + b"y" * 32 + b"\r\n20\r\n" + b"z" * 32 + b"\r\n0\r\n\r\n")
        assert out.startswith(b"HTTP/1.1 413")
        with httpx.Client(base_url=f"http://{h}:{p}") as c:
            assert c.post("/v1/completions", content=b"next").status_code == 200


def test_a_malformed_request_is_answered_after_the_requests_before_it() -> None:
    echo = Echo()
    echo.delays = {b"slow": 0.2}
    with running(side_app([]), {("POST", "/v1/completions"): echo.route()}) as (_, p, _e):
        out = raw(p, post("/v1/completions", b"slow") + b"NOT HTTP\r\n\r\n")
        assert out.startswith(b"HTTP/1.1 200") and b'"body":"slow"' in out, out
        assert out.count(b"HTTP/1.1 ") == 2 and b"HTTP/1.1 400" in out
        # what follows a ``Connection: close`` request is not read, nor refused
        out = raw(p, post("/v1/completions", b"last", "Connection: close\r\n")
                  + post("/v1/completions", b"after"))
        assert out.count(b"HTTP/1.1 ") == 1 and b'"body":"last"' in out, out
        assert [c[0] for c in echo.calls] == [b"slow", b"last"]


def test_100_continue_waits_for_the_answers_before_it() -> None:
    # a 100 Continue sent early would read as an interim answer to the request before
    echo = Echo()
    echo.delays = {b"slow": 0.2}
    with running(side_app([]), {("POST", "/v1/completions"): echo.route()}) as (_, p, _e), \
            socket.create_connection(("127.0.0.1", p), timeout=5) as s:
        s.sendall(post("/v1/completions", b"slow")
                  + b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n"
                    b"Expect: 100-continue\r\n\r\n")
        out = b""
        while b"100 Continue" not in out:
            chunk = s.recv(65536)
            assert chunk, out
            out += chunk
        assert out.startswith(b"HTTP/1.1 200") and out.index(b'"body":"slow"') < out.index(
            b"HTTP/1.1 100 Continue"), out
        s.sendall(b"abc")
        while b'"body":"abc"' not in out:
            chunk = s.recv(65536)
            assert chunk, out
            out += chunk
        assert out.count(b"100 Continue") == 1


def test_oversized_heads_get_431_and_the_server_keeps_serving() -> None:
    echo = Echo()
    config = EdgeConfig(max_header_bytes=1024)
    with running(side_app([]), {("POST", "/v1/completions"): echo.route()}, config) as (
            h, p, edge):
        with socket.create_connection(("127.0.0.1", p), timeout=5) as s:
            s.sendall(post("/v1/completions", b"before") + b"GET /health HTTP/1.1\r\nX-Big: ")
            out = b""
            for _ in range(8):  # 2 KiB more of the header, in reads of its own
                time.sleep(0.05)
                try:
                    s.sendall(b"a" * 256)
                except OSError:
                    break
            while chunk := s.recv(65536):
                out += chunk
        assert out.startswith(b"HTTP/1.1 200") and b'"body":"before"' in out, out
        assert b"HTTP/1.1 431 Request Header Fields Too Large" in out
        assert b"larger than 1024 bytes" in out
        assert wait_for(lambda: len(edge.connections) == 0)
        # a head within the limit is served
        with httpx.Client(base_url=f"http://{h}:{p}") as c:
            r = c.post("/v1/completions", content=b"ok", headers={"X-Pad": "b" * 800})
            assert r.status_code == 200


def test_trailers_are_not_taken_for_headers() -> None:
    echo = Echo()
    with running(side_app([]), {("POST", "/v1/completions"): echo.route(KEY)}) as (_, p, _e):
        out = raw(p, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked"
                     b"\r\nConnection: close\r\n\r\n1\r\na\r\n0\r\n"
                     b"Authorization: Bearer " + KEY.encode() + b"\r\nX-Trailer: t\r\n\r\n")
        assert out.startswith(b"HTTP/1.1 401"), out
        out = raw(p, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked"
                     b"\r\nAuthorization: Bearer " + KEY.encode() + b"\r\nConnection: close"
                     b"\r\n\r\n1\r\na\r\n0\r\nX-Trailer: t\r\n\r\n")
        assert out.startswith(b"HTTP/1.1 200"), out
        assert "x-trailer" not in echo.calls[-1][1] and echo.calls[-1][0] == b"a"


def test_http10_keep_alive_requests_are_told_the_connection_closes() -> None:
    # the answer does not say ``keep-alive``: an HTTP/1.0 client takes it as the last
    echo = Echo()
    with running(side_app([]), {("POST", "/v1/completions"): echo.route()}) as (_, p, _e):
        out = raw(p, b"POST /v1/completions HTTP/1.0\r\nConnection: keep-alive\r\n"
                     b"Content-Length: 2\r\n\r\nok", timeout=2.0)  # closed by the server
        assert out.startswith(b"HTTP/1.1 200") and b"connection: close" in out, out


def test_streamed_head_and_failing_asgi_responses() -> None:
    with running(side_app([]), {}) as (h, p, _):
        out = raw(p, b"GET /stream HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert b"transfer-encoding: chunked" in out.lower()
        with httpx.Client(base_url=f"http://{h}:{p}") as c:
            assert c.get("/stream").text == "part0;part1;part2;"
            r = c.head("/health")
            assert r.status_code in (200, 405) and r.content == b""
        out = raw(p, b"GET /boom HTTP/1.1\r\nHost: x\r\n\r\n")
        assert out.startswith(b"HTTP/1.1 500")
        with httpx.Client(base_url=f"http://{h}:{p}") as c:
            assert c.get("/health").status_code == 200


def test_authorize_refuses_before_the_handler_runs() -> None:
    echo = Echo()
    routes = {("POST", "/v1/completions"): echo.route(KEY)}
    with running(side_app([]), routes) as (h, p, _), \
            httpx.Client(base_url=f"http://{h}:{p}") as c:
        r = c.post("/v1/completions", content=b"a")
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        assert echo.calls == []
        r = c.post("/v1/completions", content=b"a", headers={"Authorization": f"Bearer {KEY}"})
        assert r.status_code == 200


def test_a_client_hanging_up_cancels_the_fast_handler() -> None:
    echo = Echo()
    with running(side_app([]), {("POST", "/v1/completions"): echo.route()}) as (h, p, _):
        echo.hold = asyncio.Event()  # (created here, used on the edge's loop only)
        hang_up_once_started(p, post("/v1/completions", b"wait"), lambda: bool(echo.calls))
        assert wait_for(lambda: echo.cancelled == 1)
        echo.hold = None
        with httpx.Client(base_url=f"http://{h}:{p}") as c:
            assert c.post("/v1/completions", content=b"next").status_code == 200


def test_a_hang_up_cancels_the_handler_while_another_cancellation_is_pending() -> None:
    # The router cancels a call on a replica that failed its health check and takes
    # that cancellation back (Router.route); a client hanging up meanwhile must still
    # cancel its request: the edge goes by its own record, not by the task's
    # cancelling() count.
    seen: dict[str, int] = {"ready": 0, "cancelled": 0, "finished": 0}

    async def handle(body: bytes, headers: Mapping[str, str],
                     respond: Respond) -> tuple[int, bytes] | None:
        task = asyncio.current_task()
        assert task is not None
        task.cancel()  # (as the router does)
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.sleep(5)  # ... not yet taken back when the client hangs up
        seen["ready"] = 1
        try:
            await asyncio.sleep(3)
        except asyncio.CancelledError:
            if task.uncancel() > 0:  # (the router's check: another cancellation came)
                seen["cancelled"] += 1
                raise
        seen["finished"] += 1
        return 200, b"{}"

    route = FastRoute(handle, lambda: (413, b"{}"))
    with running(side_app([]), {("POST", "/v1/completions"): route}) as (_, p, _):
        hang_up_once_started(p, post("/v1/completions", b"x"), lambda: seen["ready"] == 1)
        assert wait_for(lambda: seen["cancelled"] == 1, timeout=2.0)
    assert seen["finished"] == 0


def test_idle_connections_close_after_the_keepalive_timeout() -> None:
    echo = Echo()
    config = EdgeConfig(keepalive_s=0.3)
    with running(side_app([]), {("POST", "/v1/completions"): echo.route()}, config) as (
            _, p, edge):
        with socket.create_connection(("127.0.0.1", p), timeout=5) as s:
            s.sendall(post("/v1/completions", b"a"))
            first = s.recv(65536)
            assert first.startswith(b"HTTP/1.1 200")
            t0 = time.monotonic()
            assert s.recv(65536) == b""  # closed by the server when idle
            assert 0.1 < time.monotonic() - t0 < 3.0
        assert len(edge.connections) == 0


def test_a_stalled_partial_request_closes_after_the_read_timeout() -> None:
    echo = Echo()
    config = EdgeConfig(keepalive_s=5.0, read_timeout_s=0.3)
    with running(side_app([]), {("POST", "/v1/completions"): echo.route()}, config) as (
            _, p, edge):
        with socket.create_connection(("127.0.0.1", p), timeout=5) as s:
            s.sendall(post("/v1/completions", b"0123456789")[:-6])  # 6 bytes short
            t0 = time.monotonic()
            assert s.recv(65536) == b""  # closed: the rest never came
            assert 0.2 < time.monotonic() - t0 < 3.0
        assert not echo.calls and wait_for(lambda: len(edge.connections) == 0)


def test_a_request_arriving_when_its_predecessor_is_answered_gets_the_read_timeout() -> None:
    # the next request has begun arriving: it must keep coming within read_timeout_s,
    # not within the (shorter) keep-alive limit of an idle connection
    echo = Echo()
    config = EdgeConfig(keepalive_s=0.2, read_timeout_s=3.0)
    with running(side_app([]), {("POST", "/v1/completions"): echo.route()}, config) as (
            _, p, _):
        with socket.create_connection(("127.0.0.1", p), timeout=5) as s:
            second = post("/v1/completions", b"second", "Connection: close\r\n")
            s.sendall(post("/v1/completions", b"first") + second[:20])
            assert s.recv(65536).startswith(b"HTTP/1.1 200")
            time.sleep(0.7)  # past keepalive_s
            s.sendall(second[20:])
            got = b""
            while chunk := s.recv(65536):
                got += chunk
        assert got.startswith(b"HTTP/1.1 200") and b'"body":"second"' in got


def test_a_slow_upload_that_keeps_sending_is_answered() -> None:
    echo = Echo()
    config = EdgeConfig(keepalive_s=0.4, read_timeout_s=0.3)
    with running(side_app([]), {("POST", "/v1/completions"): echo.route()}, config) as (
            _, p, _):
        with socket.create_connection(("127.0.0.1", p), timeout=5) as s:
            data = post("/v1/completions", b"0123456789")
            head = len(data) - 10
            s.sendall(data[:head])
            for i in range(10):  # a byte every 0.1 s: 1 s in all, past the read timeout
                time.sleep(0.1)
                s.sendall(data[head + i:head + i + 1])
            assert s.recv(65536).startswith(b"HTTP/1.1 200")
            # and once answered the connection is idle: the keep-alive limit applies
            t0 = time.monotonic()
            assert s.recv(65536) == b""
            assert 0.25 < time.monotonic() - t0 < 2.0
        assert echo.calls[0][0] == b"0123456789"


def test_stop_waits_for_requests_in_flight() -> None:
    echo = Echo()
    echo.delays = {b"slow": 0.3}
    results: list[tuple[int, str | None]] = []
    with running(side_app([]), {("POST", "/v1/completions"): echo.route()}) as (h, p, edge):
        def call() -> None:
            r = httpx.post(f"http://{h}:{p}/v1/completions", content=b"slow", timeout=10)
            results.append((r.status_code, r.headers.get("connection")))

        def call_asgi() -> None:
            r = httpx.get(f"http://{h}:{p}/slow", timeout=10)
            results.append((r.status_code, r.headers.get("connection")))
        threads = [threading.Thread(target=call), threading.Thread(target=call_asgi)]
        for t in threads:
            t.start()
        assert wait_for(lambda: bool(echo.calls) and sum(
            c.task is not None for c in list(edge.connections)) == 2)
    for t in threads:
        t.join(10)
    # both finished, and both said they were the last answer on their connection
    assert results == [(200, "close"), (200, "close")]


def test_stop_lets_cancelled_requests_clean_up_before_the_shutdown() -> None:
    """A request still running after the grace period is cancelled, and its cleanup
    (which may still call the app's state, e.g. the router) ends before the lifespan
    shutdown closes that state."""
    events: list[str] = []

    async def handle(body: bytes, headers: Mapping[str, str],
                     respond: Respond) -> tuple[int, bytes] | None:
        events.append("request")
        try:
            await asyncio.sleep(30)
        finally:
            await asyncio.sleep(0.05)  # cleanup that awaits
            events.append("request cleaned up")
        return 200, b"{}"

    route = FastRoute(handle, lambda: (413, b"{}"), lambda _h: None)
    with running(side_app(events), {("POST", "/hang"): route},
                 EdgeConfig(shutdown_grace_s=0.2)) as (h, p, _edge):
        def call() -> None:
            with contextlib.suppress(httpx.HTTPError):
                httpx.post(f"http://{h}:{p}/hang", content=b"x", timeout=10)
        thread = threading.Thread(target=call)
        thread.start()
        assert wait_for(lambda: "request" in events)
    thread.join(10)
    assert events == ["startup", "request", "request cleaned up", "shutdown"]


def test_a_failing_lifespan_fails_the_start() -> None:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        raise RuntimeError("no replicas")
        yield

    with pytest.raises(RuntimeError, match="no replicas"), running(FastAPI(lifespan=lifespan), {}):
        pass


def test_a_taken_port_fails_the_start_before_the_lifespan() -> None:
    events: list[str] = []
    with running(side_app([]), {}) as (_, port, _edge):
        second = Edge(side_app(events), {})

        async def start() -> None:
            await second.start("127.0.0.1", port)

        with pytest.raises(OSError):
            asyncio.run(start())
    assert events == []  # nothing was started for the server that could not bind


def test_config_validation() -> None:
    for bad in ({"max_body_bytes": 0}, {"keepalive_s": 0}, {"read_timeout_s": 0},
                {"shutdown_grace_s": -1},
                {"max_queued": 0}, {"max_header_bytes": 0}):
        with pytest.raises(ValueError):
            EdgeConfig(**bad)
    for name in ("keepalive_s", "read_timeout_s", "shutdown_grace_s"):
        for value in (math.inf, math.nan):  # (inf: a connection held forever)
            with pytest.raises(ValueError, match=f"{name} must be a finite number > 0"):
                EdgeConfig(**{name: value})
    for name in ("max_body_bytes", "max_queued", "max_header_bytes"):  # (a NaN: no limit)
        for value in (math.nan, 1.5, True):
            with pytest.raises(ValueError, match=f"{name} must be an int"):
                EdgeConfig(**{name: value})  # type: ignore[arg-type]


def test_the_router_app_on_the_edge() -> None:
    """The router's completions (fast route, bearer auth, metrics by status) and its
    side endpoints, served as ``war route`` serves them."""
    a, b = Scripted("a"), Scripted("b")
    router = Router([a, b], FirstHealthy())
    app = create_router_app(router, api_key=KEY, eos_token_ids=(7,), manage_router=True)
    auth = {"Authorization": f"Bearer {KEY}"}
    with running(app, app.state.fast_routes) as (h, p, _):
        with httpx.Client(base_url=f"http://{h}:{p}", headers=auth) as c:
            r = c.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2},
                       headers={"X-Trajectory-Id": "t9"})
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["token_ids"] == [1, 2]
            assert r.json()["choices"][0]["replica"] == "a"
            assert a.seen[0].trajectory_id == "t9" and 7 in a.seen[0].sampling.stop_token_ids
            assert c.post("/v1/completions", content=b"{not json").status_code == 400
            assert c.post("/v1/completions", json={"prompt": [1]},
                          headers={"Authorization": "Bearer wrong"}).status_code == 401
            assert c.get("/health").json()["healthy_replicas"] == 2
            assert c.get("/metrics", headers={}).status_code == 200
            text = c.get("/metrics").text
            assert 'war_router_http_requests_total{status="200"} 1.0' in text
            assert 'war_router_http_requests_total{status="400"} 1.0' in text
        assert httpx.get(f"http://{h}:{p}/metrics").status_code == 401


class Blocking(Scripted):
    """A replica whose generate waits until cancelled (counts the cancellations)."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.cancelled = 0

    async def generate(self, request: GenRequest) -> GenResult:
        self.seen.append(request)
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        raise AssertionError("unreachable")


def test_a_client_hanging_up_cancels_the_routed_call_and_counts_499() -> None:
    slow = Blocking("slow")
    router = Router([slow], FirstHealthy())
    app = create_router_app(router, manage_router=True)
    with running(app, app.state.fast_routes) as (h, p, _):
        hang_up_once_started(p, post("/v1/completions", b'{"prompt": [1, 2], "max_tokens": 1}'),
                             lambda: bool(slow.seen))
        assert wait_for(lambda: slow.cancelled == 1)
        text = httpx.get(f"http://{h}:{p}/metrics", timeout=5).text
        assert 'war_router_http_requests_total{status="499"} 1.0' in text
        assert router.replicas["slow"].num_requests == 0  # its accounting was undone


class FailsAfterwards(FirstHealthy):
    """Its feedback on every other completion fails (a bug in a policy)."""

    def on_complete(self, request: GenRequest, result: GenResult | None, replica: str,
                    now: float) -> None:
        super().on_complete(request, result, replica, now)
        if len(self.completed) % 2 == 1:
            raise RuntimeError("policy bug")


def test_the_router_answers_before_its_bookkeeping_and_survives_its_failure(
        caplog: pytest.LogCaptureFixture) -> None:
    rep = Scripted("a")
    policy = FailsAfterwards()
    router = Router([rep], policy)
    app = create_router_app(router, manage_router=True)
    body = b'{"prompt": [1, 2], "max_tokens": 2}'
    with running(app, app.state.fast_routes) as (h, p, _), \
            httpx.Client(base_url=f"http://{h}:{p}") as c:
        first = c.post("/v1/completions", content=body)
        # answered (the replica's tokens) although the policy's feedback then failed
        assert first.status_code == 200 and first.json()["choices"][0]["token_ids"]
        second = c.post("/v1/completions", content=body)
        assert second.status_code == 200
        # the connection's next request is served once the handler has returned, so by
        # then the bookkeeping of both is done
        text = c.get("/metrics").text
        assert 'war_router_http_requests_total{status="200"} 2.0' in text
        assert len(policy.completed) == 2
    assert any("after answering" in r.getMessage() for r in caplog.records)


class EarlyAnswer:
    """A fast route that answers through ``respond``, then keeps working until
    ``release`` is set (``mode``: ``early``, ``twice``, ``never`` or ``fail``: raises
    before answering)."""

    def __init__(self, mode: str = "early") -> None:
        self.mode = mode
        self.release = threading.Event()
        self.finished: list[bytes] = []

    async def handle(self, body: bytes, headers: Mapping[str, str],
                     respond: Respond) -> tuple[int, bytes] | None:
        if self.mode == "fail":
            raise RuntimeError("the handler failed")
        if self.mode != "never":
            respond(200, orjson.dumps({"body": body.decode()}))
        if self.mode == "twice":
            respond(200, b"{}")
        for _ in range(500):  # (bounded: 5 s)
            if self.release.is_set():
                break
            await asyncio.sleep(0.01)
        self.finished.append(body)
        return None

    def route(self) -> FastRoute:
        return FastRoute(self.handle, lambda: (413, b"{}"))


def test_a_fast_route_may_answer_before_it_returns() -> None:
    early = EarlyAnswer()
    routes = {("POST", "/v1/completions"): early.route()}
    with running(side_app([]), routes) as (_, port, _e), \
            socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        # two pipelined requests: the first is answered while its handler still works
        s.sendall(post("/v1/completions", b"one") + post("/v1/completions", b"two"))
        out = b""
        while b'{"body":"one"}' not in out:
            out += s.recv(65536)
        assert early.finished == [] and b'"two"' not in out
        # the next request on the connection waits for the handler to return
        time.sleep(0.1)
        if select.select([s], [], [], 0)[0]:
            out += s.recv(65536)
        assert b'"two"' not in out
        early.release.set()
        while b'{"body":"two"}' not in out:
            out += s.recv(65536)
        assert out.count(b"HTTP/1.1 200") == 2
        # (the second handler, too, answered before it finished)
        assert wait_for(lambda: early.finished == [b"one", b"two"]), early.finished


def test_a_fast_route_answering_twice_or_never_closes_the_connection() -> None:
    for mode, answers in (("twice", 1), ("never", 0)):
        handler = EarlyAnswer(mode)
        handler.release.set()
        with running(side_app([]), {("POST", "/v1/completions"): handler.route()}) as (_, p, _e):
            out = raw(p, post("/v1/completions", b"x"))  # closed by the server
            assert out.count(b"HTTP/1.1 200") == answers, (mode, out)
            # the server goes on serving other connections
            assert b"HTTP/1.1 200" in raw(p, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n",
                                           wait_close=False)


def test_a_fast_route_that_fails_or_never_answers_gets_a_500() -> None:
    for mode in ("fail", "never"):
        handler = EarlyAnswer(mode)
        handler.release.set()
        with running(side_app([]), {("POST", "/v1/completions"): handler.route()}) as (_, p, _e):
            out = raw(p, post("/v1/completions", b"x"))  # closed by the server
            assert out.startswith(b"HTTP/1.1 500 "), (mode, out)
            assert out.count(b"HTTP/1.1") == 1 and b"connection: close" in out
            assert orjson.loads(out.split(b"\r\n\r\n", 1)[1])["error"]["message"]


@pytest.mark.parametrize("keep_alive", [True, False])
@pytest.mark.parametrize("status", [200, 404, 499])
def test_json_answers_are_the_bytes_of_their_head(keep_alive: bool, status: int) -> None:
    from war.router.edge_wire import date_header, head, json_response

    for body in (b"{}", b'{"x": "' + b"y" * 5000 + b'"}'):
        for _ in range(3):  # (again if the second, and so the date header, turned between)
            got = json_response(status, body, keep_alive)
            want = head(status, [(b"content-type", b"application/json"),
                                 (b"content-length", str(len(body)).encode())],
                        keep_alive) + body
            if got == want:
                break
        assert got == want
        assert got.startswith(b"HTTP/1.1 %d " % status) and b"date: " + date_header() in got
        assert (b"connection: close" in got) is not keep_alive
    extra = json_response(status, b"{}", True, {"WWW-Authenticate": "Bearer"})
    assert b"\r\nwww-authenticate: Bearer\r\n" in extra
