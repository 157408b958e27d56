"""The event loop WAR's processes run on.

Knows: that ``uvloop`` (libuv under asyncio's API) runs an HTTP server or client
several times faster per call than asyncio's own loop, and falls back to asyncio
where it is not installed (it is a dependency on Linux and macOS only). Does not
know what runs on the loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """``uvloop.new_event_loop`` when uvloop is installed, else ``None`` (asyncio's)."""
    try:
        import uvloop
    except ImportError:
        return None
    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return factory


def run(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(main)`` on the fastest loop available."""
    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        return runner.run(main)


__all__ = ["loop_factory", "run"]
