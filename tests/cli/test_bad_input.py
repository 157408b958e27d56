"""The `war` commands refuse reports that would replace their own inputs, options that
would be ignored, and show a resumed step's progress (needs the native core)."""

from __future__ import annotations

import io
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from rich.console import Console

pytest.importorskip("war.spec._C", reason="native core war.spec._C is not built")

from cli_helpers import SYNTHETIC_EXPERIMENT

from war import data
from war.cli.main import main  # after the skip: it imports the native core


def _sample_traces(path: Path, n: int = 2) -> Path:
    """The first ``n`` trajectories of the bundled sample, as a plain JSONL file."""
    import gzip

    with data.resource(data.SAMPLE_TRACES).open("rb") as f:
        lines = gzip.decompress(f.read()).decode("utf-8").splitlines()
    path.write_text("\n".join(lines[:n]) + "\n", encoding="utf-8")
    return path


def _refused(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 1, argv
    err = capsys.readouterr().err
    assert err.startswith("war: error: ") and message in err, (argv, err)
    assert "Traceback" not in err


def test_spec_replay_json_over_a_trace_file_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    traces = _sample_traces(tmp_path / "t.jsonl")
    before = traces.read_bytes()
    for out in (traces, tmp_path / "sub" / ".." / "t.jsonl"):
        _refused(["spec", "replay", "--traces", str(traces), "--json", str(out)],
                 "is the --traces file", capsys)
    assert traces.read_bytes() == before  # the traces are intact


def test_sim_json_over_an_input_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    exp = tmp_path / "exp.yaml"
    exp.write_text(SYNTHETIC_EXPERIMENT, encoding="utf-8")
    _refused(["sim", "--config", str(exp), "--json", str(exp)], "is the --config file", capsys)
    assert exp.read_text(encoding="utf-8") == SYNTHETIC_EXPERIMENT
    # a trace experiment: its own trace file, and one given with --traces
    traces = _sample_traces(tmp_path / "tr.jsonl")
    before = traces.read_bytes()
    tex = tmp_path / "tex.yaml"
    tex.write_text(
        "traces: [tr.jsonl]\n"
        "workload: {kind: traces, rl_steps: 1, group_size: null, seed: 0}\n"
        "cost: {kind: linear, intercept_s: 0.01, per_token_s: 1.0e-5, kv_tokens: 65536}\n"
        "sim: {num_replicas: 1, max_tokens: 128}\n"
        "drafts: live\nloads: [1]\n"
        "configs: {rr: {policy: round_robin, spec_mode: \"off\"}}\n", encoding="utf-8")
    _refused(["sim", "--config", str(tex), "--json", str(traces)],
             "is the experiment's trace file", capsys)
    _refused(["sim", "--config", str(tex), "--traces", str(traces), "--json", str(traces)],
             "is the --traces file", capsys)
    assert traces.read_bytes() == before


def test_sim_traces_of_a_synthetic_workload_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--traces would be ignored: the synthetic workload reads no trace file."""
    exp = tmp_path / "exp.yaml"
    exp.write_text(SYNTHETIC_EXPERIMENT, encoding="utf-8")
    traces = _sample_traces(tmp_path / "t.jsonl")
    out = tmp_path / "out.json"
    _refused(["sim", "--config", str(exp), "--json", str(out), "--traces", str(traces)],
             "--traces: the experiment's workload is 'synthetic'", capsys)
    assert not out.exists()


def test_sim_configuration_named_twice_runs_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    exp = tmp_path / "exp.yaml"
    exp.write_text(SYNTHETIC_EXPERIMENT, encoding="utf-8")
    out = tmp_path / "out.json"
    assert main(["sim", "--config", str(exp), "--json", str(out), "--workers", "1",
                 "--configs", "rr", "rr"]) == 0
    capsys.readouterr()
    rows = json.loads(out.read_text(encoding="utf-8"))["results"]
    assert [(r["config"], r["requested_load"]) for r in rows] == [("rr", 1.0)]


def test_train_policy_json_over_a_policy_file_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The report would replace the new policy's config.json (or tokenizer.json...)."""
    import war.train.policy as policy

    def no_training(*_a: Any, **_k: Any) -> Any:
        raise AssertionError("training started")

    monkeypatch.setattr(policy, "train_policy", no_training)
    out = tmp_path / "m"
    for name in ("config.json", "tokenizer.json"):
        _refused(["train-policy", "--out", str(out), "--json", str(out / name)],
                 "is the --out policy file", capsys)
    assert not out.exists()  # refused before anything was written or trained


def test_rollout_refuses_an_unusable_run_folder_before_loading_a_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import war.rollout.run as run

    def no_model(*_a: Any, **_k: Any) -> Any:
        raise AssertionError("a model was loaded before the run folder was checked")

    monkeypatch.setattr(run, "make_replicas", no_model)
    (tmp_path / "file").write_text("x")
    _refused(["demo", "--output-dir", str(tmp_path / "file"), "--steps", "1", "--quiet"],
             "run folder", capsys)


def test_resumed_step_progress_counts_reused_trajectories(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A resumed step's bar starts at the trajectories reused from the file (the driver
    calls on_done only for those it generates): it ends at its total, not short of it."""
    import war.rollout.run as run
    from war.cli import rollout as cli_rollout
    from war.rollout.driver import trajectory_id
    from war.rollout.trajectory import JsonlWriter, Trajectory

    cfg = run.RunConfig(name="r", output_dir=str(tmp_path), steps=1, tasks_per_step=2,
                        group_size=2, replicas=1)
    tasks = [SimpleNamespace(task_id=f"t{i}", env="calculator") for i in range(2)]
    ids = [trajectory_id(0, t.task_id, g) for t in tasks for g in range(2)]
    (tmp_path / "r").mkdir()

    def traj(tid: str) -> Trajectory:
        task = tid.split("/")[1]
        return Trajectory(trajectory_id=tid, group_id=task, task_id=task, env="calculator",
                          rl_step=0, sample_index=int(tid[-1]), finish_reason="done").check()

    with JsonlWriter(tmp_path / "r" / "trajectories.jsonl") as w:
        for tid in ids[:3]:  # an earlier run finished three of the four
            w.append(traj(tid))

    class Replica:
        def load(self) -> Any:
            return SimpleNamespace(num_running=0, spec_tokens_per_seq=0.0)

        async def close(self) -> None:
            pass

    async def fake_rollout(cfg: Any, *, on_done: Any, on_step: Any, replicas: Any) -> str:
        on_step(0, tasks)
        on_done(traj(ids[3]))  # the only one generated now
        return "result"

    monkeypatch.setattr(run, "make_replicas", lambda *_a: {"replica0": Replica()})
    monkeypatch.setattr(run, "run_rollout", fake_rollout)
    buf = io.StringIO()
    console = Console(file=buf, width=120, force_terminal=False)
    from war import aio

    assert aio.run(cli_rollout._run_with_progress(cfg, console, quiet=False)) == "result"
    shown = buf.getvalue()
    assert "4/4" in shown and "1/4" not in shown.splitlines()[-1], shown
