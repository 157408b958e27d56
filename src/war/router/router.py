"""The router: places each request on a replica, survives replica failures.

Knows: the replicas (backends) and their health, what it has sent to each and not
yet seen completed, the routing policy (asked with ``now`` from an injected
clock), each trajectory's context (so a turn that sends only its new tokens can be
re-sent whole to another replica), retries, shared draft history (a completed
response is forwarded to the other replicas' speculators) and the RL step (told to
every replica that takes it, and to one that rejoins later). Does not know how a
replica computes, nor which policy is best.

Failures: a replica that raises ``ReplicaUnavailable`` (refused, lost, timed out,
crashed) is marked down, the policy forgets it, and the request is sent again to
another replica with the same request id, with the trajectory's whole context;
its trajectory goes on. A turn that sends only its new tokens goes so only to the
replica that served its trajectory's last turn (the router's record, not the
policy's): any other is sent the whole context. A background task checks down
replicas' health (all replicas at once, each within a bound) and lets them rejoin.
Requests fail only when no replica is left or retries run out.

A replica that fails a health check (its probe raised ``ReplicaUnavailable`` or ran past
``health_timeout_s``; for one already down, its ``health()`` said no) is marked down and
its requests in flight are cancelled there and sent again elsewhere at once
(``RouterConfig.failover_in_flight``), rather than each waiting for the generation
timeout of a replica that hangs: the router cancels the task awaiting the call (the
backend drops its connection), books the attempt as failed (the policy's
``on_complete`` with no result, a retry counted) and re-sends the request with the same
id, whole for a continuing turn, as after any failure. A cancellation of the caller's
own (a client hanging up) still ends the request; a late answer of the hung replica has
no one left to reach.

A replica whose health check answers but whose generations never complete (its engine
loop wedged behind a live HTTP front) is found by ``RouterConfig.stall_timeout_s``: one
that has had requests in flight continuously for that long, none of them completing
(an answer, or an error answer) meanwhile, is marked down in the health loop's round as
if it had failed its check (its requests in flight failed over likewise), and counted
in ``RouterStats.replicas_stalled``. Such a replica's health check passes at once, so it
rejoins only when that check passes at least ``health_interval_s`` (the router's clock)
after it was marked down and nothing of the router's is in flight there any more (the
stalled calls were cancelled, or ended on their own with ``failover_in_flight`` off).
The router's clock tells time in flight; the check runs each round of the health loop,
so a stall is found within ``stall_timeout_s`` plus a round.

A replica that refuses the router's credentials (HTTP 401 or 403: the router was given
no key for it, or the wrong one, or the replica was started with another key) is a
configuration error, not a failure: it is not marked down (its health probe may well
pass), but flagged ``auth_refused`` and left out of placement while the flag is set,
and the request is sent again to a replica that has not refused (a retry, booked as
after any failure: the policy's ``on_complete`` without a result, the whole context
for a continuing turn). Only when every replica left (not down) has refused does a
request fail, with ``ReplicaAuthRefused`` naming them. The flag (and the exclusion)
ends when a call to the replica succeeds: a served request, or a load poll of the
health loop that succeeds after the replica's previous poll was refused (so a poll
that does not carry the key's proof, such as vLLM's open ``/metrics``, cannot bring it
back on every round only for the next request to be refused). A flagged replica whose
load poll is not refused gets one request as a trial every ``auth_retry_s`` (refused
again: the request goes elsewhere). Each refusal is counted; the first of an episode
(until the flag ends) is logged at ERROR. Refusals of load polls, forwarded history and
finished trajectories set the flag the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from war.backends.base import Backend, CredentialsRefused, ReplicaUnavailable
from war.router.policies.base import ReplicaView, RoutingPolicy
from war.types import GenRequest, GenResult, ReplicaLoad, UnknownTrajectory

log = logging.getLogger(__name__)


class NoReplicaAvailable(RuntimeError):
    """Every replica is down (or the retries ran out)."""


_KEY_HINT = ("the router must send the replicas' key (war route --replica-api-key or "
             "WAR_REPLICA_API_KEY)")


class ReplicaAuthRefused(RuntimeError):
    """A replica refused the router's credentials (HTTP 401 or 403): the key the router
    sends it (``war route --replica-api-key``) is missing or wrong. The router sends the
    request to another replica; a request fails with it only when every replica left
    has refused (``every``: one error naming them all).

    ``replica``: its name; ``status``: 401 or 403; ``call``: the refused call
    (``POST /v1/completions``); ``detail``: the replica's own message (truncated);
    ``refusals``: this one and, for an ``every`` error, the other replicas' (``replicas``:
    their names). The key itself is never part of it."""

    def __init__(self, replica: str, status: int, call: str, detail: str = "") -> None:
        self.replica = replica
        self.status = status
        self.call = call
        self.detail = detail
        self.refusals: tuple[ReplicaAuthRefused, ...] = (self,)
        super().__init__(
            f"replica {replica} refused the router's API key ({self._what()}); {_KEY_HINT}")

    def _what(self) -> str:
        said = f": {self.detail}" if self.detail else ""
        return f"{self.status} on {self.call}{said}"

    @property
    def replicas(self) -> tuple[str, ...]:
        return tuple(r.replica for r in self.refusals)

    @classmethod
    def every(cls, refusals: Sequence[ReplicaAuthRefused]) -> ReplicaAuthRefused:
        """One error for several replicas' refusals (at least one; the same one back
        for a single): "replicas r0, r1 refused the router's API key (r0: 401 on ...;
        r1: ...)"."""
        if not refusals:
            raise ValueError("every() needs at least one refusal")
        if len(refusals) == 1:
            return refusals[0]
        first = refusals[0]
        err = cls(first.replica, first.status, first.call, first.detail)
        err.refusals = tuple(refusals)
        names = ", ".join(r.replica for r in refusals)
        each = "; ".join(f"{r.replica}: {r._what()}" for r in refusals)
        err.args = (f"replicas {names} refused the router's API key ({each}); {_KEY_HINT}",)
        return err


