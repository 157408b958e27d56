"""The speculator benchmark's command-line interface, on two bundled trajectories."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import pytest
from bench_scripts import load_benchmark

pytest.importorskip("war.spec._C", reason="native core war.spec._C is not built")

from war import data

KEYS = (
    "tokens_per_step",
    "acceptance_rate",
    "mean_draft_len",
    "propose_us_p50_batched64",
    "append_us_p50",
    "response_end_us_p50",
    "turn_start_us_p50",
    "bytes_per_cached_token",
)


def load_script() -> ModuleType:
    return load_benchmark("spec", "bench_replay")


@pytest.mark.parametrize("mode", ["path", "tree"])
def test_bench_writes_the_interface_keys(
    tmp_path: Path, mode: str, capsys: pytest.CaptureFixture[str]
) -> None:
    sample = tmp_path / "sample.jsonl.gz"
    sample.write_bytes(data.resource(data.SAMPLE_TRACES).read_bytes())
    out = tmp_path / "out.json"
    bench = load_script()
    args = ["--traces", str(sample), "--mode", mode, "--order", "shuffled", "--limit", "2",
            "--baseline", "--json", str(out)]
    assert bench.main(args) == 0
    (line,) = capsys.readouterr().out.strip().splitlines()
    assert line.startswith(f"bench_replay mode={mode} order=shuffled trajectories=2")
    report = json.loads(out.read_text(encoding="utf-8"))
    for key in KEYS:
        assert isinstance(report[key], float), key
    assert report["tokens_per_step"] >= 1.0
    assert report["baseline"]["config"]["group_weight"] == 0.0
    assert set(report["ratios"]) >= {"tokens_per_step", "acceptance_rate"}
