"""The verl router plugin against verl's load-balancer interface, without verl or Ray:
construction as verl does it (``cls(servers, router_kwargs)``, the whole YAML as kwargs),
multi-turn stickiness, release accounting, adding and removing servers, the status
shape, errors; and, if Ray is importable, the same calls through ``ray.remote``."""

from __future__ import annotations

import random
from typing import Any

import pytest

from war.router.policies.base import Decision, ReplicaView
from war.router.verl import NO_SERVERS, VerlRouterConfig, WarVerlRouter
from war.types import GenRequest, GenResult

YAML = {"router_class": "war.router.verl.WarVerlRouter", "policy": "war", "max_tokens": 64}


def servers(n: int) -> dict[str, Any]:
    return {f"10.0.0.{i}:8000": f"handle-{i}" for i in range(n)}


class Recording:
    """Least requests in flight (first on ties); records the calls."""

    name = "recording"

    def __init__(self) -> None:
        self.selected: list[GenRequest] = []
        self.completed: list[tuple[str, str, GenResult | None]] = []
        self.down: list[str] = []

    def select(self, request: GenRequest, replicas: list[ReplicaView], now: float) -> Decision:
        self.selected.append(request)
        return Decision(min(replicas, key=lambda v: v.num_requests).name)

    def on_complete(self, request: GenRequest, result: GenResult | None, replica: str,
                    now: float) -> None:
        self.completed.append((request.request_id, replica, result))

    def on_replica_down(self, replica: str, now: float) -> None:
        self.down.append(replica)


def test_constructed_as_verl_does() -> None:
    router = WarVerlRouter(servers(2), dict(YAML))
    assert router.config == VerlRouterConfig(policy="war", max_tokens=64)
    assert router.policy.name == "war"
    assert router.require_acquire_fields() == ["prompt_ids"]
    assert router.require_release_fields() == ["request_id"]
    assert router.get_all_servers() == list(servers(2))
    assert WarVerlRouter(servers(1), None).config == VerlRouterConfig()
    with pytest.raises(ValueError, match="unknown router_kwargs"):
        WarVerlRouter(servers(1), {**YAML, "polcy": "war"})
    with pytest.raises(ValueError, match="max_tokens"):
        WarVerlRouter(servers(1), {**YAML, "max_tokens": 0})
    with pytest.raises(ValueError):
        WarVerlRouter(servers(1), {**YAML, "policy": "nonesuch"})
    # (not a TypeError from deep inside dict(); the YAML's section named)
    with pytest.raises(ValueError, match="router_kwargs must be a mapping"):
        WarVerlRouter(servers(1), ["policy", "war"])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="policy_kwargs must be a mapping"):
        WarVerlRouter(servers(1), {**YAML, "policy_kwargs": [1, 2]})


@pytest.mark.parametrize("policy", ["war", "cache_aware", "least_load"])
def test_turns_of_a_trajectory_stay_on_their_server(policy: str) -> None:
    """Eight trajectories over four servers, five turns each, the contexts growing: each
    trajectory keeps its server while the load is balanced, and the load is spread."""
    router = WarVerlRouter(servers(4), {**YAML, "policy": policy})
    rng = random.Random(0)
    contexts = {f"traj-{i}": [rng.randrange(1000) for _ in range(32)] for i in range(8)}
    placed: dict[str, list[str]] = {t: [] for t in contexts}
    for _turn in range(5):
        leases = []
        for tid, ctx in contexts.items():
            sid, handle = router.acquire_server(tid, prompt_ids=list(ctx))
            assert handle == servers(4)[sid]
            placed[tid].append(sid)
            leases.append((sid, tid))
        assert router.get_total_inflight() == 8
        for sid, tid in leases:
            router.release_server(sid, request_id=tid)
            contexts[tid] += [rng.randrange(1000) for _ in range(16)]
        assert router.get_total_inflight() == 0
    if policy != "least_load":
        assert all(len(set(s)) == 1 for s in placed.values()), placed
    assert len({s[0] for s in placed.values()}) == 4  # every server used


