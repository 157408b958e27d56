"""The event loop WAR's processes run on.

Knows: that ``uvloop`` (libuv under asyncio's API) runs an HTTP server or client
several times faster per call than asyncio's own loop, and falls back to asyncio
where it is not installed (it is a dependency on Linux and macOS only); and how a
long-running server keeps the cyclic garbage collector off its hot path
(``settle_heap``). Does not know what runs on the loop.
"""

from __future__ import annotations

import asyncio
import gc
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


# Allocations between young-generation collections (CPython's default: 700). A router
# allocates a few hundred container objects per request, so the default collects
# every few requests and rescans what they keep (prompts as token lists, tree nodes).
GC_YOUNG_THRESHOLD = 20_000


def settle_heap() -> None:
    """For a server about to serve: moves every object alive now (modules, the app) out
    of the collector's reach (``gc.freeze``) and collects young objects less often.
    Cyclic garbage made later is still collected, in larger batches. Measured on
    ``war route``: about 6% less CPU per routed request."""
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(GC_YOUNG_THRESHOLD, older, oldest)


__all__ = ["GC_YOUNG_THRESHOLD", "loop_factory", "run", "settle_heap"]