_DETAIL_CHARS = 200


def auth_refusal(exc: BaseException, backend_name: str, replica: str | None = None
                 ) -> ReplicaAuthRefused | None:
    """``exc`` as a ``ReplicaAuthRefused`` when it says that the backend named
    ``backend_name`` (the replica the router calls ``replica``, by default the same)
    refused the router's credentials: the backend's ``CredentialsRefused`` (a 401 or
    403 answer), or a ``ReplicaAuthRefused`` raised by the backend itself. None for
    anything else."""
    if isinstance(exc, ReplicaAuthRefused):
        return exc
    if not isinstance(exc, CredentialsRefused) or exc.name != backend_name:
        return None
    detail = exc.detail.strip()
    if len(detail) > _DETAIL_CHARS:
        detail = detail[:_DETAIL_CHARS] + "..."
    return ReplicaAuthRefused(replica or backend_name, exc.status, exc.call, detail)


@dataclass(frozen=True)
class RouterConfig:
    """Settings of the router; validated on construction.

    * ``max_attempts``: replicas tried for one request before it fails.
    * ``health_interval_s``: how often down replicas are checked (and loads polled).
    * ``health_timeout_s``: how long one replica's check in a round (its health, then
      its load) may take; past it the replica is marked down (replicas are checked
      concurrently, so one that never answers holds up no other). Above the HTTP
      backends' own probe timeout (2 s), so that theirs, more precise, comes first.
    * ``auth_retry_s``: a replica that refused the router's credentials, whose load poll
      is not refused (so cannot show when it accepts them again: vLLM's and SGLang's
      ``/metrics`` need no key), is offered one request as a trial this long after its
      last refusal (refused again: the request goes to another replica). One whose poll
      is refused rejoins at its first accepted poll instead.
    * ``failover_in_flight``: when a replica fails a health check, cancel its requests
      in flight and send them to other replicas at once (a replica that hangs would
      otherwise hold each for its whole generation timeout). A replica marked down by
      one request's own failure (a 5xx, a lost connection) keeps its other requests
      until the health loop's next check of it fails too. False: requests in flight
      finish or fail on their own.
    * ``stall_timeout_s``: a replica that has had at least one request in flight
      continuously for this long (the router's clock), with none completing there
      meanwhile (a result or an error answer), is marked down as if it had failed its
      health check: its requests in flight are failed over (``failover_in_flight``). It
      rejoins when its health check passes at least ``health_interval_s`` after that
      and nothing of the router's is in flight there any more. Checked each round of
      the health loop. None (the default): off, a replica whose health check passes
      keeps its requests however long they take.
    * ``share_history``: forward completed responses to the other replicas.
    * ``history_lead_in``: prompt tokens forwarded before each response, as a
      replica's own history entries carry them (``SpecConfig.lead_in``), so a
      forwarded entry drafts as it would on the replica that produced it.
    * ``history_flush_s``, ``history_batch``: forwarded responses are gathered per
      replica and sent together, at most ``history_flush_s`` after the first of a
      batch or as soon as ``history_batch`` wait (one request per batch, not per
      response); ``history_flush_s = 0`` sends each response at once.
    * ``max_trajectories``: trajectory contexts kept (least recently used dropped).
    * ``max_context_tokens``: tokens of trajectory contexts kept, all together (least
      recently used dropped past it): the router holds a context so that a turn that
      sends only its new tokens can go whole to another replica when its own fails;
      an agent's context runs to tens of thousands of tokens, so a count of
      trajectories alone does not bound the memory (about 36 bytes a token). A turn
      whose context was dropped still goes to its replica; only if that replica
      fails (or the policy places the turn on another) does its client get
      ``UnknownTrajectory`` (409 over HTTP) and resend the whole context. Finished
      trajectories (``finish_trajectory``) free theirs at once, and none is held for
      turns routed with ``hold=False`` (``route``).
    """

    max_attempts: int = 4
    health_interval_s: float = 1.0
    health_timeout_s: float = 5.0
    share_history: bool = True
    history_flush_s: float = 0.05
    history_batch: int = 64
    history_lead_in: int = 8
    max_trajectories: int = 100_000
    max_context_tokens: int = 32_000_000
    failover_in_flight: bool = True
    auth_retry_s: float = 30.0
    stall_timeout_s: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.failover_in_flight, bool):
            raise ValueError(f"failover_in_flight must be a bool, got "
                             f"{self.failover_in_flight!r}")
        for name in ("max_attempts", "history_batch", "history_lead_in", "max_trajectories",
                     "max_context_tokens"):
            value = getattr(self, name)
            # (a NaN passes every comparison below: unbounded tables, or a crash later)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name} must be an int, got {value!r}")
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts}")
        if not 0 < self.health_interval_s < math.inf:  # (inf: down replicas never re-checked)
            raise ValueError(f"health_interval_s must be a finite number > 0, got "
                             f"{self.health_interval_s}")
        if not 0 < self.auth_retry_s < math.inf:
            raise ValueError(f"auth_retry_s must be a finite number > 0, got "
                             f"{self.auth_retry_s}")
        if not 0 < self.health_timeout_s < math.inf:
            raise ValueError(f"health_timeout_s must be a finite number > 0, got "
                             f"{self.health_timeout_s}")
        stall = self.stall_timeout_s
        if stall is not None and (isinstance(stall, bool) or not isinstance(stall, int | float)
                                  or not 0 < stall < math.inf):  # (NaN fails the comparison)
            raise ValueError(f"stall_timeout_s must be None or a finite number > 0, got "
                             f"{stall!r}")
        if self.max_trajectories < 1:
            raise ValueError(f"max_trajectories must be >= 1, got {self.max_trajectories}")
        if self.max_context_tokens < 0:
            raise ValueError(f"max_context_tokens must be >= 0, got {self.max_context_tokens}")
        if not 0 <= self.history_flush_s < math.inf:  # (inf: a partial batch never sent)
            raise ValueError(f"history_flush_s must be a finite number >= 0, got "
                             f"{self.history_flush_s}")
        if self.history_lead_in < 0:
            raise ValueError(f"history_lead_in must be >= 0, got {self.history_lead_in}")
        if self.history_batch < 1:
            raise ValueError(f"history_batch must be >= 1, got {self.history_batch}")


