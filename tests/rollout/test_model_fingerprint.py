"""The model's fingerprint in run_settings.json (a resume after the weights changed is
refused, the same weights resume from any path), and a refused start that leaves no
empty run folder it created."""

from __future__ import annotations

import asyncio
import json
import shutil
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from war.cli.main import main
from war.rollout import run as run_mod
from war.rollout.fingerprint import model_fingerprint
from war.rollout.run import SETTINGS_FILE, load_run_config


def _write_config(tmp_path: Path, policy: Path, **changes: Any) -> Path:
    raw: dict[str, Any] = {
        "name": "r", "model": str(policy), "replicas": 1, "tasks_per_step": 2,
        "group_size": 1, "steps": 1, "output_dir": str(tmp_path / "runs"),
        "agent": {"max_turns": 1, "max_tokens_per_turn": 4},
        "engine": {"kv_cache_bytes": 8_000_000}, **changes}
    path = tmp_path / "run.json"
    path.write_text(json.dumps(raw))
    return path


def _run(config: Path, *more: str) -> int:
    return main(["rollout", "--config", str(config), "--quiet", *more])


def _no_model(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_model(*_a: Any, **_k: Any) -> Any:
        raise AssertionError("a model was loaded: the run was not refused up front")

    monkeypatch.setattr(run_mod, "make_replicas", no_model)


def _tensor_spans(path: Path) -> tuple[int, dict[str, tuple[int, int]]]:
    """A safetensors file's data start and each tensor's (begin, end) in the data."""
    data = path.read_bytes()
    length = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + length])
    return 8 + length, {k: tuple(v["data_offsets"]) for k, v in header.items()
                        if k != "__metadata__"}


def _flip(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.fixture
def policy(tmp_path: Path, random_policy: Path) -> Path:
    """A copy of the tiny random policy that a test may change."""
    return Path(shutil.copytree(random_policy, tmp_path / "policy"))


# ---------------------------------------------------------------- the fingerprint


def test_the_fingerprint_follows_the_content_not_the_path(
        tmp_path: Path, policy: Path) -> None:
    fp = model_fingerprint(policy)
    assert fp is not None and fp.startswith("sha256:") and len(fp) == 7 + 64
    assert model_fingerprint(policy) == fp  # (deterministic)
    copy = Path(shutil.copytree(policy, tmp_path / "elsewhere"))
    assert model_fingerprint(copy) == fp  # same weights, another folder
    (copy / "README.md").write_text("notes")  # a file the policy does not read
    assert model_fingerprint(copy) == fp


def test_the_fingerprint_changes_with_weights_config_or_tokenizer(
        tmp_path: Path, policy: Path) -> None:
    weights = policy / "model.safetensors"
    start, spans = _tensor_spans(weights)
    seen = {model_fingerprint(policy)}
    # an in-place update with the same shapes: the first bytes of a tensor in the middle
    middle = sorted(spans.values())[len(spans) // 2]
    _flip(weights, start + middle[0])
    seen.add(model_fingerprint(policy))
    _flip(weights, weights.stat().st_size - 1)  # the file's last byte
    seen.add(model_fingerprint(policy))
    config = json.loads((policy / "config.json").read_text())
    (policy / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 1e-5}))
    seen.add(model_fingerprint(policy))
    with open(policy / "tokenizer.json", "a") as f:
        f.write(" ")
    seen.add(model_fingerprint(policy))
    shutil.copy(weights, policy / "extra.safetensors")  # another weights file
    seen.add(model_fingerprint(policy))
    assert len(seen) == 6 and None not in seen


def test_what_the_fingerprint_does_not_sample(policy: Path) -> None:
    """Documented limit: a byte past every tensor's sampled head (4 KiB) and before the
    file's last 64 KiB is not read."""
    weights = policy / "model.safetensors"
    start, spans = _tensor_spans(weights)
    begin, end = max(spans.values(), key=lambda s: s[1] - s[0])
    at = start + begin + 4096
    if not (end - begin > 4096 and at < weights.stat().st_size - 64 * 1024):
        pytest.skip("the tiny policy has no unsampled byte")
    fp = model_fingerprint(policy)
    _flip(weights, at)
    assert model_fingerprint(policy) == fp


def test_no_fingerprint_without_model_files(tmp_path: Path) -> None:
    assert model_fingerprint(tmp_path / "missing") is None
    (tmp_path / "empty").mkdir()
    assert model_fingerprint(tmp_path / "empty") is None
    (tmp_path / "file").write_text("x")
    assert model_fingerprint(tmp_path / "file") is None
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "model.safetensors").write_bytes(b"\xff" * 20)  # not a safetensors file
    assert (model_fingerprint(bad) or "").startswith("sha256:")  # (loading says why)


# ---------------------------------------------------------------- resuming


