"""Test helper: an ASGI app served by uvicorn on a free 127.0.0.1 port, in a thread."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import uvicorn


@contextlib.contextmanager
def serve(app: Any, lifespan: str = "off", start_s: float = 10.0
          ) -> Iterator[tuple[str, uvicorn.Server]]:
    """``app`` on a free 127.0.0.1 port, in a background thread; yields its URL and
    the server (set ``server.should_exit`` to stop it early). ``lifespan``: uvicorn's
    setting (``"auto"`` for an app that starts work on start-up); ``start_s``: how
    long it may take to start (and to stop)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan=lifespan,
                                           access_log=False))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + start_s
        while not server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            assert thread.is_alive(), "uvicorn stopped"
            time.sleep(0.01)
        yield f"http://127.0.0.1:{port}", server
    finally:
        server.should_exit = True
        thread.join(start_s)
        sock.close()
