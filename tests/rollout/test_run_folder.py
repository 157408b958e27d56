"""A rollout run's folder: the settings its trajectories were made under (a resume
under other settings is refused before any work), end-of-run files written atomically,
and output paths checked before any generation."""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import io
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from war.cli.main import main
from war.outputs import write_bytes_atomic
from war.rollout import run as run_mod
from war.rollout.agent import AgentConfig
from war.rollout.fingerprint import model_fingerprint
from war.rollout.run import (
    SETTINGS_FILE,
    RunConfig,
    load_run_config,
    settings_changes,
    trajectory_settings,
)
from war.rollout.trajectory import read_jsonl


def _write_config(tmp_path: Path, policy: Path, **changes: Any) -> Path:
    """A tiny run's config file (one step, two tasks, one sample each), with
    ``changes`` merged in (``agent`` and ``engine`` one level deep)."""
    raw: dict[str, Any] = {
        "name": "r", "model": str(policy), "replicas": 1, "tasks_per_step": 2,
        "group_size": 1, "steps": 1, "output_dir": str(tmp_path / "runs"),
        "agent": {"max_turns": 1, "max_tokens_per_turn": 4},
        "engine": {"kv_cache_bytes": 8_000_000}}
    for key, value in changes.items():
        if key in ("agent", "engine"):
            raw[key] = {**raw[key], **value}
        else:
            raw[key] = value
    path = tmp_path / "run.json"
    path.write_text(json.dumps(raw))
    return path


def _no_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """From now on, loading a model (the work before any generation) fails the test."""
    def no_model(*_a: Any, **_k: Any) -> Any:
        raise AssertionError("a model was loaded: the run was not refused up front")

    monkeypatch.setattr(run_mod, "make_replicas", no_model)


def _run(config: Path, *more: str) -> int:
    return main(["rollout", "--config", str(config), "--quiet", *more])


# ---------------------------------------------------------------- recorded settings


def test_the_settings_file_records_what_determines_trajectories(
        tmp_path: Path, random_policy: Path) -> None:
    config = _write_config(tmp_path, random_policy)
    assert _run(config) == 0
    recorded = json.loads((tmp_path / "runs" / "r" / SETTINGS_FILE).read_text())
    assert recorded == trajectory_settings(load_run_config(config))
    assert recorded == {
        "format": 1, "model": str(random_policy.resolve()),
        "model_fingerprint": model_fingerprint(random_policy),
        "envs": ["calculator", "sqlite", "files"], "task_pool": 4, "tasks_per_step": 2,
        "group_size": 1, "seed": 0,
        "agent": {"max_turns": 1, "max_tokens_per_turn": 4, "max_total_tokens": 2048,
                  "temperature": 0.7, "top_p": 1.0, "top_k": 0},
        "engine": {"dtype": "float32", "max_model_len": None}}


def test_settings_that_change_only_speed_are_not_recorded() -> None:
    base = RunConfig()
    faster = dataclasses.replace(
        base, name="other", output_dir="elsewhere", steps=9, replicas=4, torch_threads=2,
        agent=dataclasses.replace(base.agent, send_only_new_tokens=False),
        engine=dataclasses.replace(base.engine, spec_mode="off", kv_cache_bytes=1 << 20,
                                   max_num_seqs=3, seed=5))
    assert trajectory_settings(faster) == trajectory_settings(base)
    hotter = dataclasses.replace(base, agent=AgentConfig(temperature=1.0), seed=3)
    assert settings_changes(trajectory_settings(base), trajectory_settings(hotter)) == [
        "agent.temperature: 0.7 -> 1.0", "seed: 0 -> 3"]
    # an integral temperature is the same setting as its float
    assert settings_changes({"t": 1}, {"t": 1.0}) == []
    assert settings_changes({"a": {"b": 1}}, {"c": 2}) == [
        "a.b: 1 -> (not recorded)", "c: (not recorded) -> 2"]