def _assert_resumes(config: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``war rollout config`` succeeds, saying it resumes the folder's run."""
    capsys.readouterr()
    assert _run(config) == 0
    assert "resuming" in " ".join(capsys.readouterr().out.split())


def test_same_weights_same_path_resumes(
        tmp_path: Path, policy: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = _write_config(tmp_path, policy)
    assert _run(config) == 0
    settings = tmp_path / "runs" / "r" / SETTINGS_FILE
    recorded = json.loads(settings.read_text())
    assert recorded["model_fingerprint"] == model_fingerprint(policy) is not None
    _assert_resumes(config, capsys)
    assert json.loads(settings.read_text()) == recorded


def test_same_weights_at_another_path_resume(
        tmp_path: Path, policy: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert _run(_write_config(tmp_path, policy)) == 0
    moved = policy.rename(tmp_path / "moved-policy")
    _assert_resumes(_write_config(tmp_path, moved), capsys)
    recorded = json.loads((tmp_path / "runs" / "r" / SETTINGS_FILE).read_text())
    assert recorded["model"] == str(moved.resolve())  # (where the weights are now)


def test_changed_weights_at_the_same_path_are_refused(
        tmp_path: Path, policy: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch,
        make_random_policy: Callable[[Path, int], Path]) -> None:
    config = _write_config(tmp_path, policy)
    assert _run(config) == 0
    run_dir = tmp_path / "runs" / "r"
    before = {p.name: p.read_bytes() for p in run_dir.iterdir()}
    old_fp = model_fingerprint(policy)
    weights = policy / "model.safetensors"
    start, spans = _tensor_spans(weights)
    _flip(weights, start + sorted(spans.values())[len(spans) // 2][0])  # same shapes
    new_fp = model_fingerprint(policy)
    assert new_fp != old_fp
    _no_model(monkeypatch)
    capsys.readouterr()
    assert _run(config) == 1
    captured = capsys.readouterr()
    err = " ".join(captured.err.split())
    assert err.startswith("war: error: ") and "Traceback" not in err, err
    assert f'model_fingerprint: "{old_fp}" -> "{new_fp}"' in err, err
    assert "other model weights" in err and "use a new run folder" in err
    assert str(run_dir / "trajectories.jsonl") in err
    assert "resuming" not in captured.out
    assert {p.name: p.read_bytes() for p in run_dir.iterdir()} == before  # nothing written
    # a new checkpoint written in place (all weights new): refused too, by the library
    make_random_policy(policy, 1)
    with pytest.raises(ValueError, match="other model weights"):
        asyncio.run(run_mod.run_rollout(load_run_config(config)))
    assert {p.name: p.read_bytes() for p in run_dir.iterdir()} == before


def test_an_old_settings_file_without_a_fingerprint_resumes(
        tmp_path: Path, policy: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = _write_config(tmp_path, policy)
    assert _run(config) == 0
    settings = tmp_path / "runs" / "r" / SETTINGS_FILE
    old = json.loads(settings.read_text())
    del old["model_fingerprint"]  # as a run before the field existed wrote it
    settings.write_text(json.dumps(old, indent=2))
    _assert_resumes(config, capsys)
    # from now on it records the fingerprint
    assert json.loads(settings.read_text())["model_fingerprint"] == model_fingerprint(policy)


def test_without_a_fingerprint_the_model_is_compared_by_path(
        tmp_path: Path, policy: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    assert _run(_write_config(tmp_path, policy)) == 0
    settings = tmp_path / "runs" / "r" / SETTINGS_FILE
    old = json.loads(settings.read_text())
    settings.write_text(json.dumps({**old, "model_fingerprint": None}))
    copy = Path(shutil.copytree(policy, tmp_path / "copy"))
    _no_model(monkeypatch)
    capsys.readouterr()
    assert _run(_write_config(tmp_path, copy)) == 1
    assert f'model: "{policy.resolve()}" -> "{copy.resolve()}"' in capsys.readouterr().err


# ---------------------------------------------------------------- refused starts


def test_a_refused_start_removes_the_folder_it_created(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "no-such-model"
    config = _write_config(tmp_path, missing, output_dir=str(tmp_path / "runs" / "deep"))
    assert _run(config) == 1
    assert "war: error:" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()  # nor the folders above it the run made
    # the library run too
    with pytest.raises((ValueError, OSError)):
        asyncio.run(run_mod.run_rollout(load_run_config(config)))
    assert not (tmp_path / "runs").exists()


def test_a_refused_start_keeps_a_folder_that_was_there(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = tmp_path / "runs" / "r"
    run_dir.mkdir(parents=True)  # the user's, empty
    config = _write_config(tmp_path, tmp_path / "no-such-model")
    assert _run(config) == 1
    assert "war: error:" in capsys.readouterr().err
    assert run_dir.is_dir() and list(run_dir.iterdir()) == []
    with pytest.raises((ValueError, OSError)):
        asyncio.run(run_mod.run_rollout(load_run_config(config)))
    assert run_dir.is_dir()
    # a folder the run created but that holds something when the start fails is kept
    shutil.rmtree(tmp_path / "runs")
    with pytest.raises(RuntimeError), run_mod.removing_created_folder(
            load_run_config(config)):
        run_dir.mkdir(parents=True)
        (run_dir / "file").write_text("written")
        raise RuntimeError("failed after writing")
    assert (run_dir / "file").read_text() == "written"