def test_release_accounting() -> None:
    policy = Recording()
    router = WarVerlRouter(servers(2), dict(YAML), policy_factory=lambda: policy)
    s1, _ = router.acquire_server("t1", prompt_ids=[1, 2, 3])
    s2, _ = router.acquire_server("t2", prompt_ids=[4, 5])
    s3, _ = router.acquire_server("t3")  # no prompt known
    assert s1 != s2 and s3 == s1
    assert policy.selected[0].trajectory_id == "t1"
    assert policy.selected[0].prompt_ids == (1, 2, 3)
    assert policy.selected[0].sampling.max_tokens == 64
    assert policy.selected[2].prompt_ids[0] < 0  # a placeholder no real prompt shares
    status = router.get_status()
    assert status["servers"] == {s1: 2, s2: 1}
    assert status["total_inflight"] == 3 and status["active_servers"] == 2
    assert status["tokens_in_flight"] == {s1: 3 + 64 + 1 + 64, s2: 2 + 64}
    router.release_server(s1, request_id="t3")
    assert policy.completed[-1][:2] == ("t3#0", s1)
    done = policy.completed[-1][2]
    assert done is not None and done.output_ids == () and done.finish_reason == "stop"
    router.release_server(s1)  # no request id: the server's oldest (t1)
    assert policy.completed[-1][:2] == ("t1#0", s1)
    router.release_server(s1, request_id="t1")  # nothing open: ignored
    router.release_server("nowhere", request_id="t2")  # unknown server: ignored
    assert router.get_status()["servers"] == {s1: 0, s2: 1}
    assert router.get_total_inflight() == 1 and router.get_inflight_count(s2) == 1
    router.acquire_server("t1", prompt_ids=[1, 2, 3, 9])
    assert policy.selected[-1].request_id == "t1#1"  # the trajectory's second turn


def test_an_unmatched_release_frees_no_other_trajectorys_request() -> None:
    policy = Recording()
    router = WarVerlRouter(servers(1), dict(YAML), policy_factory=lambda: policy)
    (sid,) = servers(1)
    router.acquire_server("t1", prompt_ids=[1, 2, 3])
    router.acquire_server("t2", prompt_ids=[4, 5, 6])
    router.release_server(sid, request_id="t1")
    assert policy.completed == [("t1#0", sid, policy.completed[0][2])]
    # a double release, and a release of a request never acquired: t2 stays open, and
    # the policy is not told that it finished
    router.release_server(sid, request_id="t1")
    router.release_server(sid, request_id="never-acquired")
    assert router.get_status()["servers"] == {sid: 1}
    assert router.get_status()["tokens_in_flight"] == {sid: 3 + 64}
    assert [c[0] for c in policy.completed] == ["t1#0"]
    assert router.released == 1
    router.release_server(sid, request_id="t2")
    assert router.get_total_inflight() == 0 and router.released == 2


def test_add_and_remove_servers() -> None:
    policy = Recording()
    router = WarVerlRouter(servers(2), dict(YAML), policy_factory=lambda: policy)
    a, b = list(servers(2))
    router.acquire_server("t1", prompt_ids=[1])
    router.acquire_server("t2", prompt_ids=[2])
    router.add_servers({"new:1": "handle-new"})
    assert router.get_all_servers() == [a, b, "new:1"]
    sid, handle = router.acquire_server("t3", prompt_ids=[3])
    assert (sid, handle) == ("new:1", "handle-new")
    router.remove_servers([a, "never-there"])
    assert policy.down == [a]
    assert router.get_all_servers() == [b, "new:1"]
    assert router.get_status()["servers"] == {b: 1, "new:1": 1}
    assert router.get_total_inflight() == 2
    router.release_server(a, request_id="t1")  # its server is gone: ignored
    assert router.get_total_inflight() == 2
    router.remove_servers([b, "new:1"])
    assert router.get_status()["active_servers"] == 0
    with pytest.raises(RuntimeError, match=NO_SERVERS):
        router.acquire_server("t4", prompt_ids=[4])


def test_clear_sticky_cache_gives_a_fresh_policy() -> None:
    made: list[Recording] = []

    def factory() -> Recording:
        made.append(Recording())
        return made[-1]

    router = WarVerlRouter(servers(2), dict(YAML), policy_factory=factory)
    s1, _ = router.acquire_server("t1", prompt_ids=[1])
    router.acquire_server("t2", prompt_ids=[2])
    out = router.clear_sticky_cache()
    assert out == {"cleared_entries": 2, "server_loads": {s: 1 for s in servers(2)}}
    assert len(made) == 2 and router.policy is made[1]
    router.release_server(s1, request_id="t1")  # placed by the old policy: not reported
    assert made[1].completed == [] and made[0].completed == []
    assert router.get_total_inflight() == 1


