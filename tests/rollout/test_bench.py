"""The rollout step benchmark's runs: resources of a configuration that fails."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from rollout_fakes import RecordingReplica

from war.rollout import bench
from war.rollout.run import RunConfig


def test_a_configuration_that_fails_to_start_closes_its_replicas(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Replicas are closed (their engine threads stopped) when a configuration fails
    before its steps: a replica that cannot start, or a model folder without a
    tokenizer."""
    events: list[str] = []

    cfg = RunConfig(name="b", output_dir=str(tmp_path))
    monkeypatch.setattr(bench, "make_replicas", lambda cfg, model: {
        "replica0": RecordingReplica("replica0", False, events),
        "replica1": RecordingReplica("replica1", False, events)})
    with pytest.raises(ValueError, match=r"tokenizer\.json"):  # (tmp_path holds no model)
        asyncio.run(bench.run_config(cfg, tmp_path, [], "auto", None))
    assert events == ["start replica0", "start replica1", "close replica0", "close replica1"]

    events.clear()
    monkeypatch.setattr(bench, "make_replicas", lambda cfg, model: {
        "replica0": RecordingReplica("replica0", False, events),
        "replica1": RecordingReplica("replica1", True, events)})
    with pytest.raises(RuntimeError, match="replica1 cannot start"):
        asyncio.run(bench.run_config(cfg, tmp_path, [], "auto", None))
    assert events == ["start replica0", "close replica0", "close replica1"]