class _Replica:
    """A replica as the router keeps it: its backend, health, what this router has in
    flight there, and its last load report (with the parts of a ``ReplicaView`` the
    report gives, worked out once per report rather than once per request)."""

    __slots__ = ("_load", "aborted", "auth_refused", "auth_trial_at", "backend", "calls",
                 "failures", "healthy", "last_refusal", "load_view", "num_requests",
                 "poll_refused", "progress_at", "served", "stalled_at", "takes_priority",
                 "tokens_in_flight")

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        # whether requests should carry the policy's priority to it (``Backend``)
        self.takes_priority: bool = getattr(backend, "takes_priority", True)
        self.healthy = True
        self.num_requests = 0
        self.tokens_in_flight = 0
        self.served = 0
        self.failures = 0
        # it refused the router's credentials (401/403) and has not accepted them since
        # (a served request, or an accepted load poll after a refused one): left out of
        # placement meanwhile, though not down; its last refusal, whether its last load
        # poll was refused, and (the router's clock) when it may have a trial request
        self.auth_refused = False
        self.last_refusal: ReplicaAuthRefused | None = None
        self.poll_refused = False
        self.auth_trial_at = 0.0
        self.load = None
        # (the router's clock, kept with ``stall_timeout_s`` only) the later of when its
        # requests in flight went from none to one and when one last completed there;
        # when it was marked down for a stall (None: it was not, or it has rejoined)
        self.progress_at = 0.0
        self.stalled_at: float | None = None
        # the tasks awaiting a call to it, each with its ``cancelling()`` count when the
        # call began; those the router cancelled (``Router._abort_in_flight``) move to
        # ``aborted`` until they see it
        self.calls: dict[asyncio.Task[Any], int] = {}
        self.aborted: dict[asyncio.Task[Any], int] = {}

    @property
    def load(self) -> ReplicaLoad | None:
        return self._load

    @load.setter
    def load(self, load: ReplicaLoad | None) -> None:
        self._load = load
        # ReplicaView's kv_free_tokens, kv_total_tokens, num_waiting; capacity unknown
        # when not reported (0 blocks)
        known = load is not None and load.kv_blocks_total > 0
        self.load_view: tuple[int | None, int | None, int] = (
            load.kv_free_tokens if load is not None and known else None,
            load.kv_blocks_total * load.block_size if load is not None and known else None,
            load.num_waiting if load is not None else 0)


@dataclass
class RouterStats:
    requests: int = 0
    completed: int = 0
    failed: int = 0
    retries: int = 0
    migrations: int = 0
    resent_contexts: int = 0  # continuing turns sent with the whole context (per send)
    contexts_dropped: int = 0  # held contexts dropped for the bounds (not finished ones)
    trajectories_released: int = 0  # ended trajectories reported to their replica
    replicas_marked_down: int = 0
    history_forwarded: int = 0
    auth_refusals: int = 0  # calls replicas refused for the router's credentials (401/403)
    # requests in flight cancelled on a replica that failed a health check (each then
    # sent again elsewhere, counted in ``retries``, or failed)
    in_flight_aborted: int = 0
    # times a replica was marked down for a stall (``stall_timeout_s``; each also counted
    # in ``replicas_marked_down``)
    replicas_stalled: int = 0
    per_replica: dict[str, int] = field(default_factory=dict)