def test_resume_under_changed_settings_is_refused_before_any_work(
        tmp_path: Path, random_policy: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch,
        make_random_policy: Callable[[Path, int], Path]) -> None:
    assert _run(_write_config(tmp_path, random_policy)) == 0
    run_dir = tmp_path / "runs" / "r"
    before = {p.name: p.read_bytes() for p in run_dir.iterdir()}
    other_policy = make_random_policy(tmp_path / "other-policy", 1)
    _no_model(monkeypatch)
    capsys.readouterr()
    cases: list[tuple[dict[str, Any], list[str]]] = [
        ({"agent": {"temperature": 1.0}}, ["agent.temperature: 0.7 -> 1.0"]),
        ({"agent": {"top_p": 0.9}}, ["agent.top_p: 1.0 -> 0.9"]),
        ({"agent": {"max_tokens_per_turn": 8}}, ["agent.max_tokens_per_turn: 4 -> 8"]),
        ({"seed": 7}, ["seed: 0 -> 7"]),
        ({"group_size": 2}, ["group_size: 1 -> 2"]),
        ({"envs": ["calculator"]},
         ['envs: ["calculator", "sqlite", "files"] -> ["calculator"]']),
        ({"model": str(other_policy)},
         [f'model: "{random_policy.resolve()}" -> "{other_policy.resolve()}"']),
        ({"engine": {"dtype": "float64"}, "agent": {"max_total_tokens": 512}},
         ["agent.max_total_tokens: 2048 -> 512", 'engine.dtype: "float32" -> "float64"']),
    ]
    for changes, shown in cases:
        assert _run(_write_config(tmp_path, random_policy, **changes)) == 1, changes
        captured = capsys.readouterr()
        err = captured.err
        assert err.startswith("war: error: ") and "Traceback" not in err, err
        for line in shown:
            assert line in err, (line, err)
        assert "use a new run folder" in err and str(run_dir / "trajectories.jsonl") in err
        assert "resuming" not in captured.out  # refused before saying it reuses them
        # nothing was written, replaced or generated
        assert {p.name: p.read_bytes() for p in run_dir.iterdir()} == before
    # the CLI's own options are settings too
    assert _run(_write_config(tmp_path, random_policy), "--seed", "2") == 1
    assert "seed: 0 -> 2" in capsys.readouterr().err


