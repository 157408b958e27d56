"""The router benchmark's helpers and command line on tiny runs: the load generator, the
instant replica app, the throughput measurement (one replica, one ``war route``), the
policies measurement (unpaced engines) and the report's keys."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import math
from pathlib import Path
from types import ModuleType

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from bench_scripts import load_benchmark, usage_error
from fastapi.testclient import TestClient

from war.router.bench import (
    LoadItem,
    LoadRun,
    PolicyBenchConfig,
    RpsBenchConfig,
    build_load,
    build_sessions,
    client_session,
    drive_run,
    instant_replica_app,
    load_figures,
    paired_ratio,
    percentile,
    run_policies,
    run_router_rps,
    summary_line,
    targets,
)

RPS_KEYS = {"router", "policy", "rps", "affinity", "p50_ms", "p99_ms", "added_p50_ms",
            "added_p99_ms", "errors", "api", "vs_sglang_router", "concurrency"}
POLICY_KEYS = {"policy", "prefix_hit_rate", "makespan_s", "migrations"}
UNPACED = {"step_ms": 0.0, "prefill_us": 0.0, "decode_us": 0.0}


def load_script() -> ModuleType:
    return load_benchmark("router", "bench_router")


def test_load_affinity_and_percentiles() -> None:
    fresh = build_load(50, 0.0, seed=1)
    assert len({i.session for i in fresh}) == 50
    same = build_load(50, 1.0, seed=1, prompt_tokens=4, turn_tokens=2, max_context=1000)
    assert {i.session for i in same} == {"1:s0"}
    assert all(b.prompt[:len(a.prompt)] == a.prompt for a, b in itertools.pairwise(same))
    # a session past max_context is a new session: a new id, never an old one reused
    short = build_load(12, 1.0, seed=2, prompt_tokens=4, turn_tokens=4, max_context=12)
    assert [i.session for i in short] == ["2:s0"] * 3 + ["2:s1"] * 3 + ["2:s2"] * 3 + [
        "2:s3"] * 3
    assert short[3].prompt[:4] != short[2].prompt[:4]
    assert not {i.session for i in fresh} & {i.session for i in build_load(50, 0.0, seed=2)}
    assert build_load(30, 0.5, seed=3) == build_load(30, 0.5, seed=3)
    with pytest.raises(ValueError):
        build_load(1, 1.5, seed=0)
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([5.0], 99) == 5.0


def test_instant_replica_speaks_war_and_sglang() -> None:
    client = TestClient(instant_replica_app("r", max_output_tokens=3))
    r = client.post("/v1/completions", json={"prompt": [4, 5, 6, 7], "max_tokens": 8,
                                             "logprobs": 1, "request_id": "x"})
    assert r.status_code == 200
    data = r.json()
    assert data["id"] == "x" and data["choices"][0]["token_ids"] == [4, 5, 6]
    assert data["usage"]["prompt_tokens"] == 4
    r = client.post("/generate", json={"input_ids": [9, 8], "sampling_params":
                                       {"max_new_tokens": 1}})
    assert r.status_code == 200 and r.json()["output_ids"] == [9]
    assert client.get("/health").status_code == 200
    for path in ("/server_info", "/get_model_info", "/v1/models"):
        assert client.get(path).status_code == 200
    assert client.get("/v1/load").json()["kv_free_tokens"] > 0


def test_runs_through_one_session_keep_its_connections() -> None:
    """The load client's runs through one ``client_session`` reuse its connections (no
    slice of a repeat pays for connecting); a run without one opens its own."""

    async def main() -> tuple[set[object], set[object], LoadRun, LoadRun]:
        peers: list[object] = []

        async def generate(request: web.Request) -> web.Response:
            peers.append(request.transport.get_extra_info("peername")
                         if request.transport is not None else None)
            body = await request.json()
            return web.json_response({"output_ids": body["input_ids"][:2]})

        app = web.Application()
        app.router.add_post("/generate", generate)
        items = [LoadItem(f"s{i}", (i, i + 1, i + 2)) for i in range(12)]
        async with TestServer(app, host="127.0.0.1") as server:
            url = str(server.make_url("")).rstrip("/")
            async with client_session(2) as session:
                first = await drive_run(url, items, 2, "sglang", session=session)
                second = await drive_run(url, items, 2, "sglang", session=session)
            shared = set(peers)
            peers.clear()
            await drive_run(url, items, 2, "sglang")
            await drive_run(url, items, 2, "sglang")
            return shared, set(peers), first, second

    shared, own, first, second = asyncio.run(main())
    assert len(first.latencies) == len(second.latencies) == 12
    assert first.errors == second.errors == 0
    assert None not in shared and 1 <= len(shared) <= 2  # 24 requests, 2 connections
    assert len(own) > len(shared)  # without a session each run connected anew


@pytest.mark.slow
def test_router_rps_rows() -> None:
    config = RpsBenchConfig(num_replicas=1, policies=("round_robin",), affinities=(0.5,),
                            num_requests=20, warmup=2, concurrencies=(2,), repeats=1,
                            sglang=False)
    out = run_router_rps(config)
    assert out["sglang_router"]["available"] is False
    rows = out["router_rps"]
    # war route over WAR's API and over SGLang's /generate (SGLang backends), and
    # direct calls over each
    assert [(r["router"], r["policy"], r["api"]) for r in rows] == [
        ("direct", None, "war"), ("war", "round_robin", "war"),
        ("war", "round_robin", "sglang"), ("direct", None, "sglang")]
    for r in rows:
        assert set(r) >= RPS_KEYS and r["errors"] == 0 and r["rps"] > 0
        assert r["vs_sglang_router"] is None  # (no sglang-router in this run)
    assert rows[0]["added_p50_ms"] == 0.0 and rows[3]["added_p50_ms"] == 0.0
    one = run_router_rps(dataclasses.replace(config, apis=("war",), concurrencies=(1, 3))
                         )["router_rps"]
    # a row per number in flight
    assert [(r["router"], r["api"], r["concurrency"]) for r in one] == [
        ("direct", "war", 1), ("war", "war", 1), ("direct", "war", 3), ("war", "war", 3)]
    assert all(r["errors"] == 0 and r["rps"] > 0 for r in one)
    for bad in ((), (0,), (2, 2), (True,)):
        with pytest.raises(ValueError, match="concurrencies"):
            dataclasses.replace(config, concurrencies=bad)
    with pytest.raises(ValueError, match="apis"):
        dataclasses.replace(config, apis=("grpc",))
    with pytest.raises(ValueError, match="slices"):
        dataclasses.replace(config, slices=21)
    assert config.slices == 5  # (20 requests: the targets took turns on 4 each)


def test_slices_of_a_run_count_together() -> None:
    # two parts of one target's run: 3 answers in 1 s, then 1 answer (and a failure)
    # in 3 s -> 4 answers in 4 s, percentiles over the four latencies
    fig = load_figures([LoadRun((0.001, 0.002, 0.003), 0, 1.0), LoadRun((0.004,), 1, 3.0)])
    assert fig.rps == 1.0 and fig.errors == 1
    assert fig.p50_ms == pytest.approx(2.5) and fig.p99_ms == pytest.approx(3.97)
    empty = load_figures([LoadRun((), 0, 0.0)])
    assert math.isnan(empty.rps) and empty.errors == 0


def test_paired_ratio_is_the_median_of_side_by_side_ratios() -> None:
    # repeats 0-2: the machine slows down in repeat 1 for both; a ratio of medians
    # (200 / 100 = 2.0) would differ from the paired one (median of 1.0, 1.0, 4.0)
    assert paired_ratio([100.0, 50.0, 400.0], [100.0, 50.0, 100.0]) == 1.0
    assert paired_ratio([100.0, 300.0], [100.0]) == 1.0  # only the repeats both have
    assert paired_ratio([100.0], [0.0]) is None and paired_ratio([], []) is None
    row = {"router": "war", "policy": "war", "api": "sglang", "affinity": 0.5, "rps": 900.0,
           "added_p50_ms": 1.0, "vs_sglang_router": 0.9, "concurrency": 8}
    line = summary_line({"router_rps": [row, dict(row, concurrency=64, rps=1200.0)]})
    assert "8 in flight: war/war[/generate] 900/s +1.0ms 0.90x" in line
    assert "64 in flight: war/war[/generate] 1200/s" in line
    # the throughput target: the war policy over SGLang's API, at every affinity and
    # number in flight
    others = [dict(row, affinity=0.0, vs_sglang_router=1.02),
              dict(row, concurrency=64, vs_sglang_router=1.1),
              dict(row, api="war", vs_sglang_router=0.5),  # WAR's API: not compared
              dict(row, policy="cache_aware", vs_sglang_router=0.5),
              dict(row, affinity=0.9, vs_sglang_router=None)]  # no sglang-router
    got = targets({"router_rps": [row, *others]})
    assert got == {"war_rps_vs_sglang_router": {"8": {"0.0": 1.02, "0.5": 0.9},
                                                "64": {"0.5": 1.1}},
                   "war_rps_ge_sglang_router": False}
    row["vs_sglang_router"] = 1.0
    assert targets({"router_rps": [row, *others]})["war_rps_ge_sglang_router"] is True
    others[1]["vs_sglang_router"] = 0.99  # below at 64 in flight alone
    assert targets({"router_rps": [row, *others]})["war_rps_ge_sglang_router"] is False


def test_sessions_and_policy_rows() -> None:
    config = PolicyBenchConfig(policies=("war", "round_robin"), group_turns=(1, 3),
                               group_size=2, rl_steps=2, repeats=1, prompt_tokens=16,
                               obs_tokens=4, max_tokens=2, **UNPACED)
    steps = build_sessions(config, 512)
    assert len(steps) == 2 and all(len(s) == 4 for s in steps)
    assert {s.group_id for s in steps[0]} == {"g0", "g1"}
    first = {s.group_id: s.prompt for s in steps[0]}
    assert all(s.prompt == first[s.group_id] for s in steps[1])  # groups recur
    out = run_policies(config)
    rows = out["policies"]
    assert [r["policy"] for r in rows] == ["war", "round_robin"]
    for r in rows:
        assert set(r) >= POLICY_KEYS
        assert 0.0 <= r["prefix_hit_rate"] <= 1.0 and r["makespan_s"] > 0
    run = out["policy_runs"][0]
    assert run["requests"] == sum(s.turns for step in steps for s in step)
    report = {"router_rps": [], **out}
    assert targets(report) == {}  # no cache_aware row to compare with
    assert summary_line(report).startswith("bench_router: policies hit/makespan: war ")


def test_script_writes_the_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out.json"
    bench = load_script()
    assert bench.main(["--quick", "--no-rps", "--json", str(out), "--policies", "war",
                       "cache_aware", "--group-turns", "1", "2", "--group-size", "1",
                       "--rl-steps", "1", "--repeats", "1"]) == 0
    (line,) = capsys.readouterr().out.strip().splitlines()
    assert line.startswith("bench_router: policies hit/makespan: war ")
    report = json.loads(out.read_text(encoding="utf-8"))
    assert {"machine", "policies", "policy_runs", "policies_config", "targets"} <= set(report)
    assert {r["policy"] for r in report["policies"]} == {"war", "cache_aware"}
    assert all(set(r) >= POLICY_KEYS for r in report["policies"])
    assert set(report["targets"]) >= {"war_hit_rate_ge_cache_aware",
                                      "war_makespan_lt_cache_aware"}


@pytest.mark.parametrize(("argv", "message"), [
    (["--repeats", "0"], "--repeats must be an int >= 1, got 0"),
    (["--requests", "0"], "--requests must be an int >= 1, got 0"),
    (["--concurrency", "0"], "--concurrency must be distinct ints >= 1"),
    (["--affinities", "2"], "--affinities must be in [0, 1]"),
    (["--affinities", "nan"], "--affinities must be in [0, 1]"),
    (["--slices", "0"], "--slices must be an int >= 1, got 0"),
    (["--requests", "10", "--slices", "20"], "--slices (20) must be at most --requests (10)"),
    (["--group-size", "0"], "--group-size must be an int >= 1, got 0"),
    (["--group-turns", "0"], "--group-turns must be >= 1"),
    (["--rl-steps", "0"], "--rl-steps must be an int >= 1, got 0"),
    (["--no-rps", "--no-policies"], "--no-rps and --no-policies together leave nothing"),
])
def test_bad_values_are_usage_errors_before_any_work(
        argv: list[str], message: str, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    err = usage_error(load_script(), argv, ["run_router_rps", "run_policies"], monkeypatch,
                      capsys)
    assert f" error: {message}" in err.splitlines()[-1]  # one usage line, no traceback


def test_a_failed_run_is_one_error_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import runpy
    import sys

    from bench_scripts import BENCHMARKS

    import war.router.bench

    def fail(*_: object, **__: object) -> None:
        raise RuntimeError("replica0 not ready within 120 s")

    # the script is run as a program: it imports this afresh, patched
    monkeypatch.setattr(war.router.bench, "run_policies", fail)
    monkeypatch.setattr(sys, "argv", ["bench_router.py", "--quick", "--no-rps", "--json",
                                      str(tmp_path / "out.json")])
    with pytest.raises(SystemExit) as e:
        runpy.run_path(str(BENCHMARKS / "router" / "bench_router.py"), run_name="__main__")
    assert e.value.code == "bench_router: error: replica0 not ready within 120 s"
    assert not (tmp_path / "out.json").exists()
