"""Rollout runs: config files, step summaries, a small run over two local replicas
with a random policy, and the `war rollout` command."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
from rollout_fakes import RecordingReplica

from war.cli.main import main
from war.rollout.run import (
    RunConfig,
    load_run_config,
    run_config_from_dict,
    step_tasks,
    summarize,
    task_pool,
)
from war.rollout.trajectory import JsonlWriter, Trajectory, read_jsonl, read_parquet


def test_config_files_and_errors(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("name: x\nsteps: 2\nenvs: [calculator]\nagent: {max_turns: 3}\n"
                    "engine: {spec_mode: off, block_size: 8, spec: {max_spec_tokens: 4}}\n")
    cfg = load_run_config(path)
    assert cfg.steps == 2 and cfg.envs == ("calculator",) and cfg.agent.max_turns == 3
    assert cfg.engine.spec_mode == "off" and cfg.engine.block_size == 8
    assert cfg.engine.spec.max_spec_tokens == 4
    assert load_run_config(path, steps=5).steps == 5
    with pytest.raises(ValueError, match="unknown keys"):
        run_config_from_dict({"stepz": 1})
    with pytest.raises(ValueError, match="agent: unknown keys"):
        run_config_from_dict({"agent": {"turns": 1}})
    with pytest.raises(ValueError, match="unknown environments"):
        RunConfig(envs=("nope",))
    with pytest.raises(ValueError, match="spec_mode"):
        run_config_from_dict({"engine": {"spec_mode": "sometimes"}})
    bad = tmp_path / "bad.yaml"
    bad.write_text("steps: [1\n")
    with pytest.raises(ValueError, match="not valid"):
        load_run_config(bad)
    upper = tmp_path / "RUN.YAML"  # the suffix's case does not make it JSON
    upper.write_text("name: up\nsteps: 4\n")
    assert load_run_config(upper).steps == 4
    as_json = tmp_path / "run.json"
    as_json.write_text('{"steps": 3}')
    assert load_run_config(as_json).steps == 3


def test_config_files_of_other_suffixes(tmp_path: Path) -> None:
    """A file named neither .yaml/.yml nor .json is read as JSON when it is JSON (its
    meaning as JSON: PyYAML would read 1e5 as a string) and as YAML otherwise."""
    as_json = tmp_path / "run.conf"
    as_json.write_text('{"steps": 3,\t"name": "j", "agent": {"temperature": 1e-1}}')
    cfg = load_run_config(as_json)
    assert (cfg.steps, cfg.name, cfg.agent.temperature) == (3, "j", 0.1)
    as_yaml = tmp_path / "run.txt"
    as_yaml.write_text("name: y\nsteps: 2\nenvs: [calculator]\nagent: {max_turns: 3}\n")
    cfg = load_run_config(as_yaml)
    assert (cfg.name, cfg.steps, cfg.envs, cfg.agent.max_turns) == ("y", 2, ("calculator",), 3)
    no_suffix = tmp_path / "run"
    no_suffix.write_text("steps: 5\n")
    assert load_run_config(no_suffix).steps == 5
    neither = tmp_path / "bad.conf"
    neither.write_text("steps: [1\n")
    with pytest.raises(ValueError, match=r"bad\.conf: neither valid JSON .* nor valid YAML"):
        load_run_config(neither)
    # .json is JSON only, and the error says why a YAML text failed
    yaml_in_json = tmp_path / "run.json"
    yaml_in_json.write_text("steps: 2\n")
    with pytest.raises(ValueError, match=r"run\.json: not valid JSON \(read as JSON for its "
                       r"\.json suffix; a YAML file is named \.yaml or \.yml\)"):
        load_run_config(yaml_in_json)


def test_replicas_out_of_range_are_refused_while_parsing(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--replicas`` outside 1..256 is argparse's error naming the option and the range
    (exit status 2, as the commands' other argument errors), before any work."""
    config = tmp_path / "run.yaml"
    config.write_text("steps: 1\n")
    for command in (["demo"], ["rollout", "--config", str(config)]):
        for bad in ("0", "-3", "257", str(10**6), "two"):
            with pytest.raises(SystemExit) as exit_info:
                main([*command, "--replicas", bad, "--output-dir", str(tmp_path / "runs")])
            assert exit_info.value.code == 2
            err = capsys.readouterr().err
            assert err.splitlines()[-1] == (f"war {command[0]}: error: argument --replicas: "
                                            f"must be an int from 1 to 256, got {bad!r}"), err
    assert not (tmp_path / "runs").exists()
    # in a config file: one `war: error:` line, exit status 1, as its other settings
    config.write_text("replicas: 100000\n")
    assert main(["rollout", "--config", str(config), "--output-dir",
                 str(tmp_path / "runs")]) == 1
    err = capsys.readouterr().err
    assert err == (f"war: error: {config}: replicas must be an int from 1 to 256, "
                   "got 100000\n")
    assert not (tmp_path / "runs").exists()


