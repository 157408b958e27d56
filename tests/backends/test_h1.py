"""``war.backends.h1``, the lean keep-alive HTTP/1.1 client: against raw socket
servers written here (request encoding, keep-alive, the connection limit, body
framing, interim answers, stale pooled connections, timeouts, broken answers, the
pool's close) and against uvicorn, each on asyncio's own loop and on uvloop (whose
transports are not ``asyncio.Transport`` subclasses); and its use through
``HttpChannel`` / ``WarHttpBackend`` (error mapping, path prefix, IPv6, Host and
Authorization headers, a channel used from two event loops)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
import struct
import threading
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
import orjson
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

import war.aio
from loopback import serve
from war.backends.base import ReplicaUnavailable
from war.backends.h1 import ConnectionClosed, Pool, Response, TransportError
from war.backends.http import HttpChannel, WarHttpBackend
from war.backends.openai import OpenAICompatBackend
from war.types import GenRequest, SamplingParams, UnknownTrajectory

LOCAL = "127.0.0.1"
T_SHORT = 0.3  # a timeout a test expects to run out
T_FAIL = 0.15  # the timeout of calls expected to fail
T_CALL = 2.0  # a timeout a test expects never to run out
Run = Callable[..., Any]


# ---------------------------------------------------------------- event loops


@pytest.fixture(params=["asyncio", "uvloop"])
def arun(request: pytest.FixtureRequest) -> Run:
    """Runs a coroutine to the end (at most ``timeout_s``) on asyncio's own loop or
    on uvloop (``war.aio.run``)."""
    kind: str = request.param
    if kind == "uvloop":
        pytest.importorskip("uvloop")

    def runner(coro: Coroutine[Any, Any, Any], timeout_s: float = 5.0) -> Any:
        async def bounded() -> Any:
            loop = asyncio.get_running_loop()
            loop_module = type(loop).__module__
            assert loop_module.startswith("uvloop") == (kind == "uvloop"), loop_module
            errors: list[dict[str, Any]] = []  # what the loop would log as errors
            loop.set_exception_handler(lambda _, context: errors.append(context))
            result = await asyncio.wait_for(coro, timeout_s)
            await asyncio.sleep(0.01)  # callbacks of connections the call closed
            assert not errors, f"the event loop reported errors: {errors}"
            return result

        if kind == "uvloop":
            return war.aio.run(bounded())
        return asyncio.run(bounded())

    return runner


async def eventually(cond: Callable[[], bool], timeout_s: float = 2.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "the condition did not hold in time"
        await asyncio.sleep(0.005)


# ---------------------------------------------------------------- a raw HTTP server


@dataclass
class Req:
    """A request as the raw server read it (header names lower-cased)."""

    method: str
    target: str
    version: str
    headers: dict[str, str]
    body: bytes
    conn: int  # which accepted connection, from 0


class Peer:
    """One accepted connection, as a handler sees it."""

    def __init__(self, server: RawServer, sock: socket.socket, index: int) -> None:
        self.server = server
        self.sock = sock
        self.index = index
        self.buf = b""
        self.dropped = threading.Event()  # the client closed or reset its side
        self.closed = False
        sock.settimeout(3.0)

    def _recv(self) -> bytes:
        try:
            chunk = self.sock.recv(65536)
        except TimeoutError:
            raise
        except OSError:
            chunk = b""
        if not chunk:
            self.dropped.set()
        return chunk

    def read_request(self) -> Req | None:
        """The next request, or ``None`` when the client closed the connection."""
        while b"\r\n\r\n" not in self.buf:
            chunk = self._recv()
            if not chunk:
                return None
            self.buf += chunk
        head, _, rest = self.buf.partition(b"\r\n\r\n")
        request_line, *lines = head.decode("latin-1").split("\r\n")
        method, target, version = request_line.split(" ")
        headers: dict[str, str] = {}
        for line in lines:
            name, _, value = line.partition(":")
            assert name.lower() not in headers, f"header {name} sent twice"
            headers[name.lower()] = value.strip()
        length = int(headers.get("content-length", "0"))
        while len(rest) < length:
            chunk = self._recv()
            if not chunk:
                return None
            rest += chunk
        self.buf = rest[length:]
        req = Req(method, target, version, headers, rest[:length], self.index)
        with self.server.lock:
            self.server.requests.append(req)
        return req

    def wait_dropped(self, timeout_s: float = 3.0) -> bool:
        """Reads (and discards) until the client drops the connection."""
        deadline = time.monotonic() + timeout_s
        while not self.dropped.is_set() and time.monotonic() < deadline:
            try:
                self._recv()
            except TimeoutError:
                break
        return self.dropped.is_set()

    def send(self, data: bytes) -> None:
        with contextlib.suppress(OSError):
            self.sock.sendall(data)

    def dribble(self, data: bytes) -> None:
        """``data`` a byte at a time, each in its own segment."""
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for i in range(len(data)):
            self.send(data[i:i + 1])
            time.sleep(0.0005)

    def close(self) -> None:
        self.closed = True
        self.sock.close()

    def reset(self) -> None:
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.close()


Handler = Callable[[Peer], None]


class RawServer:
    """An HTTP server written by hand on a loopback port: each accepted connection
    runs ``handler(peer)`` in its own thread (closed when the handler returns).
    Counts the connections and records the requests read."""

    def __init__(self, handler: Handler, host: str = LOCAL) -> None:
        self.handler = handler
        self.host = host
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.listener = socket.socket(family, socket.SOCK_STREAM)
        self.listener.bind((host, 0))
        self.listener.listen(64)
        self.listener.settimeout(0.02)
        self.port: int = self.listener.getsockname()[1]
        self.lock = threading.Lock()
        self.peers: list[Peer] = []
        self.requests: list[Req] = []
        self.errors: list[BaseException] = []
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def accepted(self) -> int:
        return len(self.peers)

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                sock, _ = self.listener.accept()
            except (TimeoutError, OSError):
                continue
            with self.lock:
                peer = Peer(self, sock, len(self.peers))
                self.peers.append(peer)
            thread = threading.Thread(target=self._serve, args=(peer,), daemon=True)
            self._threads.append(thread)
            thread.start()

    def _serve(self, peer: Peer) -> None:
        try:
            self.handler(peer)
        except BaseException as e:
            if not self._stop.is_set():
                self.errors.append(e)
        finally:
            if not peer.closed:
                with contextlib.suppress(OSError):
                    peer.close()

    def __enter__(self) -> RawServer:
        thread = threading.Thread(target=self._accept_loop, daemon=True)
        self._threads.append(thread)
        thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for peer in list(self.peers):
            with contextlib.suppress(OSError):
                peer.sock.shutdown(socket.SHUT_RDWR)
        for thread in list(self._threads):
            thread.join(3)
        self.listener.close()
        if exc[0] is None and self.errors:
            raise self.errors[0]


def answer(body: bytes = b"ok", status: int = 200, reason: str = "OK",
           headers: Sequence[str] = ()) -> bytes:
    lines = [f"HTTP/1.1 {status} {reason}", f"Content-Length: {len(body)}", *headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def echo(req: Req) -> bytes:
    """What the server read, as JSON."""
    return answer(orjson.dumps({"method": req.method, "target": req.target,
                                "body": req.body.decode("latin-1"), "conn": req.conn,
                                "headers": req.headers}),
                  headers=["Content-Type: application/json"])


def keepalive(respond: Callable[[Req], bytes] = echo) -> Handler:
    """Answers every request on the connection until the client closes it."""
    def handler(peer: Peer) -> None:
        while (req := peer.read_request()) is not None:
            peer.send(respond(req))
    return handler


def per_connection(*handlers: Handler, then: Handler | None = None) -> Handler:
    """``handlers[i]`` serves the i-th accepted connection; later ones ``then``
    (default: keep-alive echo)."""
    rest = then or keepalive()

    def handler(peer: Peer) -> None:
        (handlers[peer.index] if peer.index < len(handlers) else rest)(peer)
    return handler


def gated(gate: threading.Event, respond: Callable[[Req], bytes] = echo) -> Handler:
    """Keep-alive, but every answer waits for ``gate``."""
    def handler(peer: Peer) -> None:
        while (req := peer.read_request()) is not None:
            gate.wait(3.0)
            peer.send(respond(req))
    return handler


def hang(peer: Peer) -> None:
    """Reads a request and never answers (until the client drops the connection)."""
    if peer.read_request() is not None:
        peer.wait_dropped()


def serve_then(n: int, then: Callable[[Peer], None]) -> Handler:
    """Answers ``n`` requests, reads one more and does ``then`` (e.g. closes)."""
    def handler(peer: Peer) -> None:
        for _ in range(n):
            req = peer.read_request()
            if req is None:
                return
            peer.send(echo(req))
        if peer.read_request() is not None:
            then(peer)
    return handler


async def get(pool: Pool, target: str = "/", timeout_s: float = T_CALL) -> Response:
    return await pool.request("GET", target, timeout_s=timeout_s, connect_timeout_s=1.0)


def body_of(response: Response) -> dict[str, Any]:
    data: dict[str, Any] = orjson.loads(response.body)
    return data


def free_port() -> int:
    with socket.socket() as s:
        s.bind((LOCAL, 0))
        port: int = s.getsockname()[1]
        return port


def ipv6_loopback() -> bool:
    if not socket.has_ipv6:
        return False
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError:
        return False
    return True


# ---------------------------------------------------------------- round trips


def test_get_and_post_round_trip(arun: Run) -> None:
    with RawServer(keepalive()) as server:
        async def go() -> None:
            pool = Pool(LOCAL, server.port)
            r = await get(pool, "/a/b?x=1&y=%20")
            assert (r.status, r.reason) == (200, "OK")
            assert body_of(r)["method"] == "GET" and body_of(r)["target"] == "/a/b?x=1&y=%20"
            r = await pool.request("POST", "/post", body=b'{"k": [1, 2]}',
                                   headers=(("Content-Type", "application/json"),
                                            ("X-Extra", "yes")),
                                   timeout_s=T_CALL, connect_timeout_s=1.0)
            assert r.status == 200 and body_of(r)["body"] == '{"k": [1, 2]}'
            r = await pool.request("POST", "/empty", body=b"", timeout_s=T_CALL,
                                   connect_timeout_s=1.0)
            assert r.status == 200 and body_of(r)["body"] == ""
            pool.close()

        arun(go())
        get_req, post, empty = server.requests
        assert get_req.version == "HTTP/1.1"
        assert get_req.headers == {"host": f"{LOCAL}:{server.port}",
                                   "accept": "application/json"}
        assert post.method == "POST" and post.body == b'{"k": [1, 2]}'
        assert post.headers["content-length"] == "13"
        assert post.headers["content-type"] == "application/json"
        assert post.headers["x-extra"] == "yes"
        assert empty.headers["content-length"] == "0" and empty.body == b""
        assert server.accepted == 1


def test_large_bodies_both_ways(arun: Run) -> None:
    big = bytes(range(256)) * 8192  # 2 MiB, beyond any socket or transport buffer
    with RawServer(keepalive(lambda req: answer(req.body[::-1]))) as server:
        async def go() -> None:
            pool = Pool(LOCAL, server.port)
            r = await pool.request("POST", "/big", body=big, timeout_s=T_CALL,
                                   connect_timeout_s=1.0)
            assert r.status == 200 and r.body == big[::-1]
            pool.close()

        arun(go())
        assert server.requests[0].body == big


def test_keepalive_reuses_one_connection(arun: Run) -> None:
    with RawServer(keepalive()) as server:
        async def go() -> None:
            pool = Pool(LOCAL, server.port)
            for i in range(50):
                r = await get(pool, f"/call/{i}")
                assert body_of(r)["target"] == f"/call/{i}" and body_of(r)["conn"] == 0
            pool.close()

        arun(go())
        assert server.accepted == 1 and len(server.requests) == 50


def test_concurrent_calls_wait_for_the_connection_limit(arun: Run) -> None:
    gate = threading.Event()
    with RawServer(gated(gate)) as server:
        async def go() -> None:
            pool = Pool(LOCAL, server.port, max_connections=3)
            calls = [asyncio.create_task(get(pool, f"/c/{i}")) for i in range(8)]
            await eventually(lambda: len(server.requests) == 3)
            await asyncio.sleep(0.1)  # the other five wait for a connection
            assert server.accepted == 3 and len(server.requests) == 3
            assert not any(c.done() for c in calls)
            gate.set()
            results = await asyncio.gather(*calls)
            assert [body_of(r)["target"] for r in results] == [f"/c/{i}" for i in range(8)]
            # more rounds, still on the same three connections
            results = await asyncio.gather(*(get(pool, f"/d/{i}") for i in range(12)))
            assert {body_of(r)["conn"] for r in results} <= {0, 1, 2}
            pool.close()

        arun(go())
        assert server.accepted == 3 and len(server.requests) == 20


def test_a_slot_handed_to_a_call_cancelled_before_it_ran_is_passed_on(arun: Run) -> None:
    async def go() -> None:
        pool = Pool(LOCAL, 9, max_connections=1)
        pool._free = 0  # the one slot is in use
        far = asyncio.get_running_loop().time() + 60
        handed = asyncio.create_task(pool._wait_for_slot(far))
        behind = asyncio.create_task(pool._wait_for_slot(far))
        await asyncio.sleep(0)
        pool._release_slot()  # the slot goes to the first waiter...
        handed.cancel()  # ... whose task is cancelled before it runs
        with pytest.raises(asyncio.CancelledError):
            await handed
        await behind  # the slot was passed on
        assert pool._free == 0 and not pool._slot_waiters
        pool._release_slot()
        assert pool._free == 1

    arun(go())


def test_concurrent_calls_open_connections_as_needed(arun: Run) -> None:
    gate = threading.Event()
    with RawServer(gated(gate)) as server:
        async def go() -> None:
            pool = Pool(LOCAL, server.port)
            calls = [asyncio.create_task(get(pool, f"/{i}")) for i in range(6)]
            await eventually(lambda: len(server.requests) == 6)
            gate.set()
            await asyncio.gather(*calls)
            pool.close()

        arun(go())
        assert server.accepted == 6


def test_max_connections_is_checked() -> None:
    with pytest.raises(ValueError, match="max_connections"):
        Pool(LOCAL, 80, max_connections=0)


# ---------------------------------------------------------------- body framing


@dataclass(frozen=True)
class Framing:
    raw: bytes
    body: bytes = b"hello world"
    status: int = 200
    reason: str = "OK"
    reusable: bool = True  # the connection serves the next call
    close_after: bool = False  # the server closes after sending
    dribble: bool = False  # the server sends a byte at a time


FRAMINGS = {
    "content-length": Framing(b"HTTP/1.1 200 OK\r\nContent-Length: 11\r\n\r\nhello world"),
    "content-length-lowercase": Framing(
        b"HTTP/1.1 201 Created\r\ncontent-length: 11\r\nx-a: b\r\n\r\nhello world",
        status=201, reason="Created"),
    "chunked": Framing(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
                       b"5\r\nhello\r\n6;ext=1\r\n world\r\n0\r\nX-Trailer: t\r\n\r\n"),
    "chunked-mixed-case": Framing(b"HTTP/1.1 200 OK\r\ntransfer-encoding: Chunked\r\n\r\n"
                                  b"b\r\nhello world\r\n0\r\n\r\n"),
    "chunked-dribbled": Framing(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
                                b"5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n", dribble=True),
    "content-length-dribbled": Framing(
        b"HTTP/1.1 200 OK\r\nContent-Length: 11\r\n\r\nhello world", dribble=True),
    "until-close": Framing(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\nhello world",
                           reusable=False, close_after=True),
    "until-close-http10": Framing(b"HTTP/1.0 200 OK\r\n\r\nhello world",
                                  reusable=False, close_after=True),
    "until-close-empty": Framing(b"HTTP/1.1 200 OK\r\n\r\n", body=b"", reusable=False,
                                 close_after=True),
    "http10-keep-alive": Framing(b"HTTP/1.0 200 OK\r\nContent-Length: 11\r\n"
                                 b"Connection: keep-alive\r\n\r\nhello world"),
    "http10-no-keep-alive": Framing(b"HTTP/1.0 200 OK\r\nContent-Length: 11\r\n\r\n"
                                    b"hello world", reusable=False),
    "connection-close": Framing(b"HTTP/1.1 200 OK\r\nContent-Length: 11\r\n"
                                b"Connection: close\r\n\r\nhello world", reusable=False),
    "connection-close-mixed-case": Framing(b"HTTP/1.1 200 OK\r\nContent-Length: 11\r\n"
                                           b"connection: Close\r\n\r\nhello world",
                                           reusable=False),
    "100-continue": Framing(b"HTTP/1.1 100 Continue\r\n\r\n"
                            b"HTTP/1.1 200 OK\r\nContent-Length: 11\r\n\r\nhello world"),
    "two-interim-answers": Framing(
        b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </x>\r\n\r\n"
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nb\r\nhello world\r\n0\r\n\r\n"),
    "100-continue-dribbled": Framing(
        b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 11\r\n\r\n"
        b"hello world", dribble=True),
    "204": Framing(b"HTTP/1.1 204 No Content\r\n\r\n", body=b"", status=204,
                   reason="No Content"),
    "304": Framing(b"HTTP/1.1 304 Not Modified\r\nETag: x\r\n\r\n", body=b"", status=304,
                   reason="Not Modified"),
    "empty-reason": Framing(b"HTTP/1.1 200 \r\nContent-Length: 11\r\n\r\nhello world",
                            reason=""),
    "error-status": Framing(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 4\r\n\r\n"
                            b"busy", body=b"busy", status=503, reason="Service Unavailable"),
}


@pytest.mark.parametrize("framing", FRAMINGS.values(), ids=list(FRAMINGS))
def test_body_framing(arun: Run, framing: Framing) -> None:
    def handler(peer: Peer) -> None:
        while peer.read_request() is not None:
            (peer.dribble if framing.dribble else peer.send)(framing.raw)
            if framing.close_after:
                return

    with RawServer(handler) as server:
        async def go() -> None:
            pool = Pool(LOCAL, server.port)
            for _ in range(2):
                r = await get(pool)
                assert (r.status, r.reason, r.body) == (framing.status, framing.reason,
                                                         framing.body)
            if not framing.reusable:  # the client closed the connection it did not keep
                await eventually(lambda: server.peers[0].dropped.is_set()
                                 or server.peers[0].closed)
            pool.close()

        arun(go())
        assert len(server.requests) == 2
        assert server.accepted == (1 if framing.reusable else 2)


def test_bytes_after_the_answer_mean_the_connection_is_not_reused(arun: Run) -> None:
    with RawServer(keepalive(lambda req: answer() + b"JUNK\r\n\r\n")) as server:
        async def go() -> None:
            pool = Pool(LOCAL, server.port)
            for _ in range(2):
                r = await get(pool)
                assert (r.status, r.body) == (200, b"ok")
            pool.close()

        arun(go())
        assert server.accepted == 2


# ---------------------------------------------------------------- stale connections


def _close(peer: Peer) -> None:
    peer.close()


def _reset(peer: Peer) -> None:
    peer.reset()


@pytest.mark.parametrize("how", [_close, _reset], ids=["close", "reset"])
def test_pooled_connection_closed_by_the_server_is_retried_once(arun: Run,
                                                                how: Handler) -> None:
    # The first connection answers one call, then the server closes it on reading the
    # next one (as a server that closed it while idle, crossing the request).
    with RawServer(per_connection(serve_then(1, how))) as server:
        async def go() -> None:
            pool = Pool(LOCAL, server.port)
            assert body_of(await get(pool, "/one"))["conn"] == 0
            r = await get(pool, "/two")
            assert body_of(r) | {"headers": None} == {
                "method": "GET", "target": "/two", "body": "", "conn": 1, "headers": None}
            assert body_of(await get(pool, "/three"))["conn"] == 1  # the new one is kept
            pool.close()

        arun(go())
        assert [(r.target, r.conn) for r in server.requests] == [
            ("/one", 0), ("/two", 0), ("/two", 1), ("/three", 1)]
        assert server.accepted == 2


def test_pooled_connection_closed_while_idle_is_not_used(arun: Run) -> None:
    with RawServer(per_connection(serve_then(1, _close))) as server:
        async def go() -> None:
            pool = Pool(LOCAL, server.port)
            await get(pool, "/one")
            # The server closes on EOF of the next read... which never comes; close it
            # from the client's view instead: the server side shuts down its writing.
            server.peers[0].sock.shutdown(socket.SHUT_WR)
            await eventually(lambda: not pool._idle or pool._idle[-1].closed)
            assert body_of(await get(pool, "/two"))["conn"] == 1
            pool.close()

        arun(go())
        assert [(r.target, r.conn) for r in server.requests] == [("/one", 0), ("/two", 1)]


def test_pooled_connection_whose_transport_is_closing_is_not_reused(arun: Run) -> None:
    # The server's FIN was read and the transport is closing, but its connection_lost
    # has not run yet when the next call takes the connection from the pool.
    with RawServer(keepalive()) as server:
        async def go() -> None:
            pool = Pool(LOCAL, server.port)
            await get(pool, "/one")
            conn = pool._idle[-1]
            assert conn.transport is not None and not conn.closed
            conn.transport.close()
            assert body_of(await get(pool, "/two"))["conn"] == 1
            pool.close()

        arun(go())
        assert [(r.target, r.conn) for r in server.requests] == [("/one", 0), ("/two", 1)]


def test_retry_happens_once(arun: Run) -> None:
    # Every connection after the first closes on reading a request: the retry fails too.
    with RawServer(per_connection(serve_then(1, _close), then=serve_then(0, _close))) \
            as server:
        async def go() -> None:
            pool = Pool(LOCAL, server.port)
            await get(pool, "/one")
            with pytest.raises(ConnectionClosed):
                await get(pool, "/two")
            pool.close()

        arun(go())
        assert [(r.target, r.conn) for r in server.requests] == [
            ("/one", 0), ("/two", 0), ("/two", 1)]
        assert server.accepted == 2


async def post(pool: Pool, target: str = "/", idempotent: bool | None = None) -> Response:
    return await pool.request("POST", target, body=b'{"n": 1}', timeout_s=T_CALL,
                              connect_timeout_s=1.0, idempotent=idempotent)


@pytest.mark.parametrize("how", [_close, _reset], ids=["close", "reset"])
def test_pooled_post_lost_after_it_was_written_is_not_sent_again(arun: Run,
                                                                 how: Handler) -> None:
    # The server read the POST (a generation, say) and then the connection went: it
    # may be running it, so a second copy must not go to it behind the caller's back.
    with RawServer(per_connection(serve_then(1, how))) as server:
        async def go() -> None:
            pool = Pool(LOCAL, server.port)
            assert body_of(await post(pool, "/one"))["conn"] == 0
            with pytest.raises(ConnectionClosed) as e:
                await post(pool, "/two")
            assert e.value.sent and e.value.before_answer
            assert not pool._idle
            # the pool goes on with a new connection
            assert body_of(await post(pool, "/three"))["conn"] == 1
            pool.close()

        arun(go())
        assert [(r.method, r.target, r.conn) for r in server.requests] == [
            ("POST", "/one", 0), ("POST", "/two", 0), ("POST", "/three", 1)]
        assert server.accepted == 2


def test_a_post_said_idempotent_is_sent_again_like_a_get(arun: Run) -> None:
    with RawServer(per_connection(serve_then(1, _close))) as server:
        async def go() -> None:
            pool = Pool(LOCAL, server.port)
            await post(pool, "/one")
            assert body_of(await post(pool, "/two", idempotent=True))["conn"] == 1
            # and a GET said not to be is not
            await post(pool, "/three")  # (conn 1 again)
            pool.close()

        arun(go())
        assert [(r.target, r.conn) for r in server.requests] == [
            ("/one", 0), ("/two", 0), ("/two", 1), ("/three", 1)]

    with RawServer(per_connection(serve_then(1, _close))) as server:
        async def go_get() -> None:
            pool = Pool(LOCAL, server.port)
            await get(pool, "/one")
            with pytest.raises(ConnectionClosed):
                await pool.request("GET", "/two", timeout_s=T_CALL, connect_timeout_s=1.0,
                                   idempotent=False)
            pool.close()

        arun(go_get())
        assert [(r.target, r.conn) for r in server.requests] == [("/one", 0), ("/two", 0)]


def test_pooled_post_whose_connection_was_closed_while_idle_goes_on_a_new_one(
        arun: Run) -> None:
    # The server closed the kept-alive connection before the call: found closed, it is
    # not written to, and the POST goes, once, on a new connection.
    with RawServer(per_connection(serve_then(1, _close))) as server:
        async def go() -> None:
            pool = Pool(LOCAL, server.port)
            await post(pool, "/one")
            server.peers[0].sock.shutdown(socket.SHUT_WR)  # (the server's FIN)
            await eventually(lambda: not pool._idle or pool._idle[-1].closed)
            assert body_of(await post(pool, "/two"))["conn"] == 1
            pool.close()

        arun(go())
        assert [(r.target, r.conn) for r in server.requests] == [("/one", 0), ("/two", 1)]


def test_a_post_on_a_closing_connection_is_not_written_and_goes_on_a_new_one(
        arun: Run) -> None:
    with RawServer(keepalive()) as server:
        async def go() -> None:
            pool = Pool(LOCAL, server.port)
            await post(pool, "/one")
            conn = pool._idle[-1]
            assert conn.transport is not None
            conn.transport.close()  # (closing: its connection_lost has not run yet)
            with pytest.raises(ConnectionClosed) as e:
                conn.send(b"POST /never HTTP/1.1\r\n\r\n")
            assert not e.value.sent and conn.closed
            assert body_of(await post(pool, "/two"))["conn"] == 1
            pool.close()

        arun(go())
        assert [(r.target, r.conn) for r in server.requests] == [("/one", 0), ("/two", 1)]


def test_a_generation_lost_after_it_was_sent_is_not_run_twice_on_the_replica(
        arun: Run) -> None:
    # Through WarHttpBackend: the replica read a completion request on a kept-alive
    # connection, then reset it. The caller (the router) is told, ReplicaUnavailable,
    # and may send it elsewhere; the replica got it once, not twice behind its back.
    completion = answer(orjson.dumps({
        "choices": [{"token_ids": [4], "finish_reason": "length"}],
        "usage": {"prompt_tokens": 1}}))

    def first(peer: Peer) -> None:  # answers one call, reads the next and resets
        if peer.read_request() is not None:
            peer.send(completion)
            if peer.read_request() is not None:
                peer.reset()

    with RawServer(per_connection(first, then=keepalive(lambda req: completion))) \
            as server:
        async def go() -> None:
            backend = WarHttpBackend("w", server.url, timeout_s=T_CALL)

            def request(rid: str) -> GenRequest:
                return GenRequest(request_id=rid, prompt_ids=(1,),
                                  sampling=SamplingParams(max_tokens=1, logprobs=False))

            assert (await backend.generate(request("g1"))).output_ids == (4,)
            with pytest.raises(ReplicaUnavailable, match="unreachable"):
                await backend.generate(request("g2"))
            assert (await backend.generate(request("g3"))).output_ids == (4,)
            await backend.close()

        arun(go())
        assert [(orjson.loads(r.body)["request_id"], r.conn) for r in server.requests] == [
            ("g1", 0), ("g2", 0), ("g3", 1)]


@pytest.mark.parametrize("use_metrics", [False, True], ids=["no-metrics", "metrics-404"])
def test_openai_load_reaches_a_server_without_metrics_and_fails_if_it_hangs(
        arun: Run, use_metrics: bool) -> None:
    # The router's health loop probes a healthy replica with load(): without /metrics
    # it asks /health, bounded by the health timeout, so that a hung server fails it.
    hung = threading.Event()

    def handler(peer: Peer) -> None:
        while (req := peer.read_request()) is not None:
            if hung.is_set():
                peer.wait_dropped()
                return
            if req.target == "/metrics":
                peer.send(answer(b"no", 404, "Not Found"))
            else:
                peer.send(answer(b'{"status": "ok"}'))

    with RawServer(handler) as server:
        async def go() -> None:
            backend = OpenAICompatBackend("v", server.url, "m", use_metrics=use_metrics,
                                          health_timeout_s=T_FAIL, timeout_s=30.0)
            await backend.load()  # /metrics (a 404, remembered), or /health
            await backend.load()  # /health
            hung.set()
            t0 = time.monotonic()
            with pytest.raises(ReplicaUnavailable, match="timed out"):
                await backend.load()
            assert time.monotonic() - t0 < 1.0  # its health timeout, not the 30 s one
            await backend.close()

        arun(go())
        first = "/metrics" if use_metrics else "/health"
        assert [r.target for r in server.requests] == [first, "/health", "/health"]


@pytest.mark.parametrize("partial", [
    b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc",
    b"HTTP/1.1 200 OK\r\nContent-Le",
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n",
    b"HTTP/1.1 100 Continue\r\n\r\n",
], ids=["short-body", "in-headers", "unfinished-chunks", "after-100-continue"])
def test_pooled_connection_closed_mid_answer_is_not_retried(arun: Run,
                                                            partial: bytes) -> None:
    # Part of the answer arrived: the server had the request, so sending it again
    # could run it twice.
    def then(peer: Peer) -> None:
        peer.send(partial)
        time.sleep(0.02)
        peer.close()

    with RawServer(per_connection(serve_then(1, then))) as server:
        async def go() -> None:
            pool = Pool(LOCAL, server.port)
            await get(pool, "/one")
            with pytest.raises(ConnectionClosed, match="before the answer was complete"):
                await get(pool, "/two")
            pool.close()

        arun(go())
        assert [(r.target, r.conn) for r in server.requests] == [("/one", 0), ("/two", 0)]
        assert server.accepted == 1


@pytest.mark.parametrize(("how", "word"), [(_close, "closed"), (_reset, "reset")],
                         ids=["close", "reset"])
def test_fresh_connection_closed_after_the_request_raises(arun: Run, how: Handler,
                                                          word: str) -> None:
    with RawServer(serve_then(0, how)) as server:
        async def go() -> None:
            pool = Pool(LOCAL, server.port)
            with pytest.raises(ConnectionClosed, match=word) as e:
                await get(pool, "/once")
            assert isinstance(e.value, TransportError)
            assert not pool._idle
            pool.close()

        arun(go())
        assert len(server.requests) == 1 and server.accepted == 1  # not retried


def test_fresh_connection_closed_mid_body_raises(arun: Run) -> None:
    def handler(peer: Peer) -> None:
        if peer.read_request() is not None:
            peer.send(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly this")

    with RawServer(handler) as server:
        async def go() -> None:
            pool = Pool(LOCAL, server.port)
            with pytest.raises(ConnectionClosed):
                await get(pool)
            pool.close()

        arun(go())
        assert server.accepted == 1


def test_idle_connections_expire_after_keepalive_s(arun: Run) -> None:
    with RawServer(keepalive()) as server:
        async def go() -> None:
            pool = Pool(LOCAL, server.port, keepalive_s=0.05)
            await get(pool)
            await get(pool)  # well within keepalive_s: reused
            await asyncio.sleep(0.1)
            assert body_of(await get(pool))["conn"] == 1
            await eventually(server.peers[0].dropped.is_set)  # the expired one was closed
            pool.close()

        arun(go())
        assert server.accepted == 2


# ---------------------------------------------------------------- timeouts


def test_server_that_never_answers_times_out_and_the_connection_is_dropped(arun: Run) -> None:
    with RawServer(per_connection(hang)) as server:
        async def go() -> None:
            pool = Pool(LOCAL, server.port)
            t0 = time.monotonic()
            with pytest.raises(TimeoutError):
                await get(pool, "/slow", timeout_s=T_SHORT)
            assert T_SHORT * 0.9 <= time.monotonic() - t0 < T_SHORT + 0.5
            assert not pool._idle
            await eventually(server.peers[0].dropped.is_set)
            assert body_of(await get(pool, "/next"))["conn"] == 1  # the pool still works
            pool.close()

        arun(go())
        assert server.accepted == 2


def test_calls_with_different_timeouts_each_time_out_at_their_own(arun: Run) -> None:
    # One watch serves every call of a pool: a shorter deadline that comes later must
    # still fire first, a longer one after it, and calls that answered leave nothing.
    with RawServer(per_connection(then=hang)) as server:
        async def go() -> None:
            pool = Pool(LOCAL, server.port)
            t0 = time.monotonic()
            long = asyncio.create_task(get(pool, "/long", timeout_s=T_SHORT * 3))
            await asyncio.sleep(0.02)
            with pytest.raises(TimeoutError):
                await get(pool, "/short", timeout_s=T_SHORT)
            short_s = time.monotonic() - t0
            assert T_SHORT * 0.9 <= short_s < T_SHORT + 0.25
            assert not long.done()
            with pytest.raises(TimeoutError):
                await long
            assert T_SHORT * 3 * 0.9 <= time.monotonic() - t0 < T_SHORT * 3 + 0.5
            assert not pool._deadlines
            pool.close()

        arun(go())
    with RawServer(keepalive()) as server:
        async def many() -> None:
            pool = Pool(LOCAL, server.port)
            for i in range(50):
                assert body_of(await get(pool, f"/{i}", timeout_s=T_CALL + i))["conn"] == 0
            assert not pool._deadlines
            pool.close()
            assert pool._watch is None  # nothing in flight: the watch went with the pool

        arun(many())


def test_waiting_for_a_connection_counts_in_the_timeout(arun: Run) -> None:
    # With one connection: a waiting call that times out and one cancelled while
    # waiting leave the slot to the calls behind them, first come first served.
    gate = threading.Event()
    with RawServer(gated(gate)) as server:
        async def go() -> None:
            pool = Pool(LOCAL, server.port, max_connections=1)
            first = asyncio.create_task(get(pool, "/first"))
            await eventually(lambda: len(server.requests) == 1)
            t0 = time.monotonic()
            with pytest.raises(TimeoutError):
                await get(pool, "/second", timeout_s=0.2)
            assert time.monotonic() - t0 < 0.7
            cancelled = asyncio.create_task(get(pool, "/cancelled"))
            third = asyncio.create_task(get(pool, "/third"))
            fourth = asyncio.create_task(get(pool, "/fourth"))
            await asyncio.sleep(0.05)
            assert len(pool._slot_waiters) == 3
            cancelled.cancel()
            gate.set()
            results = await asyncio.gather(first, third, fourth)
            assert [body_of(r)["target"] for r in results] == ["/first", "/third", "/fourth"]
            assert {body_of(r)["conn"] for r in results} == {0}  # the slot came back
            with pytest.raises(asyncio.CancelledError):
                await cancelled
            assert pool._free == 1 and not pool._slot_waiters
            pool.close()

        arun(go())
        assert [r.target for r in server.requests] == ["/first", "/third", "/fourth"]
        assert server.accepted == 1


def test_cancelled_call_drops_its_connection_and_frees_its_slot(arun: Run) -> None:
    with RawServer(per_connection(hang)) as server:
        async def go() -> None:
            pool = Pool(LOCAL, server.port, max_connections=1)
            call = asyncio.create_task(get(pool, "/slow"))
            await eventually(lambda: len(server.requests) == 1)
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call
            await eventually(server.peers[0].dropped.is_set)
            assert body_of(await get(pool, "/next"))["conn"] == 1
            pool.close()

        arun(go())


def test_connection_refused_raises_oserror_quickly(arun: Run) -> None:
    port = free_port()

    async def go() -> None:
        pool = Pool(LOCAL, port)
        t0 = time.monotonic()
        with pytest.raises(ConnectionRefusedError):
            await pool.request("GET", "/", timeout_s=5.0, connect_timeout_s=5.0)
        assert time.monotonic() - t0 < 1.0

    arun(go())


@contextlib.contextmanager
def unanswered_port() -> Iterator[int]:
    """A loopback port whose listener never accepts, with its backlog full: a SYN to it
    goes unanswered (where the system allows that; the caller skips otherwise)."""
    listener = socket.socket()
    listener.bind((LOCAL, 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    fillers = []
    try:
        for _ in range(4):
            s = socket.socket()
            s.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                s.connect((LOCAL, port))
            fillers.append(s)
        time.sleep(0.02)
        yield port
    finally:
        for s in fillers:
            s.close()
        listener.close()


def test_connect_timeout(arun: Run) -> None:
    with unanswered_port() as port:
        async def go() -> None:
            pool = Pool(LOCAL, port)
            t0 = time.monotonic()
            try:
                await pool.request("GET", "/", timeout_s=5.0, connect_timeout_s=T_SHORT)
            except TimeoutError:
                assert T_SHORT * 0.9 <= time.monotonic() - t0 < T_SHORT + 0.5
                return
            pytest.skip("this system accepted a connection past a full backlog")

        arun(go())


# ---------------------------------------------------------------- broken answers


INVALID = {
    "not-http": b"SSH-2.0-OpenSSH_9.6\r\n\r\n",
    "bad-status": b"HTTP/1.1 2x0 OK\r\nContent-Length: 0\r\n\r\n",
    "bad-content-length": b"HTTP/1.1 200 OK\r\nContent-Length: abc\r\n\r\n",
    "bad-chunk-size": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nhello\r\n",
    "bad-header-line": b"HTTP/1.1 200 OK\r\nno colon here\r\nContent-Length: 0\r\n\r\n",
    "upgrade": b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n"
               b"Connection: Upgrade\r\n\r\n\x81\x00",
}


@pytest.mark.parametrize("raw", INVALID.values(), ids=list(INVALID))
def test_invalid_http_answer_raises_transport_error(arun: Run, raw: bytes) -> None:
    def bad_then_good(peer: Peer) -> None:
        if peer.read_request() is not None:
            peer.send(raw)
            peer.wait_dropped()

    with RawServer(per_connection(bad_then_good)) as server:
        async def go() -> None:
            pool = Pool(LOCAL, server.port)
            with pytest.raises(TransportError, match="invalid HTTP") as e:
                await get(pool)
            assert not isinstance(e.value, ConnectionClosed)
            await eventually(server.peers[0].dropped.is_set)
            assert body_of(await get(pool))["conn"] == 1
            pool.close()

        arun(go())
        assert len(server.requests) == 2


# ---------------------------------------------------------------- the pool's close


def test_closed_pool_closes_idle_connections_and_refuses_calls(arun: Run) -> None:
    with RawServer(keepalive()) as server:
        async def go() -> None:
            pool = Pool(LOCAL, server.port)
            await asyncio.gather(*(get(pool) for _ in range(3)))
            assert len(pool._idle) == 3
            pool.close()
            await eventually(lambda: all(p.dropped.is_set() for p in server.peers))
            with pytest.raises(TransportError, match="closed"):
                await get(pool)
            pool.close()  # again: nothing happens

        arun(go())
        assert server.accepted == 3 and len(server.requests) == 3


def test_closed_pool_closes_a_busy_connection_when_its_call_ends(arun: Run) -> None:
    gate = threading.Event()
    with RawServer(gated(gate)) as server:
        async def go() -> None:
            pool = Pool(LOCAL, server.port)
            call = asyncio.create_task(get(pool, "/busy"))
            await eventually(lambda: len(server.requests) == 1)
            pool.close()
            gate.set()
            assert body_of(await call)["target"] == "/busy"  # the call in flight ends well
            assert not pool._idle
            await eventually(server.peers[0].dropped.is_set)  # and its connection closes

        arun(go())


# ---------------------------------------------------------------- the Host header


@pytest.mark.parametrize(("host", "port", "tls", "authority"), [
    ("127.0.0.1", 80, False, "127.0.0.1"),
    ("127.0.0.1", 8000, False, "127.0.0.1:8000"),
    ("replica-7.internal", 443, False, "replica-7.internal:443"),
    ("replica-7.internal", 443, True, "replica-7.internal"),
    ("replica-7.internal", 80, True, "replica-7.internal:80"),
    ("::1", 80, False, "[::1]"),
    ("::1", 8000, False, "[::1]:8000"),
    ("fe80::1%eth0", 9000, False, "[fe80::1%eth0]:9000"),
])
def test_host_header(host: str, port: int, tls: bool, authority: str) -> None:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT) if tls else None
    pool = Pool(host, port, tls=context)
    assert pool.authority == authority
    assert pool._encode("POST", "/p?q=1", b"hi", (("X-A", "b"),)) == (
        f"POST /p?q=1 HTTP/1.1\r\nHost: {authority}\r\nAccept: application/json\r\n"
        f"X-A: b\r\nContent-Length: 2\r\n\r\nhi").encode()
    assert pool._encode("GET", "/", None, ()) == (
        f"GET / HTTP/1.1\r\nHost: {authority}\r\nAccept: application/json\r\n\r\n").encode()


@pytest.mark.skipif(not ipv6_loopback(), reason="no IPv6 loopback here")
def test_ipv6_loopback(arun: Run) -> None:
    with RawServer(keepalive(), host="::1") as server:
        async def go() -> None:
            pool = Pool("::1", server.port)
            assert (await get(pool, "/v6")).status == 200
            pool.close()
            channel = HttpChannel(server.url, None, T_CALL, 1.0, 1.0, 4, None)
            assert channel.url("/x") == f"http://[::1]:{server.port}/x"
            answer_ = await channel.send("GET", "/v1/load", "v6")
            assert answer_.status_code == 200 and answer_.json()["target"] == "/v1/load"
            await channel.close()

        arun(go())
        assert [r.headers["host"] for r in server.requests] == [f"[::1]:{server.port}"] * 2


# ---------------------------------------------------------------- HttpChannel


def channel_for(url: str, api_key: str | None = None, timeout_s: float = T_CALL,
                max_connections: int = 4) -> HttpChannel:
    return HttpChannel(url, api_key, timeout_s, T_SHORT, T_SHORT, max_connections, None)


def _invalid(peer: Peer) -> None:
    if peer.read_request() is not None:
        peer.send(b"garbage\r\n\r\n")


FAILURES: dict[str, tuple[Handler | None, str, type[BaseException]]] = {
    "hangs": (hang, "timed out", TimeoutError),
    "refused": (None, "unreachable", ConnectionRefusedError),
    "invalid-http": (_invalid, "unreachable", TransportError),
    "closes": (serve_then(0, _close), "unreachable", ConnectionClosed),
    "resets": (serve_then(0, _reset), "unreachable", ConnectionClosed),
}


@pytest.mark.parametrize(("handler", "kind", "cause"), FAILURES.values(), ids=list(FAILURES))
def test_channel_maps_transport_failures_to_replica_unavailable(
        arun: Run, handler: Handler | None, kind: str, cause: type[BaseException]) -> None:
    with contextlib.ExitStack() as stack:
        if handler is None:
            url = f"http://{LOCAL}:{free_port()}"
        else:
            url = stack.enter_context(RawServer(handler)).url

        async def go() -> None:
            channel = HttpChannel(url, None, T_FAIL, T_FAIL, T_FAIL, 4, None)
            t0 = time.monotonic()
            with pytest.raises(ReplicaUnavailable, match=f"r0: /v1/load {kind}: ") as e:
                await channel.send("GET", "/v1/load", "r0")
            assert isinstance(e.value.__cause__, cause)
            with pytest.raises(ReplicaUnavailable, match=kind):
                await channel.post_json("/v1/completions", {"a": 1}, "r0")
            assert not await channel.health("/health")
            backend = WarHttpBackend("r1", url, timeout_s=T_FAIL, connect_timeout_s=T_FAIL,
                                     health_timeout_s=T_FAIL)
            with pytest.raises(ReplicaUnavailable, match=f"r1: /v1/load {kind}"):
                await backend.load()
            assert not await backend.health()
            assert time.monotonic() - t0 < 5 * T_FAIL + 0.5  # each call bounded
            await channel.close()
            await backend.close()

        arun(go())


def test_channel_maps_a_closed_pool_to_unreachable(arun: Run) -> None:
    with RawServer(keepalive()) as server:
        async def go() -> None:
            channel = channel_for(server.url)
            assert (await channel.send("GET", "/health", "r")).status_code == 200
            channel._h1().close()  # the pool alone, under the channel
            with pytest.raises(ReplicaUnavailable, match=r"r: /health unreachable: .*closed") \
                    as e:
                await channel.send("GET", "/health", "r")
            assert isinstance(e.value.__cause__, TransportError)
            await channel.close()
            with pytest.raises(ReplicaUnavailable, match="unreachable: the backend is closed"):
                await channel.send("GET", "/health", "r")
            assert not await channel.health("/health")

        arun(go())
        assert len(server.requests) == 1


def test_channel_close_closes_its_connections(arun: Run) -> None:
    with RawServer(keepalive()) as server:
        async def go() -> None:
            backend = WarHttpBackend("r", server.url, timeout_s=T_CALL)
            assert await backend.health()
            await backend.close()
            await eventually(server.peers[0].dropped.is_set)

        arun(go())


def test_channel_sends_to_the_path_prefix(arun: Run) -> None:
    load = {"num_running": 1, "num_waiting": 2, "tokens_in_flight": 3, "kv_blocks_used": 4,
            "kv_blocks_total": 5, "block_size": 16}
    with RawServer(keepalive(lambda req: answer(orjson.dumps(load)))) as server:
        async def go() -> None:
            backend = WarHttpBackend("r", f"{server.url}/prefix/v2/", timeout_s=T_CALL)
            assert backend.base_url == f"{server.url}/prefix/v2"
            assert (await backend.load()).kv_blocks_total == 5
            assert await backend.health()
            await backend.observe_rl_step(3)
            await backend.close()

        arun(go())
        assert [(r.method, r.target) for r in server.requests] == [
            ("GET", "/prefix/v2/v1/load"), ("GET", "/prefix/v2/health"),
            ("POST", "/prefix/v2/v1/rl_step")]
        assert orjson.loads(server.requests[2].body) == {"rl_step": 3}
        assert {r.headers["host"] for r in server.requests} == {f"{LOCAL}:{server.port}"}
        assert server.accepted == 1


@pytest.mark.parametrize("api_key", ["sekret-key", None])
def test_channel_headers_and_bearer_auth(arun: Run, api_key: str | None) -> None:
    with RawServer(keepalive(lambda req: answer(b"{}"))) as server:
        async def go() -> None:
            channel = channel_for(server.url, api_key=api_key)
            assert await channel.get_json("/v1/load", "r") == {}
            assert await channel.post_json("/v1/history", {"items": [1]}, "r") == {}
            assert await channel.health("/health")
            await channel.close()

        arun(go())
        get_req, post, health = server.requests
        expected = {"host": f"{LOCAL}:{server.port}", "accept": "application/json"}
        if api_key is not None:
            expected["authorization"] = f"Bearer {api_key}"
        assert get_req.headers == expected and health.headers == expected
        assert post.headers == expected | {"content-type": "application/json",
                                           "content-length": str(len(post.body))}
        assert orjson.loads(post.body) == {"items": [1]}


def test_channel_maps_error_answers_over_h1(arun: Run) -> None:
    answers = {
        "/500": answer(b"boom", 500, "Internal Server Error"),
        "/400": answer(b'{"detail": "bad field"}', 400, "Bad Request"),
        "/409": answer(b'{"error": {"message": "who?", "code": "unknown_trajectory"}}', 409,
                       "Conflict"),
        "/not-json": answer(b"<html>", 200),
    }
    with RawServer(keepalive(lambda req: answers[req.target])) as server:
        async def go() -> None:
            channel = channel_for(server.url)
            with pytest.raises(ReplicaUnavailable, match=r"r: GET /500 failed \(500\): boom"):
                await channel.get_json("/500", "r")
            with pytest.raises(ValueError, match=r"refused \(400\): bad field"):
                await channel.get_json("/400", "r")
            with pytest.raises(UnknownTrajectory, match="who"):
                await channel.post_json("/409", {}, "r")
            with pytest.raises(ReplicaUnavailable, match="invalid JSON"):
                await channel.get_json("/not-json", "r")
            # a POST's answers take the same mapping (post_json reads a 200 itself)
            with pytest.raises(ReplicaUnavailable, match=r"r: POST /500 failed \(500\): boom"):
                await channel.post_json("/500", {}, "r")
            with pytest.raises(ValueError, match=r"r: POST /400 refused \(400\): bad field"):
                await channel.post_json("/400", {}, "r")
            with pytest.raises(ReplicaUnavailable, match="r: /not-json answered with invalid JSON"):
                await channel.post_json("/not-json", {}, "r")
            unchecked = await channel.get_unchecked("/500", "r")
            assert (unchecked.status_code, unchecked.reason, unchecked.text) == (
                500, "Internal Server Error", "boom")
            await channel.close()

            with pytest.raises(ReplicaUnavailable, match="the backend is closed"):
                await channel.post_json("/400", {}, "r")

        arun(go())
        assert server.accepted == 1  # error answers keep the connection


def test_channel_used_from_two_event_loops() -> None:
    pytest.importorskip("uvloop")
    with RawServer(keepalive()) as server:
        channel = channel_for(server.url)
        pools: list[Pool] = []

        async def call() -> int:
            answer_ = await channel.send("GET", "/x", "r")
            assert channel._pool is not None
            pools.append(channel._pool)
            channel._pool.close()  # (else its socket outlives its loop until collected)
            conn: int = answer_.json()["conn"]
            return conn

        assert asyncio.run(call()) == 0
        assert war.aio.run(call()) == 1  # a new pool in the new loop
        assert war.aio.run(call()) == 2
        assert asyncio.run(call()) == 3
        assert len({id(p) for p in pools}) == 4
        asyncio.run(channel.close())
        assert server.accepted == 4


# ---------------------------------------------------------------- against uvicorn


def uvicorn_app() -> FastAPI:
    app = FastAPI()

    @app.get("/health")
    async def health() -> dict[str, bool]:
        return {"ok": True}

    @app.get("/v1/load")
    async def load() -> dict[str, int]:
        return {"num_running": 0, "num_waiting": 0, "tokens_in_flight": 0,
                "kv_blocks_used": 1, "kv_blocks_total": 64, "block_size": 8}

    @app.post("/v1/completions")
    async def completions(request: Request) -> dict[str, Any]:
        body = await request.json()
        prompt = body["prompt"]
        ids = prompt[::-1][:body["max_tokens"]]
        # logprobs when asked for, as war serve answers them
        logprobs = {"token_logprobs": [-0.5] * len(ids)} if body.get("logprobs") else None
        return {"choices": [{"token_ids": ids, "logprobs": logprobs,
                             "finish_reason": "length"}],
                "usage": {"prompt_tokens": len(prompt)},
                "auth": request.headers.get("authorization")}

    @app.post("/v1/history")
    async def history() -> dict[str, str]:
        return {}

    @app.get("/stream")
    async def stream() -> StreamingResponse:
        async def parts() -> AsyncIterator[bytes]:
            for i in range(5):
                yield f"part {i};".encode()
                await asyncio.sleep(0)
        return StreamingResponse(parts(), media_type="text/plain")

    @app.post("/echo")
    async def echo_(request: Request) -> dict[str, Any]:
        return {"n": len(await request.body()), "host": request.headers["host"],
                "path": request.url.path}

    return app


@pytest.fixture(scope="module")
def uvicorn_url() -> Iterator[str]:
    with serve(uvicorn_app()) as (url, _):
        yield url


def test_uvicorn_round_trip(arun: Run, uvicorn_url: str) -> None:
    port = int(uvicorn_url.rsplit(":", 1)[1])

    async def go() -> None:
        pool = Pool(LOCAL, port, max_connections=4)
        r = await get(pool, "/health")
        assert (r.status, r.reason, orjson.loads(r.body)) == (200, "OK", {"ok": True})
        r = await get(pool, "/stream")  # chunked
        assert r.body == b"".join(f"part {i};".encode() for i in range(5))
        r = await get(pool, "/nowhere")
        assert (r.status, r.reason) == (404, "Not Found")
        big = b"x" * 300_000
        r = await pool.request("POST", "/echo", body=big, timeout_s=T_CALL,
                               connect_timeout_s=1.0)
        assert orjson.loads(r.body) == {"n": len(big), "host": f"{LOCAL}:{port}",
                                        "path": "/echo"}
        results = await asyncio.gather(*(get(pool, "/health") for _ in range(20)))
        assert all(r.status == 200 for r in results)
        assert len(pool._idle) <= 4
        pool.close()

    arun(go())


def test_war_http_backend_against_uvicorn(arun: Run, uvicorn_url: str) -> None:
    async def go() -> None:
        backend = WarHttpBackend("uv", uvicorn_url, api_key="k1", timeout_s=T_CALL)
        assert await backend.health()
        requests = [GenRequest(request_id=f"r{i}", prompt_ids=(5, 6, 7 + i),
                               sampling=SamplingParams(max_tokens=2)) for i in range(8)]
        results = await asyncio.gather(*(backend.generate(r) for r in requests))
        for i, result in enumerate(results):
            assert result.request_id == f"r{i}"
            assert result.output_ids == (7 + i, 6)
            assert result.finish_reason == "length" and result.num_prompt_tokens == 3
        load = await backend.load()
        assert (load.kv_blocks_used, load.kv_blocks_total, load.block_size) == (1, 64, 8)
        await backend.add_history([((1, 2), "g")])
        data = await backend._http.post_json("/v1/completions",
                                             {"prompt": [1], "max_tokens": 1}, "uv")
        assert data["auth"] == "Bearer k1"
        await backend.close()

    arun(go())


# ---------------------------------------------------------------- unasked answers, size


def _answer_then(extra: bytes, delay_s: float) -> Handler:
    """Answers the first request, then sends ``extra`` (after ``delay_s``) as if it
    were another answer; later requests get echoes."""
    def handler(peer: Peer) -> None:
        req = peer.read_request()
        if req is None:
            return
        if delay_s:
            peer.send(answer(b"one"))
            time.sleep(delay_s)
            peer.send(extra)
        else:
            peer.send(answer(b"one") + extra)
        keepalive(lambda req: answer(b"two"))(peer)
    return handler


UNASKED = {
    # the start of an answer in the same segment: the next call's answer would be
    # read as its body
    "partial-in-the-same-segment": (b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nst", 0.0),
    "partial-while-idle": (b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nst", 0.05),
    "whole-while-idle": (answer(b"stale"), 0.05),
}


@pytest.mark.parametrize(("extra", "delay_s"), UNASKED.values(), ids=list(UNASKED))
def test_an_answer_no_call_asked_for_means_the_connection_is_not_reused(
        arun: Run, extra: bytes, delay_s: float) -> None:
    with RawServer(per_connection(_answer_then(extra, delay_s),
                                  then=keepalive(lambda req: answer(b"two")))) as server:
        async def go() -> None:
            pool = Pool(LOCAL, server.port)
            assert (await get(pool)).body == b"one"
            await asyncio.sleep(delay_s + 0.1)
            assert (await get(pool)).body == b"two"
            pool.close()

        arun(go())
        assert server.accepted == 2


def _endless(head: bytes, piece: bytes) -> Handler:
    """Answers with ``head`` and then ``piece`` again and again (a bounded number of
    times), until the client drops the connection."""
    def handler(peer: Peer) -> None:
        if peer.read_request() is None:
            return
        peer.send(head)
        for _ in range(2000):
            if peer.dropped.is_set():
                return
            try:
                peer.sock.sendall(piece)
            except OSError:
                return
    return handler


HUGE = {
    "content-length": _endless(b"HTTP/1.1 200 OK\r\nContent-Length: 100000000\r\n\r\n",
                               b"x" * 1024),
    "chunked": _endless(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n",
                        b"400\r\n" + b"x" * 1024 + b"\r\n"),
    "until-close": _endless(b"HTTP/1.1 200 OK\r\n\r\n", b"x" * 1024),
    "headers": _endless(b"HTTP/1.1 200 OK\r\n", b"X-Pad: " + b"y" * 1000 + b"\r\n"),
}


@pytest.mark.parametrize("handler", HUGE.values(), ids=list(HUGE))
def test_an_answer_over_max_response_bytes_fails_and_drops_the_connection(
        arun: Run, handler: Handler) -> None:
    with RawServer(per_connection(handler)) as server:
        async def go() -> None:
            pool = Pool(LOCAL, server.port, max_response_bytes=64 * 1024)
            with pytest.raises(TransportError, match="larger than 65536 bytes"):
                await get(pool)
            await eventually(lambda: server.peers[0].dropped.is_set()
                             or server.peers[0].closed)
            # an answer within the limit, on a new connection
            assert body_of(await get(pool))["conn"] == 1
            pool.close()

        arun(go())


def test_max_response_bytes_is_checked() -> None:
    with pytest.raises(ValueError, match="max_response_bytes"):
        Pool(LOCAL, 80, max_response_bytes=0)


def test_channel_with_a_client_bounds_the_whole_call(arun: Run) -> None:
    """httpx's own timeouts bound each read: a server that sends a byte now and then
    would never run out of them."""
    def trickle(peer: Peer) -> None:
        if peer.read_request() is None:
            return
        peer.send(b"HTTP/1.1 200 OK\r\nContent-Length: 40\r\n\r\n")
        for _ in range(40):
            if peer.dropped.is_set():
                return
            peer.send(b"x")
            time.sleep(0.05)

    with RawServer(trickle) as server:
        async def go() -> None:
            async with httpx.AsyncClient() as client:
                channel = HttpChannel(server.url, None, T_SHORT, T_SHORT, T_SHORT, 4, client)
                t0 = time.monotonic()
                with pytest.raises(ReplicaUnavailable, match="timed out"):
                    await channel.get_json("/v1/load", "r")
                assert time.monotonic() - t0 < 1.2

        arun(go())


def test_channel_percent_encodes_the_path_prefix(arun: Run) -> None:
    with RawServer(keepalive()) as server:
        async def go() -> None:
            channel = channel_for(f"{server.url}/my models/ü/")
            assert (await channel.get_json("/v1/load", "r"))["target"] == \
                "/my%20models/%C3%BC/v1/load"
            await channel.close()

        arun(go())
