"""Experiment files: YAML quirks and settings that were accepted but misread."""

from __future__ import annotations

from pathlib import Path

import pytest

from war.cli.main import main
from war.sim.experiment import Experiment

EXPERIMENT = """
name: tiny
workload: {kind: traces, rl_steps: 1}
cost: {kind: linear, intercept_s: 0.01, per_token_s: 1.0e-5, kv_tokens: 200000}
sim: {num_replicas: 2}
loads: [2]
configs:
  rr: {policy: round_robin, spec_mode: "off"}
  war: {policy: war, spec_mode: auto}
"""


@pytest.mark.parametrize("old, new, message", [
    # a quoted "off" (as spec_mode needs) is a string: the policy took it as true
    ("war: {policy: war, spec_mode: auto}",
     "war: {policy: war, spec_mode: auto, policy_settings: {age_priority: \"off\"}}",
     "configuration 'war': policy_settings.age_priority must be a bool, got 'off'"),
    ("war: {policy: war, spec_mode: auto}",
     "war: {policy: war, spec_mode: auto, policy_settings: {migrate_abs_tokens: 1.5}}",
     "policy_settings.migrate_abs_tokens must be an int, got 1.5"),
    # PyYAML keeps the last of duplicate keys: a configuration vanished unseen
    ("  war: {policy: war, spec_mode: auto}",
     "  war: {policy: war, spec_mode: auto}\n  war: {policy: war, spec_mode: always}",
     "duplicate key 'war' (line 10)"),
    ("loads: [2]", "loads: [2]\nloads: [4]", "duplicate key 'loads'"),
])
def test_misread_settings_are_one_error_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], old: str, new: str,
        message: str) -> None:
    assert old in EXPERIMENT
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(EXPERIMENT.replace(old, new, 1))
    out = tmp_path / "out.json"
    assert main(["sim", "--config", str(cfg), "--json", str(out)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"war: error: {cfg}: ") and message in err and err.count("\n") == 1
    assert not out.exists()


def test_well_typed_policy_settings_still_load(tmp_path: Path) -> None:
    cfg = tmp_path / "ok.yaml"
    cfg.write_text(EXPERIMENT.replace(
        "war: {policy: war, spec_mode: auto}",
        "war: {policy: war, spec_mode: auto, policy_settings: {age_priority: off, "
        "migrate_rel: 2}}"))
    exp = Experiment.load(cfg)
    assert exp.configs["war"]["policy_settings"] == {"age_priority": False, "migrate_rel": 2}
