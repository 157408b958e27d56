"""`war.outputs`: output paths checked before a run, reports written whole."""

from __future__ import annotations

import argparse
import json
import os
import stat
from pathlib import Path

import pytest

from war.outputs import (
    check_output_dir,
    check_output_file,
    output_file_arg,
    write_json,
    write_text_atomic,
)


def test_check_output_file_creates_the_folder_and_writes_nothing(tmp_path: Path) -> None:
    target = tmp_path / "a" / "b" / "report.json"
    assert check_output_file(target) == target
    assert target.parent.is_dir() and not target.exists()
    assert list(target.parent.iterdir()) == []  # the probe leaves nothing behind


def test_check_output_file_refuses_folders_and_unwritable_places(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"--json .* is a folder"):
        check_output_file(tmp_path, "--json")
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ValueError, match="cannot write in"):
        check_output_file(blocker / "out.json")
    assert blocker.read_text() == "x"


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")
def test_check_output_file_refuses_read_only_folders(tmp_path: Path) -> None:
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        with pytest.raises(ValueError, match="cannot write in"):
            check_output_file(ro / "out.json")
    finally:
        ro.chmod(0o700)


def test_check_output_dir(tmp_path: Path) -> None:
    assert check_output_dir(tmp_path / "plots").is_dir()
    (tmp_path / "f").write_text("x")
    with pytest.raises(ValueError, match="exists and is not a folder"):
        check_output_dir(tmp_path / "f", "--plots")


def test_output_file_arg_is_an_argparse_error(tmp_path: Path) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--json", type=output_file_arg)
    assert p.parse_args(["--json", str(tmp_path / "x.json")]).json == tmp_path / "x.json"
    with pytest.raises(SystemExit):
        p.parse_args(["--json", str(tmp_path)])


def test_write_json_replaces_whole_files_with_a_normal_mode(tmp_path: Path) -> None:
    target = tmp_path / "new" / "r.json"
    write_json(target, {"a": [1, 2]})
    assert json.loads(target.read_text()) == {"a": [1, 2]}
    assert target.read_text().endswith("\n")
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(target.stat().st_mode) == 0o666 & ~umask
    target.chmod(0o640)
    write_json(target, {"b": 1}, indent=None)
    assert target.read_text() == '{"b": 1}\n'
    assert stat.S_IMODE(target.stat().st_mode) == 0o640  # the replaced file's mode
    assert sorted(p.name for p in target.parent.iterdir()) == ["r.json"]


def test_a_failed_write_keeps_the_old_report(tmp_path: Path) -> None:
    target = tmp_path / "r.json"
    target.write_text("old")

    class NotText:
        pass

    with pytest.raises(TypeError):
        write_json(target, {"x": NotText()})  # not serializable: fails before writing
    with pytest.raises(TypeError):
        write_text_atomic(target, NotText())  # type: ignore[arg-type]  # fails mid-write
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]  # no temporary left


def test_a_long_file_name_that_fits_is_written(tmp_path: Path) -> None:
    # 255 bytes is the usual limit: the temporary's name must not be longer than it
    target = tmp_path / ("r" * 245 + ".json")
    assert check_output_file(target) == target
    write_json(target, {"a": 1})
    assert json.loads(target.read_text()) == {"a": 1}
    assert [p.name for p in tmp_path.iterdir()] == [target.name]


def test_a_file_name_too_long_is_a_value_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"--json .*File name too long"):
        check_output_file(tmp_path / ("r" * 300 + ".json"), "--json")
    with pytest.raises(ValueError, match=r"--plots .*File name too long"):
        check_output_dir(tmp_path / ("p" * 300), "--plots")
    p = argparse.ArgumentParser()
    p.add_argument("--json", type=output_file_arg)
    with pytest.raises(SystemExit):
        p.parse_args(["--json", str(tmp_path / ("r" * 300))])


def test_the_report_is_on_disk_before_it_is_renamed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "r.json"
    synced: list[bool] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced.append(target.exists())
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    write_json(target, {"a": 1})
    assert synced == [False]  # once, on the temporary, before the rename


def test_a_report_behind_a_link_is_written_where_the_link_points(tmp_path: Path) -> None:
    real = tmp_path / "results" / "r.json"
    real.parent.mkdir()
    real.write_text("old\n")
    link = tmp_path / "latest.json"
    link.symlink_to(real)
    write_json(link, {"x": 1})
    assert link.is_symlink() and json.loads(real.read_text()) == {"x": 1}


def test_the_umask_is_read_without_changing_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from war import outputs

    umask = os.umask(0o027)
    try:
        calls: list[int] = []
        real_umask = os.umask
        monkeypatch.setattr(os, "umask", lambda m: calls.append(m) or real_umask(m))
        got = outputs._umask()
        if Path("/proc/self/status").is_file():  # (elsewhere it must set it to read it)
            assert calls == []
        assert got == 0o027
    finally:
        os.umask(umask)


def test_write_json_writes_standard_json_for_non_finite_floats(tmp_path: Path) -> None:
    target = tmp_path / "r.json"
    nan, inf = float("nan"), float("inf")
    write_json(target, {"p50": nan, "rows": [1.5, -inf, {"x": inf}], "t": (nan, 2), "s": "NaN"})
    text = target.read_text()
    assert "NaN" not in text.replace('"NaN"', "") and "Infinity" not in text

    def strict(token: str) -> None:
        raise AssertionError(f"non-standard JSON constant {token}")

    assert json.loads(text, parse_constant=strict) == {
        "p50": None, "rows": [1.5, None, {"x": None}], "t": [None, 2], "s": "NaN"}


def test_write_json_still_refuses_circular_objects(tmp_path: Path) -> None:
    loop: list[object] = [float("nan")]
    loop.append(loop)
    with pytest.raises(ValueError, match=r"[Cc]ircular"):
        write_json(tmp_path / "r.json", loop)
    assert list(tmp_path.iterdir()) == []
