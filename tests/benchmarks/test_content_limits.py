"""The speculator's content-limit benchmark: its measure on strings with known answers,
and its command line on bundled trajectories."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import pytest
from bench_scripts import load_benchmark

pytest.importorskip("war.spec._C", reason="native core war.spec._C is not built")

from war import data


def load_script() -> ModuleType:
    return load_benchmark("spec", "content_limits")


def test_available_counts_what_follows_the_context_end() -> None:
    limits = load_script()
    text = limits._Text(depth=12)
    text.history.append(0, [1, 2, 3, 4, 5])
    text.own.append(0, [9, 1, 2])
    ctx, truth = [9, 1, 2], [3, 4, 7]
    # "3 4" follows "1 2" in the history; "7" never follows "3 4"; "9 1 2 3" occurs nowhere
    assert [text.available(ctx, truth, j, 0) for j in (0, 1, 2, 3)] == [2, 2, 2, 0]
    # the trajectory's own text counts too: "9 1 2" is in it, "1 2 6" nowhere
    assert text.available([5, 9], [1, 2, 6], 1, 0) == 2
    assert text.available([5, 9], [1, 2, 6], 0, 0) == 2
    assert text.available(ctx, [8], 0, 0) == 0  # an unseen token


def test_the_command_writes_consistent_figures(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sample = tmp_path / "sample.jsonl.gz"
    sample.write_bytes(data.resource(data.SAMPLE_TRACES).read_bytes())
    out = tmp_path / "limits.json"
    limits = load_script()
    assert limits.main(["--traces", str(sample), "--limit", "4", "--json", str(out)]) == 0
    (line,) = capsys.readouterr().out.strip().splitlines()
    assert line.startswith("content_limits mode=path order=trial-major sample.jsonl.gz: ")
    report = json.loads(out.read_text(encoding="utf-8"))
    (figures,) = report["per_file"].values()
    assert figures["steps"] > 0
    avail = [figures["available"][str(j)] for j in limits.CONTEXT_LENGTHS]
    assert avail == sorted(avail, reverse=True)  # a longer context match never finds more
    assert 0.0 < figures["accepted"] <= figures["available"]["1"] <= 8
    shares = [figures["missed_share"][str(j)] for j in limits.CONTEXT_LENGTHS]
    assert shares[0] == 0.0 and all(0.0 <= s <= 1.0 for s in shares)
    assert shares == sorted(shares)


def test_bad_arguments_are_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    limits = load_script()
    for argv in (["--cap", "0"], ["--limit", "0"]):
        with pytest.raises(SystemExit) as e:
            limits.main(argv)
        assert e.value.code == 2
        assert "must be >= 1" in capsys.readouterr().err
