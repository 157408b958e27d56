"""Trajectories: building, validation, dict round trips, durable JSONL and atomic Parquet."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from war.rollout.trajectory import (
    JsonlWriter,
    Trajectory,
    TrajectoryBuilder,
    completed_ids,
    read_jsonl,
    read_parquet,
    write_parquet,
)


def make(i: int = 0, **overrides: Any) -> Trajectory:
    b = TrajectoryBuilder()
    b.append_prompt([1, 2, 3 + i])
    b.append_sampled([7, 8], [-0.5, -1.25 - i])
    b.append_observation([9])
    b.append_sampled([10], [0.0])
    fields: dict[str, Any] = {
        "trajectory_id": f"step3/g{i // 2}/s{i % 2}", "group_id": f"g{i // 2}",
        "task_id": f"airline/{i}", "env": "airline", "rl_step": 3, "sample_index": i % 2,
        "reward": 1.0 - i, "num_turns": 2, "finish_reason": "done",
        "messages": [{"role": "user", "content": "ünï ✓ 🚀\n\"q\""},
                     {"role": "assistant", "content": "ok", "extra": [1, None]}],
        "timings": {"start": 1.5, "end": 3.0, "total": 1.5, "generation": 1.0, "tool": 0.25},
        "spec": {"draft_tokens": 12.0, "accepted": 5.0}, "weight_version": 7,
        "replica_ids": ["r0", "r1"],
    }
    fields.update(overrides)
    return b.build(**fields)


def test_builder_keeps_lists_consistent() -> None:
    traj = make()
    assert traj.token_ids == [1, 2, 3, 7, 8, 9, 10]
    assert traj.loss_mask == [0, 0, 0, 1, 1, 0, 1]
    assert traj.logprobs == [0.0, 0.0, 0.0, -0.5, -1.25, 0.0, 0.0]
    assert traj.num_sampled_tokens == 3 and traj.num_tokens == 7
    b = TrajectoryBuilder()
    b.append_prompt([1])
    b.append_observation([])
    b.append_sampled([2, 3], [-1.0, -2.0])
    assert b.segments == [("prompt", 0, 1), ("sampled", 1, 3)]
    assert len(b) == 3 and b.num_sampled_tokens == 2
    with pytest.raises(ValueError, match="2 token ids but 1 logprobs"):
        b.append_sampled([4, 5], [-1.0])
    with pytest.raises(ValueError, match="token ids must be ints"):
        b.append_prompt([True])
    with pytest.raises(ValueError, match="token ids must be ints"):
        b.append_prompt([1.0])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="not a token id"):
        b.append_observation([-1])
    with pytest.raises(ValueError, match="log-probability"):
        b.append_sampled([4], [0.5])
    with pytest.raises(ValueError, match="log-probability"):
        b.append_sampled([4], [float("nan")])
    assert len(b) == 3  # failed appends change nothing
    with pytest.raises(ValueError, match="comes from the builder"):
        b.build(token_ids=[1])
    with pytest.raises(ValueError, match="build"):
        b.build(trajectory_id="x")


@pytest.mark.parametrize(("change", "message"), [
    ({"loss_mask": [0, 0, 0, 1, 1, 0]}, "same length"),
    ({"logprobs": [0.0] * 8}, "same length"),
    ({"loss_mask": [0, 0, 0, 1, 2, 0, 1]}, "not 0 or 1"),
    ({"loss_mask": [0, 0, 0, 1, True, 0, 1]}, "not 0 or 1"),
    ({"logprobs": [0.0, -0.1, 0.0, -0.5, -1.25, 0.0, 0.0]}, "must be 0.0"),
    ({"logprobs": [0.0, 0.0, 0.0, float("-inf"), -1.25, 0.0, 0.0]}, "finite"),
    ({"token_ids": [1, 2, 3, 7, 8, 9, -10]}, "not a token id"),
    ({"finish_reason": "stop"}, "finish_reason"),
    ({"finish_reason": "error"}, "needs an error message"),
    ({"trajectory_id": ""}, "trajectory_id"),
    ({"rl_step": -1}, "rl_step"),
    ({"reward": float("nan")}, "reward"),
    ({"timings": {"total": "slow"}}, "timings"),
    ({"replica_ids": [0]}, "replica_ids"),
    ({"messages": ["hi"]}, "messages"),
])
def test_check_catches_inconsistencies(change: dict[str, Any], message: str) -> None:
    traj = make()
    for name, value in change.items():
        setattr(traj, name, value)
    with pytest.raises(ValueError, match=message):
        traj.check()


def test_dict_round_trip() -> None:
    traj = make(1, finish_reason="error", error="replica r1 died")
    d = traj.to_dict()
    assert Trajectory.from_dict(d) == traj
    d["token_ids"].append(5)  # a copy
    assert len(traj.token_ids) == 7
    with pytest.raises(ValueError, match="unknown trajectory fields"):
        Trajectory.from_dict({**traj.to_dict(), "extra": 1})
    with pytest.raises(ValueError, match="missing trajectory fields"):
        Trajectory.from_dict({"trajectory_id": "x"})
    assert Trajectory.from_dict({**traj.to_dict(), "reward": 1}).reward == 1.0


def test_jsonl_append_read_and_resume(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "step3.jsonl"
    assert completed_ids(path) == set()
    writes: list[int] = []
    real_write = os.write

    def counting_write(fd: int, data: bytes) -> int:
        writes.append(len(data))
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", counting_write)
    trajs = [make(i) for i in range(3)]
    with JsonlWriter(path) as w:
        for t in trajs:
            w.append(t)
    assert len(writes) == 3  # one write per trajectory, the whole line
    assert path.read_bytes().count(b"\n") == 3
    assert read_jsonl(path) == trajs
    with JsonlWriter(path) as w:  # reopening appends
        assert w.repaired_bytes == 0
        w.append(make(3))
    assert [t.trajectory_id for t in read_jsonl(path)][-1] == make(3).trajectory_id
    assert completed_ids(path) == {make(i).trajectory_id for i in range(4)}
    w = JsonlWriter(path)
    w.close()
    with pytest.raises(ValueError, match="closed"):
        w.append(make())


def test_jsonl_crash_recovery(tmp_path: Path) -> None:
    path = tmp_path / "step.jsonl"
    with JsonlWriter(path) as w:
        w.append(make(0))
        w.append(make(1))
    good = path.read_bytes()
    line = good.split(b"\n")[1]
    # A crash mid-write leaves a partial last line: readers skip it, the writer cuts it.
    with open(path, "ab") as f:
        f.write(line[: len(line) // 2])
    assert [t.trajectory_id for t in read_jsonl(path)] == [make(0).trajectory_id,
                                                           make(1).trajectory_id]
    assert completed_ids(path) == {make(0).trajectory_id, make(1).trajectory_id}
    with JsonlWriter(path) as w:
        assert w.repaired_bytes == len(line) // 2
        w.append(make(2))
    assert read_jsonl(path) == [make(0), make(1), make(2)]
    # A complete but invalid last line is skipped and cut off as well.
    with open(path, "ab") as f:
        f.write(b'{"trajectory_id": "half"}\n')
    assert len(read_jsonl(path)) == 3
    with JsonlWriter(path) as w:
        assert w.repaired_bytes == len(b'{"trajectory_id": "half"}\n')
    assert len(read_jsonl(path)) == 3
    # Corruption before the last line is not a crash artefact: it raises.
    path.write_bytes(b"garbage\n" + good)
    with pytest.raises(ValueError, match=r"step.jsonl:1"):
        read_jsonl(path)
    # A file holding only a partial line.
    path.write_bytes(line[:10])
    assert read_jsonl(path) == []
    with JsonlWriter(path) as w:
        assert w.repaired_bytes == 10
    assert path.read_bytes() == b""


def test_jsonl_failed_write_leaves_no_partial_line(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "step.jsonl"
    real_write = os.write

    def half_write(fd: int, data: bytes) -> int:
        real_write(fd, data[: len(data) // 2])
        raise OSError("disk full")

    with JsonlWriter(path) as w:
        w.append(make(0))
        monkeypatch.setattr(os, "write", half_write)
        with pytest.raises(OSError, match="disk full"):
            w.append(make(1))
        monkeypatch.setattr(os, "write", real_write)
        w.append(make(2))
        with pytest.raises(ValueError):  # invalid trajectories are refused before writing
            w.append(make(3, finish_reason="bogus"))
    assert read_jsonl(path) == [make(0), make(2)]
    with pytest.raises(ValueError, match="does not exist"):
        JsonlWriter(tmp_path / "missing" / "x.jsonl")


def test_parquet_round_trip(tmp_path: Path) -> None:
    trajs = [make(0), make(1, finish_reason="error", error="tool crashed"),
             Trajectory(trajectory_id="empty", group_id="", task_id="", env="", rl_step=0,
                        sample_index=0)]
    path = tmp_path / "step3.parquet"
    write_parquet(trajs, path)
    assert read_parquet(path) == trajs
    schema = pq.read_schema(path)
    assert schema.field("token_ids").type == pa.list_(pa.int32())
    assert schema.field("loss_mask").type == pa.list_(pa.int8())
    assert schema.field("logprobs").type == pa.list_(pa.float64())
    write_parquet(trajs[:1], path)  # replaces atomically, leaving no temporary file
    assert read_parquet(path) == trajs[:1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step3.parquet"]
    write_parquet([], tmp_path / "none.parquet")
    assert read_parquet(tmp_path / "none.parquet") == []
    bad = make(2)
    bad.loss_mask = [0] * bad.num_tokens  # sampled logprobs under mask 0
    with pytest.raises(ValueError):
        write_parquet([bad], tmp_path / "bad.parquet")
    assert not (tmp_path / "bad.parquet").exists()


def test_a_lone_surrogate_is_refused_naming_the_trajectory(tmp_path: Path) -> None:
    """A lone surrogate (e.g. a file name decoded with surrogateescape) is not UTF-8:
    the writers say which trajectory is at fault and write nothing."""
    bad = make(0, messages=[{"role": "tool", "content": "name \udcff"}])
    path = tmp_path / "step.jsonl"
    with JsonlWriter(path) as w:
        with pytest.raises(ValueError, match=f"trajectory {bad.trajectory_id}"):
            w.append(bad)
        w.append(make(1))
    assert read_jsonl(path) == [make(1)]
    with pytest.raises(ValueError, match=f"trajectory {bad.trajectory_id}"):
        write_parquet([bad], tmp_path / "bad.parquet")
    assert not (tmp_path / "bad.parquet").exists()


def test_a_step_reads_only_the_lines_of_its_own_trajectories(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A run's file holds every step's trajectories; a step decodes only the lines that
    hold its ids' common start (as the writer encodes it), and gets the same result."""
    from war.rollout import driver, trajectory

    path = tmp_path / "trajectories.jsonl"
    odd = 'step4/"q"\\é/'  # an id start that JSON escapes
    written = [make(i, trajectory_id=f"step{i % 3}/t{i}", rl_step=i % 3) for i in range(9)]
    written += [make(9, trajectory_id=odd + "0", rl_step=4),
                make(10, trajectory_id=odd + "1", rl_step=4, finish_reason="error",
                     error="replica died")]
    with JsonlWriter(path) as w:
        for t in written:
            w.append(t)
    decoded: list[bytes] = []
    real = trajectory._decode_line
    monkeypatch.setattr(trajectory, "_decode_line", lambda line: decoded.append(line)
                        or real(line))
    wanted = [f"step1/t{i}" for i in (1, 4, 7)]
    got = driver.reusable(path, wanted)
    assert sorted(got) == wanted and got["step1/t4"] == written[4]
    assert len(decoded) == 3  # not the other steps' six
    decoded.clear()
    assert list(driver.reusable(path, [odd + "0", odd + "1"])) == [odd + "0"]  # (failed: redone)
    assert len(decoded) == 2
    assert read_jsonl(path, b"step2/") == [written[i] for i in (2, 5, 8)]
    assert driver.reusable(path, []) == {}
    assert len(driver.reusable(path, ["step0/t0", "step2/t2"])) == 2  # (no common start)
