"""The in-process router CPU benchmark (benchmarks/router/bench_path_cpu.py)."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import pytest
from bench_scripts import load_benchmark

from war.backends import h1


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return load_benchmark("router", "bench_path_cpu")


@pytest.mark.parametrize("api", ["sglang", "war"])
def test_writes_a_row_per_policy_and_affinity(bench: ModuleType, api: str, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    before = h1.Pool.request
    out = tmp_path / "cpu.json"
    assert bench.main(["--policies", "war", "least_load", "--api", api, "--affinities", "0",
                       "0.9", "--requests", "2500", "--json", str(out)]) == 0
    assert h1.Pool.request is before  # the stand-in is gone again
    report = json.loads(out.read_text())
    rows = report["rows"]
    assert [(r["policy"], r["affinity"]) for r in rows] == [
        ("war", 0.0), ("least_load", 0.0), ("war", 0.9), ("least_load", 0.9)]
    assert all(r["api"] == api and r["cpu_us_per_request"] > 0 and r["windows"] == 1
               for r in rows)
    assert capsys.readouterr().out.startswith(f"bench_path_cpu ({api}): ")


def test_answers_stand_in_for_both_apis(bench: ModuleType) -> None:
    import asyncio

    import orjson

    async def go() -> None:
        pool = h1.Pool("127.0.0.1", 9)
        sg = await bench.instant_answer(pool, "POST", "/generate", body=orjson.dumps(
            {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}}),
            timeout_s=1, connect_timeout_s=1)
        assert orjson.loads(sg.body)["output_ids"] == [1, 2]
        war = await bench.instant_answer(pool, "POST", "/v1/completions", body=orjson.dumps(
            {"prompt": [4, 5, 6], "max_tokens": 5}), timeout_s=1, connect_timeout_s=1)
        assert orjson.loads(war.body)["choices"][0]["token_ids"] == [4, 5, 6]

    asyncio.run(go())


def test_a_last_partial_window_is_not_timed(bench: ModuleType, tmp_path: Path) -> None:
    out = tmp_path / "cpu.json"
    assert bench.main(["--policies", "war", "--requests", "3001", "--affinities", "0",
                       "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["windows"] == 2  # windows 4 and 5; the one request after them is not timed


@pytest.mark.parametrize("argv", [["--requests", "100"], ["--affinities", "1.5"],
                                  ["--policies", "nope"], ["--api", "vllm"]])
def test_bad_arguments_are_refused(bench: ModuleType, argv: list[str]) -> None:
    with pytest.raises(SystemExit) as e:
        bench.main(argv)
    assert e.value.code == 2
