"""The ASGI side of ``war.router.edge``: one request to the app, and its lifespan.

Knows: the ASGI 3 HTTP scope of a request, how the app's ``receive`` gets the whole
body and then waits for the client to hang up, how its ``send`` messages become
HTTP/1.1 bytes (a body of unknown length is chunked; HEAD answers carry no body), what
an app that fails or answers nothing gets (500), and the lifespan protocol (startup
failures raise). Does not know sockets or parsing: the connection passes in how to
write, whether it is closed, and how to wait for the client to go.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any, cast
from urllib.parse import unquote

from starlette.types import ASGIApp, Message

from war.router.edge_wire import LAST_CHUNK, chunk, error_json, head, json_response

log = logging.getLogger("war.router.edge")


class Exchange:
    """One request answered by ``app``. ``write`` sends bytes to the client,
    ``closed()`` tells whether it is gone, ``gone()`` waits until it is."""

    def __init__(self, app: ASGIApp, scope: dict[str, Any], body: bytes, keep_alive: bool,
                 write: Callable[[bytes], None], closed: Callable[[], bool],
                 gone: Callable[[], Awaitable[None]]) -> None:
        self.app = app
        self.scope = scope
        self.body = body
        self.keep_alive = keep_alive
        self.write = write
        self.closed = closed
        self.gone = gone
        self.head_only = scope["method"] == "HEAD"
        self._body_sent = False
        self._started = False
        self._done = False
        self._chunked = False
        self._start: tuple[int, list[tuple[bytes, bytes]]] | None = None  # not written yet

    async def run(self) -> bool:
        """Answers the request; returns whether the connection may be kept (not after
        an app that failed or left its answer unfinished)."""
        try:
            await self.app(self.scope, self.receive, self.send)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("the app failed on %s %s", self.scope["method"], self.scope["path"])
            if not self._started:
                self.write(json_response(500, error_json(500, "internal server error"), False))
            return False
        if not self._done:  # the app returned without finishing its answer
            if not self._started:
                self.write(json_response(500, error_json(500, "the app sent no response"),
                                         False))
            return False
        return True

    async def receive(self) -> Message:
        if not self._body_sent:
            self._body_sent = True
            return {"type": "http.request", "body": self.body, "more_body": False}
        if not self.closed():
            await self.gone()
        return {"type": "http.disconnect"}

    async def send(self, message: Message) -> None:
        if self.closed() or self._done:
            return
        kind = message["type"]
        if kind == "http.response.start":
            assert not self._started, "the app started its response twice"
            self._started = True
            headers = [(bytes(k).lower(), bytes(v)) for k, v in message.get("headers", [])]
            self._start = (int(message["status"]), headers)
            return
        if kind != "http.response.body":
            return
        assert self._started, "the app sent a body before starting its response"
        body = bytes(message.get("body", b""))
        more = bool(message.get("more_body", False))
        if self._start is not None:
            status, headers = self._start
            self._start = None
            if not any(k == b"content-length" for k, _ in headers):
                if more:
                    self._chunked = True
                    headers.append((b"transfer-encoding", b"chunked"))
                else:
                    headers.append((b"content-length", str(len(body)).encode()))
            start = head(status, headers, self.keep_alive)
            self.write(start if self.head_only else start + self._frame(body))
        elif not self.head_only:
            self.write(self._frame(body))
        if not more:
            self._done = True
            if self._chunked and not self.head_only:
                self.write(LAST_CHUNK)

    def _frame(self, body: bytes) -> bytes:
        return chunk(body) if self._chunked else body


def http_scope(method: bytes, raw_path: bytes, query: bytes, headers: list[tuple[bytes, bytes]],
               http_version: str, server: tuple[str, int] | None,
               client: tuple[str, int] | None, state: dict[str, Any]) -> dict[str, Any]:
    """The ASGI HTTP scope of a request (``state``: a copy of the lifespan's)."""
    return {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": http_version, "scheme": "http", "method": method.decode("latin-1"),
        "path": unquote(raw_path.decode("latin-1")), "raw_path": raw_path,
        "query_string": query, "root_path": "", "headers": headers, "server": server,
        "client": client, "state": dict(state),
    }


class Lifespan:
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
        except asyncio.CancelledError:
            for fut in (self._started, self._stopped):
                fut.cancel()  # (no-op when done)
            raise
        except Exception as e:
            # the phase under way fails: startup (awaited by ``startup``), else shutdown
            fut = self._started if not self._started.done() else self._stopped
            if not fut.done():
                fut.set_exception(RuntimeError(f"the app's lifespan failed: {e!r}"))
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


__all__ = ["Exchange", "Lifespan", "http_scope"]
