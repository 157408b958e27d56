"""`war train-policy`: reports that could not be written after training, and refused or
failed starts that leave folders behind."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from war.cli.main import main


def _no_training(monkeypatch: pytest.MonkeyPatch) -> None:
    import war.train.policy as policy

    def fail(*_a: Any, **_k: Any) -> Any:
        raise AssertionError("training started before the arguments were checked")

    monkeypatch.setattr(policy, "train_policy", fail)


def _error(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    assert err.startswith("war: error: ") and err.count("\n") == 1
    return err


def test_a_report_named_as_a_folder_above_the_policy_is_refused_first(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    # making --out makes the --json path a folder: the report would be lost after training
    _no_training(monkeypatch)
    runs = tmp_path / "runs"
    assert main(["train-policy", "--out", str(runs / "policy"), "--json", str(runs)]) == 1
    assert "--json" in _error(capsys)
    assert not runs.exists()


def test_a_start_refused_for_another_models_folder_creates_nothing_in_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    _no_training(monkeypatch)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}\n")
    (model / "model-00001-of-00002.safetensors").write_text("x")
    assert main(["train-policy", "--out", str(model),
                 "--json", str(model / "reports" / "r.json")]) == 1
    assert "holds another model's files" in _error(capsys)
    assert sorted(p.name for p in model.iterdir()) == ["config.json",
                                                       "model-00001-of-00002.safetensors"]


def test_a_failed_training_run_leaves_no_empty_policy_folder(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # one task per environment: the prompts do not compress and the episodes do not fit
    out = tmp_path / "new" / "policy"
    assert main(["train-policy", "--out", str(out), "--tasks-per-env", "1", "--steps", "1",
                 "--eval-tasks", "0", "--json", str(tmp_path / "rep" / "r.json")]) == 1
    assert "longer than seq_len" in _error(capsys)
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_an_existing_policy_folder_is_kept_when_training_fails(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "policy"
    out.mkdir()
    assert main(["train-policy", "--out", str(out), "--tasks-per-env", "1", "--steps", "1",
                 "--eval-tasks", "0"]) == 1
    _error(capsys)
    assert out.is_dir()


def test_an_out_name_too_long_is_reported_for_the_option(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    _no_training(monkeypatch)
    out = tmp_path / ("x" * 300)
    assert main(["train-policy", "--out", str(out)]) == 1
    assert _error(capsys).startswith(f"war: error: --out {out}")
