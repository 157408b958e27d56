"""The `war` command line on the bundled sample (needs the native core)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

pytest.importorskip("war.spec._C", reason="native core war.spec._C is not built")

from war.cli.main import main  # after the skip: it imports the native core
from war.spec import SpecConfig


def test_spec_replay_prints_and_writes_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "report.json"
    assert main(["spec", "replay", "--limit", "2", "--mode", "tree", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "tokens per step" in printed and "acceptance rate" in printed
    report = json.loads(out.read_text(encoding="utf-8"))
    assert report["num_trajectories"] == 2
    assert report["config"] == dataclasses.asdict(SpecConfig.tree_preset())
    assert report["tokens_per_step"] >= 1.0
    assert "propose_us_p50_batched64" in report and report["batch_size"] == 2
    assert list(report["per_file"]) == ["sample_traces.jsonl.gz"]


def test_demo_runs_four_configs(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["spec", "demo", "--limit", "2", "--order", "shuffled", "--seed", "1"]) == 0
    printed = capsys.readouterr().out
    for config in ("path", "path, baseline", "tree", "tree, baseline"):
        assert config in printed


def test_bad_input_is_one_error_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"task_id": "t"}\n', encoding="utf-8")
    assert main(["spec", "replay", "--traces", str(bad)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("war: error: ") and f"{bad}:1: record lacks key(s)" in err
    assert main(["spec", "replay", "--traces", str(tmp_path / "none.jsonl")]) == 1
    assert "trace file not found" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["spec", "replay", "--mode", "bush"])


def test_unusable_paths_are_one_error_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A folder given for a file (or the reverse) is refused before any work starts."""
    (tmp_path / "file").write_text("x")
    cases = [
        (["spec", "replay", "--traces", str(tmp_path)], f"trace file {tmp_path} is not a file"),
        (["spec", "replay", "--limit", "1", "--json", str(tmp_path)], "is a folder"),
        (["train-policy", "--out", str(tmp_path / "file")], "exists and is not a folder"),
        (["train-policy", "--out", str(tmp_path / "m"), "--json", str(tmp_path)], "is a folder"),
        (["rollout", "--config", str(tmp_path)], "Is a directory"),
    ]
    for argv, message in cases:
        assert main(argv) == 1, argv
        err = capsys.readouterr().err
        assert err.startswith("war: error: ") and message in err, (argv, err)
        assert "Traceback" not in err
    assert not (tmp_path / "m").exists()  # train-policy stopped before training
