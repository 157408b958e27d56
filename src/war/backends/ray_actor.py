"""A replica hosted by a Ray actor, on any node of a Ray cluster.

Knows: ``EngineActor``, the actor class (an ``Engine`` loaded from a Hugging Face
folder, driven by an ``AsyncEngine`` inside the actor; its methods are coroutines,
so Ray runs it as an async actor and concurrent ``generate`` calls share the
engine's batches); how the actor reports refusals (tagged answers, not raised
exceptions, so ``UnknownTrajectory`` and ``ValueError`` arrive as themselves);
``RayEngineBackend``, which calls an actor handle and maps Ray's failures (actor
death, ``RayActorError``, unreachable node, unexpected task errors, timeouts) to
``ReplicaUnavailable``; ``start_ray_replica``, which creates an actor and its
backend. A cancelled ``generate`` cancels the actor task, which aborts the
request in the engine.

Does not know cluster setup: ``ray.init()`` (or a connection to a cluster) is the
caller's, and the model folder and the ``war`` package must be present on the
node the actor lands on. Ray is imported lazily (``pip install
'war-rollout[ray]'``), so the rest of WAR works without it. The actor is created
with Ray's defaults (no restarts): a dead actor stays dead and the backend keeps
raising ``ReplicaUnavailable``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from war.backends.base import ReplicaUnavailable
from war.engine.async_engine import AsyncEngine, EngineClosedError, EngineLike, EngineStepError
from war.engine.config import EngineConfig
from war.types import GenRequest, GenResult, ReplicaLoad, UnknownTrajectory

RAY_MISSING = ("Ray is not installed; install the extra: pip install 'war-rollout[ray]' "
               "(or pip install ray)")

_OK = "ok"
_UNKNOWN_TRAJECTORY = "unknown_trajectory"
_REFUSED = "refused"
_UNAVAILABLE = "unavailable"
_actor_class: Any = None  # ray.remote(EngineActor), made once


def import_ray() -> Any:
    """The ``ray`` module; ``ImportError`` with install advice when it is missing."""
    try:
        import ray
        import ray.exceptions
    except ImportError as e:
        raise ImportError(RAY_MISSING) from e
    return ray


class EngineActor:
    """Hosts one replica inside a Ray worker (wrap with ``ray.remote``; see
    ``start_ray_replica``). Answers are ``(tag, value)``: ``("ok", result)`` or
    ``(tag, message)`` with tag ``unknown_trajectory``, ``refused`` or
    ``unavailable``."""

    def __init__(self, model_dir: str, engine_config: EngineConfig | None = None) -> None:
        from war.engine.engine import Engine

        self._engine = AsyncEngine(Engine.from_pretrained(model_dir, engine_config))
        self._engine.start()

    async def generate(self, request: GenRequest) -> tuple[str, GenResult | str]:
        try:
            return _OK, await self._engine.generate(request)
        except UnknownTrajectory as e:
            return _UNKNOWN_TRAJECTORY, str(e)
        except ValueError as e:
            return _REFUSED, str(e)
        except (EngineClosedError, EngineStepError) as e:
            return _UNAVAILABLE, str(e)

    async def load(self) -> tuple[str, ReplicaLoad | str]:
        if not self._engine.is_running:
            return _UNAVAILABLE, "the engine thread is not running"
        return _OK, self._engine.load()

    async def health(self) -> bool:
        return self._engine.is_running

    async def add_history(self, items: list[tuple[list[int], str | None]]) -> tuple[str, str]:
        def add_all(engine: EngineLike) -> None:
            for ids, group in items:
                engine.add_history(ids, group)

        try:
            await self._engine.call(add_all)
        except EngineClosedError as e:
            return _UNAVAILABLE, str(e)
        except ValueError as e:
            return _REFUSED, str(e)
        return _OK, ""

    async def finish_trajectory(self, trajectory_id: str) -> tuple[str, bool | str]:
        try:
            return _OK, await self._engine.finish_trajectory(trajectory_id)
        except EngineClosedError as e:
            return _UNAVAILABLE, str(e)

    async def close(self) -> None:
        await self._engine.close()


def _unwrap(name: str, answer: tuple[str, Any]) -> Any:
    tag, value = answer
    if tag == _OK:
        return value
    if tag == _UNKNOWN_TRAJECTORY:
        raise UnknownTrajectory(str(value))
    if tag == _REFUSED:
        raise ValueError(f"{name}: {value}")
    raise ReplicaUnavailable(f"{name}: {value}")


class RayEngineBackend:
    """A backend calling an ``EngineActor`` handle.

    ``timeout_s`` bounds each call (``None``: no bound; a timed-out ``generate``
    is cancelled on the actor); ``health()``, ``load()`` (probes) and
    ``finish_trajectory()`` wait at most ``health_timeout_s``.
    With ``owns_actor`` (as ``start_ray_replica`` sets it), ``close()`` closes the
    engine and kills the actor.
    """

    def __init__(self, name: str, actor_handle: Any, *, owns_actor: bool = False,
                 timeout_s: float | None = None, health_timeout_s: float = 5.0) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"a backend name must be a non-empty string, got {name!r}")
        if timeout_s is not None and not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0 or None, got {timeout_s!r}")
        if not health_timeout_s > 0:
            raise ValueError(f"health_timeout_s must be > 0, got {health_timeout_s!r}")
        self._ray = import_ray()
        self.name = name
        self.actor = actor_handle
        self.owns_actor = owns_actor
        self.timeout_s = timeout_s
        self.health_timeout_s = health_timeout_s

    def __repr__(self) -> str:
        return f"RayEngineBackend({self.name!r})"

    async def _call(self, method: str, *args: object, timeout_s: float | None) -> Any:
        ray = self._ray
        try:
            ref = getattr(self.actor, method).remote(*args)
        except ray.exceptions.RayError as e:
            raise ReplicaUnavailable(f"{self.name}: {method} not sent: {e}") from e
        try:
            if timeout_s is None:
                return await ref
            return await asyncio.wait_for(ref, timeout_s)
        except asyncio.CancelledError:
            self._cancel(ref)  # aborts the request in the actor's engine
            raise
        except TimeoutError as e:  # asyncio's timeout and Ray's GetTimeoutError
            self._cancel(ref)
            raise ReplicaUnavailable(f"{self.name}: {method} timed out") from e
        except ray.exceptions.RayError as e:  # the actor died, its node left, a bug in it
            raise ReplicaUnavailable(
                f"{self.name}: {method} failed: {type(e).__name__}: {e}") from e

    def _cancel(self, ref: Any) -> None:
        with contextlib.suppress(Exception):
            self._ray.cancel(ref)

    async def generate(self, request: GenRequest) -> GenResult:
        answer = await self._call("generate", request, timeout_s=self.timeout_s)
        result: GenResult = _unwrap(self.name, answer)
        return result

    async def load(self) -> ReplicaLoad:
        # (a probe, like ``health()``: a hung actor fails it within the probe's time)
        answer = await self._call("load", timeout_s=self.health_timeout_s)
        load: ReplicaLoad = _unwrap(self.name, answer)
        return load

    async def health(self) -> bool:
        try:
            return bool(await self._call("health", timeout_s=self.health_timeout_s))
        except Exception:  # health() never raises
            return False

    async def wait_ready(self, timeout_s: float = 120.0) -> None:
        """Waits until the actor has loaded its model and answers; raises
        ``ReplicaUnavailable`` (with Ray's reason, e.g. a bad model folder) if not."""
        healthy = await self._call("health", timeout_s=timeout_s)
        if not healthy:
            raise ReplicaUnavailable(f"{self.name}: the actor's engine is not running")

    async def add_history(self, items: Sequence[tuple[Sequence[int], str | None]]) -> None:
        batch = [([int(t) for t in ids], group) for ids, group in items if len(ids) > 0]
        if batch:
            answer = await self._call("add_history", batch, timeout_s=self.timeout_s)
            _unwrap(self.name, answer)

    async def finish_trajectory(self, trajectory_id: str) -> bool:
        """The trajectory ended: the actor's engine frees KV it holds for it."""
        answer = await self._call("finish_trajectory", trajectory_id,
                                  timeout_s=self.health_timeout_s)
        return bool(_unwrap(self.name, answer))

    async def close(self) -> None:
        if not self.owns_actor:
            return
        with contextlib.suppress(Exception):
            await self._call("close", timeout_s=self.health_timeout_s)
        with contextlib.suppress(Exception):
            self._ray.kill(self.actor)


def start_ray_replica(
    model_dir: str | Path,
    engine_config: EngineConfig | None = None,
    name: str = "replica",
    num_cpus: float = 1,
    *,
    num_gpus: float = 0,
    actor_options: Mapping[str, Any] | None = None,
    timeout_s: float | None = None,
) -> RayEngineBackend:
    """Creates an ``EngineActor`` serving ``model_dir`` (a Hugging Face folder, at
    this path on the node the actor lands on) and returns its backend, which owns
    it. Ray must be initialized. The actor loads the model in the background:
    ``await backend.wait_ready()`` to wait for it (calls made before wait too).
    ``actor_options`` go to ``.options()`` (e.g. ``scheduling_strategy``,
    ``resources``, ``runtime_env``)."""
    ray = import_ray()
    if not ray.is_initialized():
        raise RuntimeError("Ray is not initialized: call ray.init() (or connect to a "
                           "cluster) before start_ray_replica")
    if not isinstance(name, str) or not name:
        raise ValueError(f"a replica name must be a non-empty string, got {name!r}")
    if not num_cpus >= 0 or not num_gpus >= 0:
        raise ValueError(f"num_cpus and num_gpus must be >= 0, got {num_cpus}, {num_gpus}")
    path = Path(model_dir).expanduser()
    folder = str(path if path.is_absolute() else path.absolute())
    global _actor_class
    if _actor_class is None:
        _actor_class = ray.remote(EngineActor)
    options: dict[str, Any] = {"num_cpus": num_cpus, "num_gpus": num_gpus}
    options.update(actor_options or {})
    handle = _actor_class.options(**options).remote(folder, engine_config)
    return RayEngineBackend(name, handle, owns_actor=True, timeout_s=timeout_s)
