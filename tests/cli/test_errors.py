"""The `war` commands report a caller's mistake, and Ctrl-C, on one line with a
non-zero status, before any work and without writing anything (needs the native core)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("war.spec._C", reason="native core war.spec._C is not built")

from cli_helpers import SYNTHETIC_EXPERIMENT

from war import data
from war.cli.main import main  # after the skip: it imports the native core


def _one_line(argv: list[str], status: int, prefix: str, message: str,
              capsys: pytest.CaptureFixture[str]) -> str:
    assert main(argv) == status, argv
    err = capsys.readouterr().err
    assert err.startswith(prefix) and message in err, (argv, err)
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


def _no_work(*_a: Any, **_k: Any) -> Any:
    raise AssertionError("the work started")


def test_a_yaml_syntax_error_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """YAML's message spans lines (the line quoted, a caret under the column)."""
    bad = tmp_path / "bad.yaml"
    bad.write_text("steps: [1\n", encoding="utf-8")
    err = _one_line(["rollout", "--config", str(bad)], 1, "war: error: ", "not valid YAML",
                    capsys)
    assert "expected ',' or ']'" in err and "^" not in err
    _one_line(["sim", "--config", str(bad), "--json", str(tmp_path / "o.json")], 1,
              "war: error: ", "expected ',' or ']'", capsys)
    assert not (tmp_path / "o.json").exists()


def test_a_non_utf8_rollout_config_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bin.yaml"
    bad.write_bytes(b"\xff\xfe\x00steps: 1\n")
    _one_line(["rollout", "--config", str(bad)], 1, f"war: error: {bad}: not UTF-8", "0xff",
              capsys)


def test_ctrl_c_is_one_line_and_writes_no_report(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from war.cli import spec

    def interrupted(*_a: Any, **_k: Any) -> Any:
        raise KeyboardInterrupt

    monkeypatch.setattr(spec, "_replay", interrupted)
    out = tmp_path / "report.json"
    for argv in (["spec", "replay", "--limit", "1", "--json", str(out)],
                 ["spec", "demo", "--limit", "1"]):
        try:
            status = main(argv)
        except KeyboardInterrupt:  # (let pytest go on to the other tests)
            pytest.fail("the interrupt escaped main")
        assert status == 130, argv
        assert capsys.readouterr().err == "war: interrupted\n"
    assert not out.exists()


def test_route_reports_a_bad_replica_spec_on_one_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The backends' message lists the spec forms, one a line."""
    from war.cli import route

    monkeypatch.setattr(route, "_serve", _no_work)
    _one_line(["route", "--replica", "war+http://127.0.0.1:99999"], 2,
              "war route: error: --replica 'war+http://127.0.0.1:99999'", "bad port", capsys)


def test_route_refuses_an_empty_host(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An empty --host (an unset variable) would bind every interface."""
    from war.cli import route

    monkeypatch.setattr(route, "_serve", _no_work)
    for host in ("", " "):
        _one_line(["route", "--replica", "war+http://127.0.0.1:9", "--host", host, "--port",
                   "0"], 2, "war route: error: --host is empty", "", capsys)


def test_route_refuses_a_bad_stall_timeout_on_one_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from war.cli import route

    monkeypatch.setattr(route, "_serve", _no_work)
    for bad in ("0", "-2", "inf", "nan"):
        _one_line(["route", "--replica", "war+http://127.0.0.1:9", "--stall-timeout", bad],
                  2, "war route: error: --stall-timeout must be a finite number > 0", "",
                  capsys)


def test_sim_refuses_a_report_named_as_the_plots_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The plots' folder would be made where the report goes, which then fails to be
    written once the sweep ends."""
    import war.sim.experiment as experiment

    monkeypatch.setattr(experiment, "run_experiment", _no_work)
    exp = tmp_path / "exp.yaml"
    exp.write_text(SYNTHETIC_EXPERIMENT, encoding="utf-8")
    out = tmp_path / "out"
    for plots in (out, tmp_path / "sub" / ".." / "out"):
        _one_line(["sim", "--config", str(exp), "--json", str(out), "--plots", str(plots)], 1,
                  "war: error: ", "is the --plots folder", capsys)
    assert not out.exists()


def test_train_policy_refuses_a_report_named_as_the_policy_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import war.train.policy as policy

    monkeypatch.setattr(policy, "train_policy", _no_work)
    out = tmp_path / "m"
    for report in (out, tmp_path / "sub" / ".." / "m"):
        _one_line(["train-policy", "--out", str(out), "--json", str(report)], 1,
                  "war: error: ", "is the --out folder", capsys)
    assert not out.exists()


def test_serve_reports_an_allocation_failure_on_one_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch raises a RuntimeError for a KV cache larger than the device's memory."""
    from war.engine.engine import Engine

    def too_big(*_a: Any, **_k: Any) -> Any:
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator:"
                           " can't allocate memory: you tried to allocate 52428799999475712 "
                           "bytes. Error code 12 (Cannot allocate memory)")

    monkeypatch.setattr(Engine, "from_pretrained", too_big)
    argv = ["serve", "--model", str(data.policy_path()), "--port", "0", "--kv-cache-mb",
            "99999999999"]
    _one_line(argv, 1, "war: error: cannot load the model with a 99999999999 MiB KV cache",
              "out of memory", capsys)

    def broken(*_a: Any, **_k: Any) -> Any:
        raise RuntimeError("a bug")

    monkeypatch.setattr(Engine, "from_pretrained", broken)
    with pytest.raises(RuntimeError, match="a bug"):  # (not taken for the caller's mistake)
        main(argv)


def test_spec_refuses_trace_files_without_trajectories(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A replay of nothing would report zeros as if they were measured."""
    empty = tmp_path / "empty.jsonl"
    empty.write_text("", encoding="utf-8")
    blank = tmp_path / "blank.jsonl"
    blank.write_text("\n\n", encoding="utf-8")
    out = tmp_path / "report.json"
    _one_line(["spec", "replay", "--traces", str(empty), str(blank), "--json", str(out)], 1,
              "war: error: no trajectories in the trace file(s)", str(blank), capsys)
    _one_line(["spec", "demo", "--traces", str(empty)], 1, "war: error: no trajectories",
              str(empty), capsys)
    assert not out.exists()