def test_tasks_recur_across_steps() -> None:
    cfg = RunConfig(tasks_per_step=6, task_pool=9, envs=("calculator", "files"))
    pool = task_pool(cfg)
    assert len(pool) == 9 and len({t.task_id for t in pool}) == 9
    assert {t.env for t in pool} == {"calculator", "files"}
    a, b = step_tasks(pool, 6, 0, 0), step_tasks(pool, 6, 0, 1)
    assert a == step_tasks(pool, 6, 0, 0) and a != b
    assert {t.task_id for t in a} & {t.task_id for t in b}


def test_summary_of_a_step() -> None:
    def traj(i: int, reward: float, env: str) -> Trajectory:
        return Trajectory(
            trajectory_id=f"t{i}", group_id="g", task_id="k", env=env, rl_step=0,
            sample_index=i, token_ids=[1, 2, 3, 4], loss_mask=[0, 1, 1, 1],
            logprobs=[0.0, -1.0, -1.0, -1.0], reward=reward, num_turns=2,
            timings={"start": 10.0 + i, "end": 12.0 + i},
            spec={"forward_passes": 2.0, "draft_tokens": 4.0, "accepted_tokens": 1.0,
                  "prompt_tokens": 10.0, "cached_prompt_tokens": 5.0})

    s = summarize(0, [traj(0, 1.0, "a"), traj(1, 0.0, "a"), traj(2, 1.0, "b")])
    assert s.makespan_s == 4.0 and s.generated_tokens == 9
    assert s.tokens_per_s == 9 / 4 and s.tokens_per_step == 9 / 6
    assert s.acceptance == 0.25 and s.prefix_hit_rate == 0.5
    assert s.success_by_env == {"a": 0.5, "b": 1.0}
    assert s.mean_reward == pytest.approx(2 / 3)
    assert s.num_reused == 0

    # a resumed step: trajectory t0 was finished by an earlier run, long before
    early = dataclasses.replace(traj(0, 1.0, "a"), timings={"start": -5000.0, "end": -4990.0})
    s = summarize(0, [early, traj(1, 0.0, "a"), traj(2, 1.0, "b")], reused={"t0"})
    assert s.num_reused == 1 and s.num_trajectories == 3
    assert s.makespan_s == 3.0 and s.tokens_per_s == 6 / 3  # this run's two only
    assert s.generated_tokens == 9 and s.tokens_per_step == 9 / 6  # every trajectory
    assert s.mean_reward == pytest.approx(2 / 3)
    s = summarize(0, [early], reused={"t0"})  # all reused: nothing to time
    assert s.makespan_s == 0.0 and s.tokens_per_s == 0.0 and s.num_reused == 1