def test_the_library_run_refuses_changed_settings_too(
        tmp_path: Path, random_policy: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = load_run_config(_write_config(tmp_path, random_policy))
    assert _run(_write_config(tmp_path, random_policy)) == 0
    _no_model(monkeypatch)
    hotter = dataclasses.replace(cfg, agent=dataclasses.replace(cfg.agent, temperature=0.2))
    with pytest.raises(ValueError, match=r"agent\.temperature: 0\.7 -> 0\.2"):
        asyncio.run(run_mod.run_rollout(hotter))


def test_resume_with_settings_that_change_only_speed(
        tmp_path: Path, random_policy: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert _run(_write_config(tmp_path, random_policy)) == 0
    path = tmp_path / "runs" / "r" / "trajectories.jsonl"
    settings = (tmp_path / "runs" / "r" / SETTINGS_FILE).read_bytes()
    capsys.readouterr()
    faster = _write_config(tmp_path, random_policy, replicas=2, steps=2,
                           agent={"send_only_new_tokens": False},
                           engine={"spec_mode": "off", "kv_cache_bytes": 9_000_000})
    assert main(["rollout", "--config", str(faster)]) == 0  # (and progress bars shown)
    out = " ".join(capsys.readouterr().out.split())
    assert "resuming" in out and "2 trajectories already in trajectories.jsonl" in out
    assert len(read_jsonl(path)) == 4  # step 0 reused, step 1 generated
    assert (tmp_path / "runs" / "r" / SETTINGS_FILE).read_bytes() == settings


def test_a_folder_of_an_older_run_without_settings_resumes_as_before(
        tmp_path: Path, random_policy: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert _run(_write_config(tmp_path, random_policy)) == 0
    settings = tmp_path / "runs" / "r" / SETTINGS_FILE
    settings.unlink()  # as a run before the file existed left it
    capsys.readouterr()
    assert _run(_write_config(tmp_path, random_policy, agent={"temperature": 1.0})) == 0
    assert "resuming" in " ".join(capsys.readouterr().out.split())
    # from now on the folder says which settings it resumes under
    assert json.loads(settings.read_text())["agent"]["temperature"] == 1.0


def test_a_folder_without_trajectories_takes_new_settings(
        tmp_path: Path, random_policy: Path) -> None:
    """A run stopped before its first trajectory left settings but nothing to reuse."""
    assert _run(_write_config(tmp_path, random_policy)) == 0
    (tmp_path / "runs" / "r" / "trajectories.jsonl").write_bytes(b"")
    assert _run(_write_config(tmp_path, random_policy, seed=4)) == 0
    assert json.loads((tmp_path / "runs" / "r" / SETTINGS_FILE).read_text())["seed"] == 4


def test_a_demo_with_other_settings_starts_afresh(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["demo", "--steps", "1", "--tasks", "1", "--output-dir", str(tmp_path), "--quiet"]
    assert main([*argv, "--group-size", "2"]) == 0
    run_dir = tmp_path / "demo"
    first = (run_dir / SETTINGS_FILE).read_bytes()
    assert main([*argv, "--group-size", "1"]) == 0  # not refused: a demo never resumes
    assert "this run starts afresh" in " ".join(capsys.readouterr().out.split())
    assert (run_dir / "run_settings.previous.json").read_bytes() == first  # with its data
    assert json.loads((run_dir / SETTINGS_FILE).read_text())["group_size"] == 1
    assert len(read_jsonl(run_dir / "trajectories.jsonl")) == 1


# ---------------------------------------------------------------- atomic end-of-run files


class _DiskFull:
    """A file whose first write stores half of its data, then fails (disk full)."""

    def __init__(self, f: Any) -> None:
        self._f = f

    def write(self, data: Any) -> int:
        self._f.write(data[:len(data) // 2])
        self._f.flush()
        raise OSError(errno.ENOSPC, "No space left on device")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)

    def __enter__(self) -> _DiskFull:
        return self

    def __exit__(self, *exc: object) -> None:
        self._f.close()


def _names(file: Any) -> str:
    if isinstance(file, int):  # (os.fdopen: the name the descriptor was opened under)
        return os.readlink(f"/proc/self/fd/{file}")
    return os.fspath(file) if isinstance(file, (str, os.PathLike)) else ""


def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc (Linux)")
def test_a_crash_while_writing_summary_json_keeps_the_earlier_one(
        tmp_path: Path, random_policy: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    config = _write_config(tmp_path, random_policy)
    assert _run(config) == 0
    summary = tmp_path / "runs" / "r" / "summary.json"
    before = summary.read_bytes()
    real_open = io.open

    def failing_open(file: Any, *args: Any, **kwargs: Any) -> Any:
        f = real_open(file, *args, **kwargs)
        return _DiskFull(f) if "summary.json" in _names(file) else f

    monkeypatch.setattr(io, "open", failing_open)
    assert _run(config) == 1
    assert "No space left on device" in capsys.readouterr().err
    monkeypatch.undo()
    assert summary.read_bytes() == before  # whole, not half of the new one
    assert json.loads(before)["steps"]
    assert _leftovers(summary.parent) == []  # (the temporary file is removed)


def test_a_crash_while_writing_report_png_keeps_the_earlier_one(
        tmp_path: Path, random_policy: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    from matplotlib.figure import Figure

    config = _write_config(tmp_path, random_policy)
    assert _run(config) == 0
    report = tmp_path / "runs" / "r" / "report.png"
    before = report.read_bytes()
    real_savefig = Figure.savefig

    def crashing_savefig(self: Figure, fname: Any, **kwargs: Any) -> None:
        buf = io.BytesIO()
        real_savefig(self, buf, **{"format": "png", **kwargs})
        half = buf.getvalue()[:len(buf.getvalue()) // 2]
        if isinstance(fname, (str, os.PathLike)):
            Path(fname).write_bytes(half)
        else:
            fname.write(half)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Figure, "savefig", crashing_savefig)
    assert _run(config) == 1
    assert "No space left on device" in capsys.readouterr().err
    assert report.read_bytes() == before
    assert _leftovers(report.parent) == []


def test_write_bytes_atomic(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "report.png"
    write_bytes_atomic(target, b"one")
    assert target.read_bytes() == b"one"
    old_inode = target.stat().st_ino
    with open(target, "rb") as reader:  # a reader of the old file keeps all of it
        write_bytes_atomic(target, b"two, longer")
        assert reader.read() == b"one"
    assert target.read_bytes() == b"two, longer" and target.stat().st_ino != old_inode

    def no_rename(*_a: Any) -> None:
        raise OSError(errno.EIO, "I/O error")

    monkeypatch.setattr(os, "replace", no_rename)
    with pytest.raises(OSError, match="I/O error"):
        write_bytes_atomic(target, b"three")
    assert target.read_bytes() == b"two, longer"
    assert _leftovers(tmp_path) == []


# ---------------------------------------------------------------- output paths up front


@pytest.mark.parametrize("name", ["summary.json", "report.png", "trajectories.parquet",
                                  "trajectories.jsonl", SETTINGS_FILE])
def test_a_folder_where_an_output_file_goes_is_refused_before_any_work(
        tmp_path: Path, random_policy: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    in_the_way = tmp_path / "runs" / "r" / name
    in_the_way.mkdir(parents=True)
    _no_model(monkeypatch)
    assert _run(_write_config(tmp_path, random_policy)) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"war: error: {in_the_way} is a folder"), err
    assert "Traceback" not in err
    # nothing was generated or recorded
    assert sorted(p.name for p in in_the_way.parent.iterdir()) == [name]


def test_the_library_run_checks_its_output_paths_up_front(
        tmp_path: Path, random_policy: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = load_run_config(_write_config(tmp_path, random_policy))
    (tmp_path / "runs" / "r" / "summary.json").mkdir(parents=True)
    _no_model(monkeypatch)
    with pytest.raises(ValueError, match=r"summary\.json is a folder"):
        asyncio.run(run_mod.run_rollout(cfg))
    assert not (tmp_path / "runs" / "r" / "trajectories.jsonl").exists()


def test_a_demo_checks_where_it_moves_the_earlier_run(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "demo" / "trajectories.previous.jsonl").mkdir(parents=True)
    _no_model(monkeypatch)
    assert main(["demo", "--steps", "1", "--tasks", "1", "--output-dir", str(tmp_path),
                 "--quiet"]) == 1
    assert "trajectories.previous.jsonl is a folder" in capsys.readouterr().err