class Router:
    """Routes ``GenRequest``s over backends with a policy. ``start()`` begins health
    checks; ``close()`` stops them and closes the backends."""

    def __init__(
        self,
        backends: Mapping[str, Backend] | Sequence[Backend],
        policy: RoutingPolicy,
        config: RouterConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        items = (list(backends.items()) if isinstance(backends, Mapping)
                 else [(b.name, b) for b in backends])
        if not items:
            raise ValueError("a router needs at least one backend")
        if len({name for name, _ in items}) != len(items):
            raise ValueError("backend names must be distinct")
        self.replicas: dict[str, _Replica] = {name: _Replica(b) for name, b in items}
        self.policy = policy
        self.config = config if config is not None else RouterConfig()
        self._clock = clock
        self.stats = RouterStats(per_replica=dict.fromkeys(self.replicas, 0))
        # trajectory -> its last turn's whole prompt and output (the context a next turn
        # extends; kept as the request's and result's own tuples, joined only when a
        # continuing turn needs it whole)
        self._contexts: OrderedDict[str, tuple[tuple[int, ...], tuple[int, ...]]] = (
            OrderedDict())
        self._context_tokens = 0  # tokens of every held context
        # trajectory -> the replica that served its last turn (it may hold its KV)
        self._homes: OrderedDict[str, str] = OrderedDict()
        self._health_task: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[None]] = set()
        # the last RL step the router was told (``observe_rl_step``; None: none yet)
        self._rl_step: int | None = None
        # history waiting to be forwarded, per replica, and whether a flush is due
        self._pending: dict[str, list[tuple[Sequence[int], str | None]]] = {}
        self._flush_due: set[str] = set()
        # names of the replicas flagged ``auth_refused`` (left out of placement)
        self._refusing: set[str] = set()

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        if self._health_task is None:
            self._health_task = asyncio.create_task(self._health_loop())

    async def close(self, close_backends: bool = True) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._health_task
            self._health_task = None
        tasks = list(self._background)
        for task in tasks:
            task.cancel()
        if tasks:  # (awaited: none may still run when the backends close)
            await asyncio.gather(*tasks, return_exceptions=True)
        if close_backends:
            for r in self.replicas.values():
                with contextlib.suppress(Exception):
                    await r.backend.close()

    async def __aenter__(self) -> Router:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ------------------------------------------------------------ routing

    def views(self) -> list[ReplicaView]:
        # positional: name, healthy, requests, tokens, then KV free, KV total, queue
        return [ReplicaView(name, r.healthy, r.num_requests, r.tokens_in_flight, *r.load_view)
                for name, r in self.replicas.items()]

    def _placeable(self, views: list[ReplicaView]) -> list[ReplicaView]:
        """``views`` less the replicas that refused the router's credentials, but for one
        whose trial is due (its load poll is not refused, so cannot show it accepting
        the key again, and ``auth_retry_s`` have passed since its last refusal or
        trial)."""
        now = self._clock()
        replicas = self.replicas
        out = []
        for v in views:
            r = replicas[v.name]
            if not r.auth_refused or (not r.poll_refused and now >= r.auth_trial_at):
                out.append(v)
        return out

    async def generate(self, request: GenRequest) -> GenResult:
        """Serves one request on some replica, retrying elsewhere on failure."""
        result, _ = await self.route(request)
        return result

    async def route(self, request: GenRequest,
                    deliver: Callable[[GenResult, str], None] | None = None,
                    hold: bool = True) -> tuple[GenResult, str]:
        """``generate``, and the name of the replica that served the request.

        ``deliver(result, replica)``, if given, is called as soon as the replica has
        answered, before the router's own bookkeeping (the policy's feedback, the
        trajectory's context, shared history), which then runs in the same step of the
        loop: a server answers its client first, so that the client goes on while the
        router books the result. The bookkeeping runs even if ``deliver`` raises.

        ``hold``: keep the trajectory's context after this turn, so that its next turn
        may send only its new tokens (``continues``). A caller whose clients cannot
        continue (SGLang's ``/generate`` sends every turn whole) passes False: nothing
        is held for the turn (a context held from an earlier turn is dropped, being
        out of date), which spares the router the memory of every context it serves."""
        self.stats.requests += 1
        full = self._full_prompt(request)
        attempts = 0
        tried: set[str] = set()
        refusals: list[ReplicaAuthRefused] = []  # this request's, while all it met
        # (the task awaiting each call: the health loop cancels it if the replica fails)
        task = asyncio.current_task() if self.config.failover_in_flight else None
        stall = self.config.stall_timeout_s is not None  # (the clock read only then)
        while True:
            healthy = [v for v in self.views() if v.healthy]
            if self._refusing:  # (those that refused the key are left out)
                healthy = self._placeable(healthy)
            if not healthy:
                self.stats.failed += 1
                refusing = [r.last_refusal for r in self.replicas.values()
                            if r.healthy and r.auth_refused and r.last_refusal is not None]
                if refusing:  # every replica left refused the router's key
                    raise ReplicaAuthRefused.every(refusing) from None
                raise NoReplicaAvailable(f"request {request.request_id}: no replica is up")
            decision = self.policy.select(request, healthy, self._clock())
            name = decision.replica
            rep = self.replicas.get(name)
            if rep is None or not rep.healthy or (
                    rep.auth_refused and not any(v.name == name for v in healthy)):
                # the policy counts the request as placed there: it failed
                self.policy.on_complete(request, None, name, self._clock())
                self.stats.failed += 1
                raise RuntimeError(f"policy {self.policy.name} chose {name!r}, which is not a "
                                   "healthy replica")
            if rep.auth_refused:  # its trial (``_placeable``): the next one after a while
                rep.auth_trial_at = self._clock() + self.config.auth_retry_s
            if decision.migrated:
                self.stats.migrations += 1
            send = request
            if decision.priority is not None and rep.takes_priority:
                # (positional: a third of replace()'s cost)
                send = GenRequest(send.request_id, send.prompt_ids, send.sampling,
                                  send.trajectory_id, send.group_id, decision.priority,
                                  send.continues)
            if send.continues:
                # Only the replica that served the trajectory's last turn holds its
                # context: another one (a policy's move, flagged ``migrated`` or not, or
                # a retry) may hold an older turn's and would append the new tokens to
                # that. So the router's own record of the home decides, not the policy.
                home = self._homes.get(send.trajectory_id or "")
                if name in tried or name != home:
                    if full is not None:
                        send = dataclasses.replace(send, prompt_ids=full, continues=False)
                        self.stats.resent_contexts += 1
                    elif home is not None:
                        self.policy.on_complete(request, None, name, self._clock())
                        self.stats.failed += 1
                        raise UnknownTrajectory(
                            f"request {request.request_id}: trajectory "
                            f"{request.trajectory_id!r} goes to {name}, not to {home}, which "
                            "served its last turn, and the router does not hold its "
                            "context; send the whole context")
                    # (neither known here: the replica answers for itself)
            size = len(full if full is not None else send.prompt_ids) + send.sampling.max_tokens
            rep.num_requests += 1
            rep.tokens_in_flight += size
            if stall and rep.num_requests == 1:  # (busy from now: ``_stalled``)
                rep.progress_at = self._clock()
            calls = rep.calls
            if task is not None:
                calls[task] = task.cancelling()
            aborted = False  # cancelled by the router alone: the replica failed its check
            try:
                try:  # (``_send`` inlined: one coroutine less per request)
                    result = await rep.backend.generate(send)
                except UnknownTrajectory:
                    if full is None:  # the context is lost: the client resends it
                        self.stats.failed += 1
                        raise
                    result = await self._resend_whole(rep, send, full)
                finally:
                    if task is not None:
                        base = calls.pop(task, None)
                        if base is None:  # (``_abort_in_flight`` took it) its cancel, undone
                            base = rep.aborted.pop(task, 0)
                            # (another cancel as well, the caller's: it ends the request)
                            aborted = task.uncancel() <= base
            except BaseException as exc:
                refused = None
                if isinstance(exc, asyncio.CancelledError):
                    if not aborted:  # the caller's: the request ends here
                        self.policy.on_complete(request, None, name, self._clock())
                        raise
                    # (the replica is down already, and its failure counted)
                elif isinstance(exc, ReplicaUnavailable):
                    self._mark_down(name, exc)
                else:  # an answer, if an error: the replica is not stalled
                    if stall:
                        rep.progress_at = self._clock()
                    refused = self._refused(name, rep, exc)
                    if refused is None:  # the request's own error (a 400, a 409)
                        self.policy.on_complete(request, None, name, self._clock())
                        raise
                    # (the replica is left out of placement now: sent elsewhere)
                self.policy.on_complete(request, None, name, self._clock())
                attempts += 1
                tried.add(name)
                if refused is None:
                    refusals = []  # (a failure too: no longer every replica's refusal)
                elif attempts == len(refusals) + 1:
                    refusals.append(refused)
                if attempts >= self.config.max_attempts:
                    self.stats.failed += 1
                    if refusals:
                        raise ReplicaAuthRefused.every(refusals) from None
                    raise NoReplicaAvailable(
                        f"request {request.request_id}: failed on {sorted(tried)}") from exc
                if full is None and request.continues:  # (not retried: no retry counted)
                    self.stats.failed += 1
                    raise UnknownTrajectory(
                        f"request {request.request_id}: its replica failed and the router "
                        "does not hold the trajectory's context; send the whole context"
                    ) from exc
                self.stats.retries += 1
                continue
            finally:
                rep.num_requests -= 1
                rep.tokens_in_flight -= size
            rep.served += 1
            if stall:
                rep.progress_at = self._clock()
            if rep.auth_refused:
                self._accepted(name, rep, "served a request")
            self.stats.completed += 1
            self.stats.per_replica[name] = self.stats.per_replica.get(name, 0) + 1
            try:
                if deliver is not None:
                    deliver(result, name)
            finally:
                self._book(request, result, name, full, hold)
            return result, name

    def _book(self, request: GenRequest, result: GenResult, name: str,
              full: tuple[int, ...] | None, hold: bool = True) -> None:
        """What the router keeps of a completed request: the policy's feedback, the
        trajectory's context (``hold``) and home, and the response as shared history."""
        self.policy.on_complete(request, result, name, self._clock())
        if hold:
            self._remember(request, full, result)
        elif request.trajectory_id is not None and self._contexts:
            self._drop_context(request.trajectory_id)
        if request.trajectory_id is not None:
            self._put_recent(self._homes, request.trajectory_id, name)
        if self.config.share_history and request.group_id is not None:
            self._share(name, result, request.group_id,
                        full if full is not None else request.prompt_ids)

    def finish_trajectory(self, trajectory_id: str) -> bool:
        """The trajectory ended (the rollout driver knows; otherwise the policy infers it
        from idleness): its held context is dropped, the policy, if it takes such
        reports, counts it among its group's finished samples, and the replica that
        served its last turn is told in the background (backends with a
        ``finish_trajectory``), so that KV it holds for a next turn is freed. Returns
        whether the router held anything of it."""
        if not isinstance(trajectory_id, str) or not trajectory_id:
            raise ValueError(f"trajectory_id must be a non-empty string, got {trajectory_id!r}")
        held = self._drop_context(trajectory_id)
        finish = getattr(self.policy, "finish_trajectory", None)
        if callable(finish):
            finish(trajectory_id, self._clock())
        home = self._homes.pop(trajectory_id, None)
        rep = self.replicas.get(home) if home is not None else None
        release = getattr(rep.backend, "finish_trajectory", None) if rep is not None else None
        if rep is not None and rep.healthy and not rep.auth_refused and callable(release):
            try:
                asyncio.get_running_loop()
            except RuntimeError:
                pass  # no event loop to send it from: the replica's hold expires by itself
            else:
                self._spawn(self._release(release, rep.backend.name, trajectory_id))
        return held

    async def observe_rl_step(self, rl_step: int) -> dict[str, str]:
        """RL step ``rl_step`` began: every replica up whose backend takes it
        (``observe_rl_step``: WAR replicas) is told at once, concurrently, each within
        ``health_timeout_s``, so that its draft history's window of RL steps slides
        (``SpecConfig.history_window_steps``). Returns each replica's outcome: ``"ok"``,
        ``"unsupported"`` (a vLLM or SGLang replica), ``"down"`` (told when it rejoins),
        or ``"refused: ..."`` / ``"failed: ..."`` with the reason (a replica that saw a
        later step refuses an earlier one). A replica that rejoins later is told the
        last step the router was told. ValueError for a step that is not an int >= 0."""
        if isinstance(rl_step, bool) or not isinstance(rl_step, int) or rl_step < 0:
            raise ValueError(f"rl_step must be an int >= 0, got {rl_step!r}")
        self._rl_step = rl_step
        out: dict[str, str] = {}
        calls: dict[str, Awaitable[None]] = {}
        for name, rep in self.replicas.items():
            observe = getattr(rep.backend, "observe_rl_step", None)
            if not callable(observe):
                out[name] = "unsupported"
            elif not rep.healthy:
                out[name] = "down"
            else:
                calls[name] = observe(rl_step)
        timeout = self.config.health_timeout_s

        async def one(call: Awaitable[None]) -> None:
            async with asyncio.timeout(timeout):
                await call

        answers = await asyncio.gather(*(one(c) for c in calls.values()),
                                       return_exceptions=True)
        for name, answer in zip(calls, answers, strict=True):
            if answer is None:
                out[name] = "ok"
            elif isinstance(answer, ValueError):
                out[name] = f"refused: {answer}"
            elif isinstance(answer, TimeoutError):
                out[name] = f"failed: no answer within {timeout} s"
            elif isinstance(answer, Exception):
                out[name] = f"failed: {answer}"
            else:
                raise answer  # (a cancellation)
        return {name: out[name] for name in self.replicas}

    async def _tell_rl_step(self, name: str, rep: _Replica, rl_step: int) -> None:
        """A rejoining replica is told the router's RL step (``observe_rl_step``)."""
        observe = getattr(rep.backend, "observe_rl_step", None)
        if not callable(observe):
            return
        try:
            async with asyncio.timeout(self.config.health_timeout_s):
                await observe(rl_step)
        except Exception as exc:  # (its window stays; the next step tells it again)
            log.debug("telling %s RL step %d failed: %r", name, rl_step, exc)

    async def _release(self, release: Callable[[str], Awaitable[bool]], name: str,
                       trajectory_id: str) -> None:
        """Tells the replica that served the trajectory's last turn that it ended
        (``release``: its backend's ``finish_trajectory``), so that KV it holds for a
        next turn is freed (``EngineConfig.kv_hold_s``)."""
        try:
            await release(trajectory_id)
            self.stats.trajectories_released += 1
        except Exception as exc:  # an optimization: the hold expires anyway
            rep = self.replicas.get(name)
            if rep is None or self._refused(name, rep, exc) is None:
                log.debug("finishing %s on %s failed: %r", trajectory_id, name, exc)

    async def _resend_whole(self, rep: _Replica, request: GenRequest,
                            full: tuple[int, ...]) -> GenResult:
        """``request`` again with the trajectory's whole context ``full``: its replica
        answered that it does not hold the trajectory."""
        self.stats.resent_contexts += 1
        whole = dataclasses.replace(request, prompt_ids=full, continues=False)
        return await rep.backend.generate(whole)

    def _full_prompt(self, request: GenRequest) -> tuple[int, ...] | None:
        """The request's whole context: its prompt, or for a continuing turn the
        trajectory's held context plus the new tokens (None if not held)."""
        if not request.continues:
            return request.prompt_ids
        held = self._contexts.get(request.trajectory_id or "")
        if held is None:
            return None
        return (*held[0], *held[1], *request.prompt_ids)

    def _remember(self, request: GenRequest, full: tuple[int, ...] | None,
                  result: GenResult) -> None:
        """Holds the trajectory's context after this turn (``full``: its whole prompt;
        None: not known, so nothing is held), as the most recently used, within
        ``max_trajectories`` and ``max_context_tokens``."""
        tid = request.trajectory_id
        if tid is None:
            return
        self._drop_context(tid)  # (put back below as the most recent)
        if full is None:
            return
        cfg = self.config
        size = len(full) + len(result.output_ids)
        if size > cfg.max_context_tokens:  # larger than the bound alone: not held
            self.stats.contexts_dropped += 1
            return
        contexts = self._contexts
        contexts[tid] = (full, result.output_ids)
        self._context_tokens += size
        while len(contexts) > cfg.max_trajectories or (
                self._context_tokens > cfg.max_context_tokens):
            _, (prompt, output) = contexts.popitem(last=False)
            self._context_tokens -= len(prompt) + len(output)
            self.stats.contexts_dropped += 1

    def _drop_context(self, tid: str) -> bool:
        """Drops a trajectory's held context; whether one was held."""
        held = self._contexts.pop(tid, None)
        if held is None:
            return False
        self._context_tokens -= len(held[0]) + len(held[1])
        return True

    @property
    def held_context_tokens(self) -> int:
        """Tokens of the trajectory contexts the router holds (``max_context_tokens``)."""
        return self._context_tokens

    def _put_recent(self, table: OrderedDict[str, Any], tid: str, value: Any) -> None:
        """Sets a trajectory's entry as the most recent one, keeping at most
        ``max_trajectories`` (least recently set dropped)."""
        table[tid] = value
        table.move_to_end(tid)
        while len(table) > self.config.max_trajectories:
            table.popitem(last=False)

    def _share(self, source: str, result: GenResult, group_id: str,
               prompt: Sequence[int]) -> None:
        if not result.output_ids:
            return
        lead = min(self.config.history_lead_in, len(prompt))
        item = ([*prompt[len(prompt) - lead:], *result.output_ids], group_id)
        for name, rep in self.replicas.items():
            if name == source or not rep.healthy or rep.auth_refused:
                continue
            pending = self._pending.setdefault(name, [])
            pending.append(item)
            if self.config.history_flush_s == 0 or len(pending) >= self.config.history_batch:
                self._spawn(self._flush(name))
            elif name not in self._flush_due:
                self._flush_due.add(name)
                self._spawn(self._flush_later(name))

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _flush_later(self, name: str) -> None:
        try:
            await asyncio.sleep(self.config.history_flush_s)
        finally:
            self._flush_due.discard(name)
        await self._flush(name)

    async def _flush(self, name: str) -> None:
        items = self._pending.pop(name, [])
        rep = self.replicas.get(name)
        if items and rep is not None and rep.healthy and not rep.auth_refused:
            await self._forward(rep, items, name)

    async def _forward(self, rep: _Replica, items: Sequence[tuple[Sequence[int], str | None]],
                       name: str) -> None:
        try:
            await rep.backend.add_history(items)
            self.stats.history_forwarded += len(items)
        except Exception as exc:  # history is an optimization: never fail a request for it
            if self._refused(name, rep, exc) is None:
                log.debug("history to %s failed: %r", rep.backend.name, exc)

    # ------------------------------------------------------------ health

    def _refused(self, name: str, rep: _Replica, exc: BaseException
                 ) -> ReplicaAuthRefused | None:
        """``auth_refusal`` of ``exc`` (a call to replica ``name``), counted; the replica
        is flagged ``auth_refused`` (left out of placement), and logged unless it was
        already (once per episode). None if ``exc`` is no such refusal."""
        refused = auth_refusal(exc, rep.backend.name, name)
        if refused is not None:
            self.stats.auth_refusals += 1
            rep.last_refusal = refused
            rep.auth_trial_at = self._clock() + self.config.auth_retry_s
            if not rep.auth_refused:
                rep.auth_refused = True
                self._refusing.add(name)
                others = sum(1 for n, r in self.replicas.items()
                             if n not in self._refusing and r.healthy)
                log.error("%s; it is left out of placement until it accepts the key "
                          "(%d other replica(s) up that have not refused it)", refused, others)
        return refused

    def _accepted(self, name: str, rep: _Replica, how: str) -> None:
        """Replica ``name``, flagged ``auth_refused``, accepted a call of the router
        (``how``): it rejoins placement."""
        rep.auth_refused = False
        rep.last_refusal = None
        self._refusing.discard(name)
        log.warning("replica %s accepts the router's API key again (%s): back in placement",
                    name, how)

    def _mark_down(self, name: str, exc: BaseException) -> None:
        rep = self.replicas[name]
        rep.failures += 1
        if rep.healthy:
            rep.healthy = False
            self.stats.replicas_marked_down += 1
            log.warning("replica %s marked down: %s", name, exc)
            self.policy.on_replica_down(name, self._clock())

    def _abort_in_flight(self, name: str, rep: _Replica, why: str) -> int:
        """Cancels the calls in flight on replica ``name``, which failed a health check
        (``why``), so that their requests go to other replicas now rather than at their
        generation timeout (``route`` tells the router's cancellation from its caller's
        and re-sends them); returns how many. Nothing with ``failover_in_flight`` off."""
        calls = rep.calls
        if not calls or not self.config.failover_in_flight:
            return 0
        me = asyncio.current_task()
        n = 0
        for task, base in list(calls.items()):
            # (one its caller is cancelling already ends anyway: left to it)
            if task is me or task.done() or task.cancelling() > base:
                continue
            del calls[task]
            rep.aborted[task] = base
            task.cancel(f"replica {name} failed its health check")
            n += 1
        if n:
            self.stats.in_flight_aborted += n
            log.warning("replica %s failed its health check (%s): its %d request(s) in "
                        "flight are sent to other replicas", name, why, n)
        return n

    async def check_health(self) -> None:
        """One round: down replicas that answer rejoin; loads are refreshed. Replicas
        are checked concurrently, each within ``health_timeout_s``: one that accepts
        connections but never answers delays no other, and is marked down itself. A
        replica that fails its check has its requests in flight sent elsewhere
        (``failover_in_flight``)."""
        await asyncio.gather(*[self._check(name, rep) for name, rep in self.replicas.items()])

    async def _check(self, name: str, rep: _Replica) -> None:
        """One replica's part of a round (``check_health``); never raises."""
        if rep.healthy and self._stalled(name, rep):
            return
        timeout = self.config.health_timeout_s
        back = False  # a down replica answered its health check
        try:
            async with asyncio.timeout(timeout):
                if not rep.healthy:
                    if not await rep.backend.health():
                        # (down since a request failed there: now its check fails too)
                        self._abort_in_flight(name, rep, "no health answer")
                        return
                    back = True
                rep.load = await rep.backend.load()
            if rep.poll_refused:
                # (a refused poll, now accepted, shows that the replica takes the key; a
                # poll that was never refused may need none: it proves nothing, and its
                # success cannot end the episode on every round)
                rep.poll_refused = False
                if rep.auth_refused:
                    self._accepted(name, rep, "its load poll was accepted")
            # (a replica rejoins only with its new load report: meanwhile it is offered
            # to no request, with the report from before it went down or otherwise)
            if back and not self._stall_holds(rep):
                self._rejoin(name, rep)
        except ReplicaUnavailable as exc:
            self._mark_down(name, exc)  # (one that is down stays down, counted once)
            self._abort_in_flight(name, rep, str(exc))
        except TimeoutError:  # (the bound above, or the backend's own)
            why = f"no health or load answer within {timeout} s"
            if rep.healthy:  # (a down replica whose health check hangs stays down)
                self._mark_down(name, ReplicaUnavailable(f"{name}: {why}"))
            self._abort_in_flight(name, rep, why)
        except Exception as exc:  # a load report is advisory
            if self._refused(name, rep, exc) is None:
                log.debug("load of %s failed: %r", name, exc)
            else:
                rep.poll_refused = True
            if back and not self._stall_holds(rep):
                self._rejoin(name, rep)

    def _stalled(self, name: str, rep: _Replica) -> bool:
        """Whether replica ``name``, up, is stalled (``stall_timeout_s``: requests in
        flight there continuously for that long, none completing meanwhile); if so it is
        marked down as after a failed health check, its requests in flight failed over,
        and the stall counted and logged (once: a down replica is not checked again)."""
        limit = self.config.stall_timeout_s
        if limit is None or rep.num_requests == 0:
            return False
        now = self._clock()
        quiet_s = now - rep.progress_at
        if quiet_s < limit:
            return False
        n = rep.num_requests
        why = (f"stalled: {n} request{'s' if n != 1 else ''} in flight, none completed "
               f"for {quiet_s:.3g} s")
        self.stats.replicas_stalled += 1
        rep.stalled_at = now
        self._mark_down(name, ReplicaUnavailable(f"{name}: {why}"))
        self._abort_in_flight(name, rep, "stalled")
        return True

    def _stall_holds(self, rep: _Replica) -> bool:
        """Whether a replica whose health check just passed stays down for its stall: it
        was marked down for one less than ``health_interval_s`` ago, or the router still
        has requests in flight there (the stalled calls, not yet cancelled or ended). A
        stalled engine's HTTP front answers its health check at once, so that check
        alone would let it rejoin in the very round after, with its stalled calls still
        on it. Once it holds no more, the stall is over (one that stalls again is found
        again after another ``stall_timeout_s``)."""
        if rep.stalled_at is None:
            return False
        if (self._clock() - rep.stalled_at < self.config.health_interval_s
                or rep.num_requests > 0):
            return True
        rep.stalled_at = None
        return False

    def _rejoin(self, name: str, rep: _Replica) -> None:
        rep.healthy = True
        log.warning("replica %s is back", name)
        if self._rl_step is not None:  # (it missed the steps told while it was down)
            self._spawn(self._tell_rl_step(name, rep, self._rl_step))

    async def _health_loop(self) -> None:
        while True:
            await self.check_health()
            await asyncio.sleep(self.config.health_interval_s)

    def fleet_load(self) -> dict[str, dict[str, object]]:
        return {name: {"healthy": r.healthy, "num_requests": r.num_requests,
                       "tokens_in_flight": r.tokens_in_flight, "served": r.served,
                       "failures": r.failures, "auth_refused": r.auth_refused,
                       "load": dataclasses.asdict(r.load) if r.load else None}
                for name, r in self.replicas.items()}