@pytest.mark.filterwarnings("error::UserWarning")  # (the report of a resumed run plots nothing)
def test_war_rollout_command(tmp_path: Path, random_policy: Path,
                             capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "run.yaml"
    config.write_text(json.dumps({
        "name": "tiny", "model": str(random_policy), "replicas": 2, "tasks_per_step": 3,
        "group_size": 2, "steps": 2, "output_dir": str(tmp_path / "runs"),
        "agent": {"max_turns": 2, "max_tokens_per_turn": 8},
        "engine": {"kv_cache_bytes": 8_000_000}}))
    config = config.rename(tmp_path / "run.json")
    assert main(["rollout", "--config", str(config), "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "WAR rollout: tiny" in out and "tok/step" in out
    run_dir = tmp_path / "runs" / "tiny"
    trajs = read_jsonl(run_dir / "trajectories.jsonl")
    assert len(trajs) == 12 and {t.rl_step for t in trajs} == {0, 1}
    assert len(read_parquet(run_dir / "trajectories.parquet")) == 12
    summary = json.loads((run_dir / "summary.json").read_text())
    assert [s["rl_step"] for s in summary["steps"]] == [0, 1]
    assert (run_dir / "report.png").read_bytes()[:4] == b"\x89PNG"
    # run again: the trajectories written are reused, and the command says so
    before = (run_dir / "trajectories.jsonl").read_bytes()
    assert main(["rollout", "--config", str(config), "--quiet"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "resuming" in out and "12 trajectories already in trajectories.jsonl are reused" in out
    assert "12 trajectories reused from the stopped run" in out
    assert (run_dir / "trajectories.jsonl").read_bytes() == before
    summary = json.loads((run_dir / "summary.json").read_text())
    assert [(s["num_reused"], s["makespan_s"]) for s in summary["steps"]] == [(6, 0.0), (6, 0.0)]
    assert main(["rollout", "--config", str(tmp_path / "missing.yaml")]) == 1


def test_war_demo_starts_afresh_and_keeps_the_earlier_run(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["demo", "--steps", "1", "--tasks", "1", "--group-size", "2",
            "--output-dir", str(tmp_path), "--quiet"]
    assert main(argv) == 0
    run_dir = tmp_path / "demo"
    first = (run_dir / "trajectories.jsonl").read_bytes()
    assert len(read_jsonl(run_dir / "trajectories.jsonl")) == 2
    assert "starts afresh" not in " ".join(capsys.readouterr().out.split())
    assert main(argv) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "trajectories.previous.jsonl" in out and "this run starts afresh" in out
    assert (run_dir / "trajectories.previous.jsonl").read_bytes() == first
    again = read_jsonl(run_dir / "trajectories.jsonl")  # generated again, not reused
    assert len(again) == 2 and all(t.rl_step == 0 for t in again)


@pytest.mark.parametrize(("raw", "message"), [
    ({"name": 2024}, "name must be a non-empty string, got 2024"),
    ({"name": ""}, "name must be a non-empty string"),
    ({"name": ".."}, "name must be a folder name"),
    ({"name": "."}, "name must be a folder name"),
    ({"name": "../elsewhere"}, "name must be a folder name"),
    ({"name": "a/b"}, "name must be a folder name"),
    ({"name": "a\\b"}, "name must be a folder name"),
    ({"output_dir": 7}, "output_dir must be a non-empty string"),
    ({"model": 5}, "model must be a model folder"),
    ({"envs": None}, "envs must be a list of environment names, got None"),
    ({"envs": 5}, "envs must be a list of environment names, got 5"),
    ({"envs": "calculator"}, "envs must be a list of environment names, got 'calculator'"),
    ({"envs": ["calculator", 3]}, r"envs must be environment names \(strings\), got \[3\]"),
    ({"envs": ["calculator", "files", "calculator"]},
     r"envs lists \['calculator'\] more than once"),
    ({"seed": 1.5}, "seed must be an int, got 1.5"),
    ({"seed": True}, "seed must be an int"),
    ({"task_pool": 33.5}, "task_pool must be an int or null, got 33.5"),
    ({"task_pool": "big"}, "task_pool must be an int or null, got 'big'"),
    ({"task_pool": True}, "task_pool must be an int"),
    ({"torch_threads": 1.5}, "torch_threads must be an int from 1 to 1024 or null"),
    ({"torch_threads": 0}, "torch_threads must be an int from 1 to 1024 or null, got 0"),
    ({"torch_threads": 1025}, "torch_threads must be an int from 1 to 1024"),
    ({"replicas": 0}, "replicas must be an int >= 1, got 0"),
    ({"replicas": 10**6}, "replicas must be an int from 1 to 256, got 1000000"),
    ({"agent": {"temperature": "hot"}}, "agent: temperature must be a number, got 'hot'"),
    ({"agent": {"top_p": "0.5"}}, "agent: top_p must be a number"),
    ({"agent": {"send_only_new_tokens": "no"}}, "agent: send_only_new_tokens must be true"),
    ({"agent": {"max_turns": 2.0}}, "agent: max_turns must be an int >= 1, got 2.0"),
    ({1: "x", "stepz": 2}, r"unknown keys \[1, .stepz.\]"),  # (keys of two types)
])
def test_config_values_of_the_wrong_type_are_refused(raw: dict[Any, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        run_config_from_dict(raw)


def test_config_objects_are_checked_too() -> None:
    assert RunConfig(envs=["calculator"]).envs == ("calculator",)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="more than once"):
        RunConfig(envs=("sqlite", "sqlite"))
    with pytest.raises(ValueError, match="agent must be an AgentConfig"):
        RunConfig(agent={"max_turns": 1})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="engine must be an EngineConfig"):
        RunConfig(engine=None)  # type: ignore[arg-type]


@pytest.mark.parametrize(("text", "message"), [
    ("name: 2024\n", "name must be a non-empty string, got 2024 (quote it"),
    ("envs: calculator\n", "envs must be a list of environment names"),
    ("envs: [calculator, calculator]\n", "envs lists ['calculator'] more than once"),
    ("task_pool: 33.5\n", "task_pool must be an int or null, got 33.5"),
    ("seed: 1.5\n", "seed must be an int, got 1.5"),
])
def test_bad_config_is_one_error_line_before_any_work(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, message: str) -> None:
    config = tmp_path / "run.yaml"
    config.write_text(text)
    out_dir = tmp_path / "runs"
    assert main(["rollout", "--config", str(config), "--output-dir", str(out_dir),
                 "--quiet"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"war: error: {config}: {message}"), err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert not out_dir.exists()  # refused before the run's folder (or a model) was made


def test_resume_message_counts_only_what_is_reused(
        tmp_path: Path, random_policy: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The file holds other steps' trajectories and a failed one: the resume message
    counts what the driver reuses (this run's steps, not failed), as the caption does."""
    config = tmp_path / "run.json"
    config.write_text(json.dumps({
        "name": "r", "model": str(random_policy), "replicas": 1, "tasks_per_step": 2,
        "group_size": 1, "steps": 2, "output_dir": str(tmp_path / "runs"),
        "agent": {"max_turns": 1, "max_tokens_per_turn": 4},
        "engine": {"kv_cache_bytes": 8_000_000}}))
    argv = ["rollout", "--config", str(config), "--quiet"]
    assert main(argv) == 0
    path = tmp_path / "runs" / "r" / "trajectories.jsonl"
    trajs = read_jsonl(path)
    assert len(trajs) == 4
    failed = next(t for t in trajs if t.rl_step == 0)  # as if its replica had died
    path.write_text("")
    with JsonlWriter(path) as writer:
        for t in trajs:
            writer.append(dataclasses.replace(t, finish_reason="error", error="boom")
                          if t is failed else t)
    capsys.readouterr()
    assert main([*argv, "--steps", "1"]) == 0  # step 0 only: 1 reused, 1 redone
    out = " ".join(capsys.readouterr().out.split())
    assert "1 trajectories already in trajectories.jsonl are reused" in out, out
    assert "1 trajectories reused from the stopped run" in out


def test_a_failed_start_leaves_no_replica_running(
        tmp_path: Path, random_policy: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The run's own replicas are closed when one of them fails to start (or anything
    else fails before the first step): none keeps its engine thread."""
    import asyncio

    from war.rollout import run as run_mod

    events: list[str] = []

    monkeypatch.setattr(run_mod, "make_replicas", lambda cfg, model: {
        "replica0": RecordingReplica("replica0", False, events),
        "replica1": RecordingReplica("replica1", True, events)})
    cfg = RunConfig(name="r", model=str(random_policy), output_dir=str(tmp_path))
    with pytest.raises(RuntimeError, match="replica1 cannot start"):
        asyncio.run(run_mod.run_rollout(cfg))
    assert events == ["start replica0", "close replica0", "close replica1"]