def test_no_servers_is_verls_error() -> None:
    router = WarVerlRouter({}, dict(YAML))
    with pytest.raises(RuntimeError, match="No available servers"):
        router.acquire_server("t", prompt_ids=[1])
    status = router.get_status()
    assert (status["servers"], status["total_inflight"], status["active_servers"]) == ({}, 0, 0)
    assert router.clear_sticky_cache() == {"cleared_entries": 0, "server_loads": {}}


@pytest.mark.slow
def test_works_as_a_ray_actor() -> None:
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=1, include_dashboard=False, ignore_reinit_error=True)
    try:
        actor = ray.remote(WarVerlRouter).remote(servers(2), dict(YAML))
        assert ray.get(actor.require_acquire_fields.remote()) == ["prompt_ids"]
        sid, handle = ray.get(actor.acquire_server.remote("t1", prompt_ids=[1, 2, 3]))
        assert handle == servers(2)[sid]
        assert ray.get(actor.get_total_inflight.remote()) == 1
        ray.get(actor.release_server.remote(sid, request_id="t1"))
        status = ray.get(actor.get_status.remote())
        assert status["total_inflight"] == 0 and status["active_servers"] == 2
    finally:
        ray.shutdown()


@pytest.mark.parametrize("policy", ["war", "cache_aware"])
def test_requests_without_prompt_ids_are_placed_by_tree_policies(policy: str) -> None:
    """The placeholder token of a request with no prompt fits the prefix trees' int32
    for every trajectory id (half of them hash past 2**31)."""
    router = WarVerlRouter(servers(2), {**YAML, "policy": policy})
    for i in range(16):
        sid, _ = router.acquire_server(f"t{i}")
        router.release_server(sid, request_id=f"t{i}")
    assert router.acquired == 16 and router.get_total_inflight() == 0


class Stray(Recording):
    """Chooses a server that is not registered."""

    def select(self, request: GenRequest, replicas: list[ReplicaView], now: float) -> Decision:
        self.selected.append(request)
        return Decision("nowhere:1")


def test_a_failed_acquire_leaves_no_trace() -> None:
    policy = Stray()
    router = WarVerlRouter(servers(2), dict(YAML), policy_factory=lambda: policy)
    with pytest.raises(RuntimeError, match="not a registered server"):
        router.acquire_server("t1", prompt_ids=[1, 2])
    # the policy is told its placement failed; the trajectory has no turn counted
    assert policy.completed == [("t1#0", "nowhere:1", None)]
    with pytest.raises(ValueError):
        router.acquire_server("t1", prompt_ids=["x"])  # type: ignore[list-item]
    assert router.get_status()["trajectories"] == 0
    good = Recording()
    router.policy = good
    router.acquire_server("t1", prompt_ids=[1, 2])
    assert good.selected[-1].request_id == "t1#0"


def test_removing_a_server_ends_its_open_requests_in_the_policy() -> None:
    # A removed server's open requests are never released: the policy must hear that
    # they failed there, or the war policy counts them in flight for good (the
    # trajectory never idles, so it never counts among its group's finished samples).
    router = WarVerlRouter(servers(2), dict(YAML))
    sid, _ = router.acquire_server("t1", prompt_ids=[1, 2, 3])
    router.remove_servers([sid])
    progress = router.policy.progress.progress("t1")
    assert progress is not None and progress.in_flight == 0
    sid2, _ = router.acquire_server("t1", prompt_ids=[1, 2, 3, 4])
    router.release_server(sid2, request_id="t1")
    progress = router.policy.progress.progress("t1")
    assert progress is not None and progress.in_flight == 0 and progress.turns == 1

    policy = Recording()
    router = WarVerlRouter(servers(2), dict(YAML), policy_factory=lambda: policy)
    a, _ = router.acquire_server("t1", prompt_ids=[1])
    router.remove_servers([a])
    assert policy.down == [a] and policy.completed == [("t1#0", a, None)]
