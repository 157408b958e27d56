"""A replica in this process: an ``AsyncEngine`` called directly.

Knows: how the backend calls map onto ``AsyncEngine`` and which of its errors mean
"this replica is unusable" (``EngineClosedError``, ``EngineStepError``: mapped to
``ReplicaUnavailable``) and which mean "this request is refused" (``ValueError``,
including ``UnknownTrajectory``: passed on). Does not know HTTP or routing, and
does not own the engine unless told to (``owns_engine``: ``close()`` closes it).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

from war.backends.base import ReplicaUnavailable
from war.engine.async_engine import AsyncEngine, EngineClosedError, EngineLike, EngineStepError
from war.types import GenRequest, GenResult, ReplicaLoad


class InProcessBackend:
    """``async_engine`` as a backend. Its thread is started here (if it is not
    running yet and not closed)."""

    def __init__(self, name: str, async_engine: AsyncEngine, *, owns_engine: bool = False
                 ) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"a backend name must be a non-empty string, got {name!r}")
        self.name = name
        self.async_engine = async_engine
        self.owns_engine = owns_engine
        with contextlib.suppress(EngineClosedError):  # then every call is unavailable
            async_engine.start()

    def __repr__(self) -> str:
        return f"InProcessBackend({self.name!r})"

    def _started(self) -> AsyncEngine:
        try:
            self.async_engine.start()  # idempotent
        except EngineClosedError as e:
            raise ReplicaUnavailable(f"{self.name}: {e}") from e
        return self.async_engine

    async def generate(self, request: GenRequest) -> GenResult:
        engine = self._started()
        try:
            return await engine.generate(request)
        except (EngineClosedError, EngineStepError) as e:
            raise ReplicaUnavailable(f"{self.name}: {e}") from e

    async def load(self) -> ReplicaLoad:
        engine = self._started()
        if not engine.is_running:
            raise ReplicaUnavailable(f"{self.name}: the engine thread is not running")
        return engine.load()

    async def health(self) -> bool:
        return self.async_engine.is_running

    async def finish_trajectory(self, trajectory_id: str) -> bool:
        """The trajectory ended: the engine frees KV it holds for it."""
        try:
            return await self._started().call(
                lambda engine: engine.finish_trajectory(trajectory_id))
        except EngineClosedError as e:
            raise ReplicaUnavailable(f"{self.name}: {e}") from e

    async def add_history(self, items: Sequence[tuple[Sequence[int], str | None]]) -> None:
        batch = [(list(ids), group) for ids, group in items if len(ids) > 0]
        if not batch:
            return

        def add_all(engine: EngineLike) -> None:
            for ids, group in batch:
                engine.add_history(ids, group)

        try:
            await self._started().call(add_all)
        except EngineClosedError as e:
            raise ReplicaUnavailable(f"{self.name}: {e}") from e

    async def observe_rl_step(self, rl_step: int) -> None:
        """RL step ``rl_step`` began: the engine's draft history window slides
        (``ValueError`` if it went back)."""
        try:
            await self._started().observe_rl_step(rl_step)
        except EngineClosedError as e:
            raise ReplicaUnavailable(f"{self.name}: {e}") from e

    async def close(self) -> None:
        if self.owns_engine:
            await self.async_engine.close()
