"""A run on ``war serve`` endpoints instead of local replicas (``RunConfig.endpoints``,
``war rollout --endpoint``): through an in-process router (the default) or whole groups
per endpoint, the servers' own key, resuming on servers that outlive a run, an endpoint
that stops mid-run, and the refusals before any work (unreachable, not a war serve
replica, another vocabulary, a refused key, local settings beside endpoints). Every
server is a real ``war serve`` app on a loopback port."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import torch
from fastapi import FastAPI

from loopback import serve
from war.cli.main import main
from war.engine.async_engine import AsyncEngine
from war.engine.config import EngineConfig
from war.engine.engine import Engine
from war.engine.loader import init_random
from war.engine.model_config import ModelConfig
from war.engine.server import create_app
from war.rollout import run as run_mod
from war.rollout.fingerprint import model_fingerprint
from war.rollout.remote import KEY_ENV, Endpoint, connect
from war.rollout.run import (
    SETTINGS_FILE,
    RunConfig,
    check_run_settings,
    load_run_config,
    run_rollout,
    trajectory_settings,
)
from war.rollout.trajectory import read_jsonl

ENGINE = EngineConfig(kv_cache_bytes=8_000_000)
KEY = "s3cret-key"


@contextlib.contextmanager
def servers(policy: Path, n: int, api_key: str | None = None,
            wrap: Callable[[Any], Any] = lambda app: app,
            stated: Sequence[Path | None] = ()
            ) -> Iterator[list[tuple[str, Any, AsyncEngine]]]:
    """``n`` war serve apps of ``policy`` on loopback ports: (url, uvicorn server,
    engine) each; closed at the end. ``wrap``: what each app is served as (ASGI);
    ``stated[i]``: the folder whose fingerprint server ``i`` states for its weights, as
    ``war serve`` states its model folder's (none: it states none)."""
    engines = [AsyncEngine(Engine.from_pretrained(policy, ENGINE)) for _ in range(n)]
    with contextlib.ExitStack() as stack:
        out = []
        for i, engine in enumerate(engines):
            engine.start()
            folder = stated[i] if i < len(stated) else None
            app = create_app(engine, model_name="policy", api_key=api_key,
                             model_folder=folder, fingerprint=model_fingerprint)
            url, server = stack.enter_context(serve(wrap(app)))
            out.append((url, server, engine))
        try:
            yield out
        finally:
            stack.close()
            for engine in engines:
                asyncio.run(engine.close())


def _write_config(tmp_path: Path, policy: Path, urls: list[str], **changes: Any) -> Path:
    raw: dict[str, Any] = {
        "name": "r", "model": str(policy), "endpoints": urls, "tasks_per_step": 3,
        "group_size": 2, "steps": 2, "output_dir": str(tmp_path / "runs"),
        "agent": {"max_turns": 2, "max_tokens_per_turn": 6}, **changes}
    path = tmp_path / "run.json"
    path.write_text(json.dumps(raw))
    return path


def _run(config: Path, *more: str) -> int:
    return main(["rollout", "--config", str(config), "--quiet", *more])


def _served(engine: AsyncEngine) -> int:
    return engine.engine.stats.num_finished


def _err(capsys: pytest.CaptureFixture[str]) -> str:
    err = " ".join(capsys.readouterr().err.split())
    assert err.startswith("war: error: ") and "Traceback" not in err, err
    return err


# ---------------------------------------------------------------- runs


@pytest.mark.parametrize("routing", [None, "groups", "round_robin"])
def test_a_run_on_two_endpoints(tmp_path: Path, random_policy: Path,
                                capsys: pytest.CaptureFixture[str],
                                routing: str | None) -> None:
    with servers(random_policy, 2) as fleet:
        extra = {} if routing is None else {"routing_policy": routing}
        config = _write_config(tmp_path, random_policy, [u for u, _, _ in fleet], **extra)
        assert _run(config) == 0
        out = " ".join(capsys.readouterr().out.split())
        assert f"2 endpoints, routing {routing or 'war'}" in out
        served = [_served(e) for _, _, e in fleet]
    run_dir = tmp_path / "runs" / "r"
    trajs = read_jsonl(run_dir / "trajectories.jsonl")
    assert len(trajs) == 2 * 3 * 2
    assert all(t.finish_reason != "error" for t in trajs), [t.finish_reason for t in trajs]
    assert all(t.num_sampled_tokens > 0 for t in trajs)
    assert sum(served) >= len(trajs), served
    if routing is not None:  # (both take turns; the war policy places by load and cache)
        assert all(s > 0 for s in served), served
    settings = json.loads((run_dir / SETTINGS_FILE).read_text())
    assert settings["engine"] is None and "endpoints" not in settings
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["config"]["endpoints"] == [u for u, _, _ in fleet]
    assert (run_dir / "report.png").stat().st_size > 0


def test_endpoints_from_the_command_line_and_the_servers_key(
        tmp_path: Path, random_policy: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    with servers(random_policy, 1, api_key=KEY) as fleet:
        (url, _, _), = fleet
        config = _write_config(tmp_path, random_policy, [], steps=1)
        monkeypatch.delenv(KEY_ENV, raising=False)
        assert _run(config, "--endpoint", url) == 1
        err = _err(capsys)
        assert f"endpoint0 ({url}) refused the key (401)" in err and KEY_ENV in err
        assert KEY not in err
        assert not (tmp_path / "runs").exists()  # (a refused start leaves no folder)
        monkeypatch.setenv(KEY_ENV, KEY)
        assert _run(config, "--endpoint", url) == 0
    run_dir = tmp_path / "runs" / "r"
    assert len(read_jsonl(run_dir / "trajectories.jsonl")) == 3 * 2
    for name in ("summary.json", SETTINGS_FILE):  # (the config is there, never the key)
        assert KEY not in (run_dir / name).read_text()


def test_resuming_on_servers_that_saw_later_steps(
        tmp_path: Path, random_policy: Path, capsys: pytest.CaptureFixture[str],
        caplog: pytest.LogCaptureFixture) -> None:
    with servers(random_policy, 1) as fleet:
        config = _write_config(tmp_path, random_policy, [fleet[0][0]])
        assert _run(config) == 0
        before = (tmp_path / "runs" / "r" / "trajectories.jsonl").read_bytes()
        capsys.readouterr()
        with caplog.at_level(logging.WARNING, logger="war.rollout.run"):
            assert _run(config, "--steps", "3") == 0  # steps 0-1 reused, 2 generated
        assert "resuming" in capsys.readouterr().out
        # the server had seen step 1: step 0 again is not taken, and the run goes on
        assert any("did not take RL step 0" in r.getMessage() for r in caplog.records)
    after = (tmp_path / "runs" / "r" / "trajectories.jsonl").read_bytes()
    assert after.startswith(before)
    assert len(read_jsonl(tmp_path / "runs" / "r" / "trajectories.jsonl")) == 3 * 3 * 2


def test_an_endpoint_that_stops_mid_run_is_routed_around(
        tmp_path: Path, random_policy: Path, caplog: pytest.LogCaptureFixture) -> None:
    with servers(random_policy, 2) as fleet:
        cfg = load_run_config(_write_config(tmp_path, random_policy,
                                            [u for u, _, _ in fleet], steps=2,
                                            routing_policy="round_robin"))
        url, stopped, engine = fleet[1]  # (round robin: turns of step 1 are sent to it)
        at_stop: list[int] = []

        def on_step(step: int, _tasks: object) -> None:
            if step == 1:  # (before the step's first turn: it stops, its port closes)
                stopped.should_exit = True
                _wait_refused(url)
                at_stop.append(_served(engine))

        with caplog.at_level(logging.WARNING, logger="war.router.router"):
            result = asyncio.run(asyncio.wait_for(run_rollout(cfg, on_step=on_step), 120))
        assert at_stop[0] > 0  # (it served in step 0)
    # (a turn it was serving as it stopped may end there; the next ones go elsewhere)
    assert any("endpoint1 marked down" in r.getMessage() for r in caplog.records), [
        r.getMessage() for r in caplog.records]
    step1 = [t for t in result.trajectories if t.rl_step == 1]
    assert len(step1) == 3 * 2
    assert all(t.finish_reason != "error" for t in step1), [t.finish_reason for t in step1]


def _wait_refused(url: str, bound_s: float = 10.0) -> None:
    """Until ``url``'s port refuses connections (its server stopped), at most ``bound_s``."""
    parts = urlsplit(url)
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline:
        try:
            socket.create_connection((parts.hostname, parts.port), timeout=0.2).close()
        except OSError:
            return
        time.sleep(0.02)
    raise AssertionError(f"{url} still accepts connections after {bound_s} s")


# ---------------------------------------------------------------- refusals


def test_an_endpoint_serving_other_weights_is_refused(
        tmp_path: Path, random_policy: Path, capsys: pytest.CaptureFixture[str],
        make_random_policy: Callable[[Path, int], Path]) -> None:
    other = make_random_policy(tmp_path / "step7", 7)  # (a checkpoint of another step)
    with servers(random_policy, 2, stated=[random_policy, other]) as fleet:
        config = _write_config(tmp_path, random_policy, [u for u, _, _ in fleet], steps=1)
        assert _run(config) == 1
        err = _err(capsys)
        assert "(1 of 2)" in err and "endpoint0" not in err
        assert (f"endpoint1 ({fleet[1][0]}) serves other weights than the run's model "
                f"(weights_fingerprint {model_fingerprint(other)}, the model folder's "
                f"{model_fingerprint(random_policy)})") in err
        assert not (tmp_path / "runs").exists()
    with servers(random_policy, 1, stated=[random_policy]) as fleet:  # (the same: runs)
        assert _run(_write_config(tmp_path, random_policy, [fleet[0][0]], steps=1)) == 0


def test_an_unreachable_endpoint_is_refused_before_any_work(
        tmp_path: Path, random_policy: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    with servers(random_policy, 1) as fleet:
        url = fleet[0][0]
    # (the server is gone: its port refuses connections)
    config = _write_config(tmp_path, random_policy, [url])
    assert _run(config) == 1
    err = _err(capsys)
    assert f"endpoint0 ({url}) does not answer GET /v1/models" in err
    assert not (tmp_path / "runs").exists()


def _not_war_serve() -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    def models() -> dict[str, Any]:  # (as war route, or another OpenAI server, answers)
        return {"object": "list", "data": [{"id": "m", "object": "model"}]}

    return app


def test_a_server_that_is_not_war_serve_or_serves_another_vocabulary(
        tmp_path: Path, random_policy: Path, capsys: pytest.CaptureFixture[str]) -> None:
    small = init_random(ModelConfig.from_dict({
        "model_type": "llama", "vocab_size": 300, "hidden_size": 16,
        "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
        "num_key_value_heads": 1, "max_position_embeddings": 512}), seed=0,
        dtype=torch.float32)
    other = AsyncEngine(Engine(small, ENGINE))
    other.start()
    try:
        with servers(random_policy, 1) as good, serve(_not_war_serve()) as (router, _), \
                serve(create_app(other, model_name="other")) as (wrong, _):
            config = _write_config(tmp_path, random_policy, [good[0][0], router, wrong])
            assert _run(config) == 1
            err = _err(capsys)
    finally:
        asyncio.run(other.close())
    assert "endpoint0" not in err  # (the good one is not named)
    assert f"endpoint1 ({router}): its /v1/models answer states no max_model_len" in err
    assert "not a war serve replica" in err
    assert f"endpoint2 ({wrong}) serves a vocabulary of 300 tokens" in err
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize(("changes", "message"), [
    ({"replicas": 2}, "replicas set with endpoints"),
    ({"engine": {"spec_mode": "off"}}, "engine set with endpoints"),
    ({"torch_threads": 1, "replicas": 1}, "replicas, torch_threads set with endpoints"),
    ({"endpoints": "http://127.0.0.1:1"}, "endpoints must be a list of war serve URLs"),
    ({"endpoints": ["ftp://host"]}, "endpoints: base_url must be http://host"),
    ({"endpoints": ["http://u:p@host"]}, "must not hold credentials"),
    ({"endpoints": ["http://h:1", "http://h:1/"]}, "lists ['http://h:1'] more than once"),
    ({"endpoints": [5]}, "endpoints must be URLs (strings), got 5"),
    ({"routing_policy": "fastest"}, "routing_policy must be 'groups' or a routing policy"),
    ({"endpoints": [], "routing_policy": "war"}, "routing_policy ('war') applies to "
                                                 "endpoints only"),
])
def test_bad_endpoint_settings_are_one_error(
        tmp_path: Path, random_policy: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch, changes: dict[str, Any], message: str) -> None:
    monkeypatch.setattr(run_mod, "connect", _no_connection)
    config = _write_config(tmp_path, random_policy, ["http://127.0.0.1:9"], **changes)
    assert _run(config) == 1
    assert message in _err(capsys)
    assert not (tmp_path / "runs").exists()


async def _no_connection(*_a: Any, **_k: Any) -> dict[str, Endpoint]:
    raise AssertionError("the run connected: it was not refused up front")


@pytest.mark.parametrize("flag", [["--replicas", "2"], ["--spec-mode", "off"]])
def test_local_flags_with_endpoints_are_refused(
        tmp_path: Path, random_policy: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch, flag: list[str]) -> None:
    monkeypatch.setattr(run_mod, "connect", _no_connection)
    config = _write_config(tmp_path, random_policy, [])
    assert _run(config, "--endpoint", "http://127.0.0.1:9", *flag) == 1
    assert f"{flag[0]} set a run's local replicas; this run is on endpoints" in _err(capsys)


def test_a_file_with_local_settings_and_endpoints_on_the_command_line(
        tmp_path: Path, random_policy: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(run_mod, "connect", _no_connection)
    config = _write_config(tmp_path, random_policy, [], replicas=4)
    del_endpoints = json.loads(config.read_text())
    del del_endpoints["endpoints"]  # (a local run's file)
    config.write_text(json.dumps(del_endpoints))
    assert _run(config, "--endpoint", "http://127.0.0.1:9") == 1
    assert "replicas set with endpoints" in _err(capsys)


def test_the_library_config() -> None:
    cfg = RunConfig(endpoints=["http://10.0.0.7:8000/", "https://h/prefix"])  # type: ignore[arg-type]
    assert cfg.endpoints == ("http://10.0.0.7:8000", "https://h/prefix") and cfg.remote
    assert not RunConfig().remote
    with pytest.raises(ValueError, match="applies to endpoints only"):
        RunConfig(routing_policy="groups")


@pytest.mark.parametrize(("value", "message"), [
    (KEY + "\n", f"{KEY_ENV} holds a control or non-ASCII character (a trailing newline?)"),
    (KEY + "\r", f"{KEY_ENV} holds a control or non-ASCII character"),
    (" \t ", f"{KEY_ENV} is blank"),
])
def test_a_key_that_cannot_be_sent_is_one_error_naming_the_variable(
        tmp_path: Path, random_policy: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch, value: str, message: str) -> None:
    monkeypatch.setenv(KEY_ENV, value)
    config = _write_config(tmp_path, random_policy, [])
    assert _run(config, "--endpoint", "http://127.0.0.1:9") == 1  # (never contacted)
    err = _err(capsys)
    assert message in err and KEY not in err
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("urls", [
    ["http://H:1", "http://h:1/"],
    ["http://h", "http://h:80"],
    ["https://h:443/p", "HTTPS://h/p/"],
    ["http://[::1]:8000", "http://[::1]:8000/"],
])
def test_one_server_spelled_twice_is_refused(urls: list[str]) -> None:
    with pytest.raises(ValueError, match=r"more than once.*name each server once"):
        RunConfig(endpoints=urls)  # type: ignore[arg-type]


def test_servers_that_differ_only_by_path_or_port_are_two() -> None:
    urls = ("http://h/a", "http://h/b", "http://h:81/a", "https://h/a", "http://[::1]:8000")
    assert RunConfig(endpoints=urls).endpoints == urls


def _closed_port() -> int:
    with socket.socket() as sock:  # (bound, never listening: connections are refused)
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_a_fleet_of_faults_is_one_line_of_bounded_length() -> None:
    port = _closed_port()
    urls = [f"http://127.0.0.1:{port}/r{i}" for i in range(20)]
    with pytest.raises(ValueError) as info:
        asyncio.run(connect(urls, 10, probe_timeout_s=5))
    message = str(info.value)
    assert "cannot serve it (20 of 20)" in message and "and 12 more" in message
    assert "endpoint7 (" in message and "endpoint8 (" not in message


def _hanging(paths: set[str], release: threading.Event) -> Callable[[Any], Any]:
    """An ASGI wrapper whose calls to ``paths`` get no answer until ``release`` is set (a
    server that accepts connections but does not answer them)."""
    def wrap(app: Any) -> Any:
        async def hanging(scope: Any, receive: Any, send: Any) -> None:
            if scope["type"] == "http" and scope["path"] in paths:
                while not release.is_set():
                    await asyncio.sleep(0.02)
            await app(scope, receive, send)
        return hanging
    return wrap


def test_cancelled_while_connecting_leaves_no_endpoint_open(
        random_policy: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    closed: list[str] = []
    close = Endpoint.close

    async def recording(self: Endpoint) -> None:
        closed.append(self.name)
        await close(self)

    monkeypatch.setattr(Endpoint, "close", recording)
    release = threading.Event()
    try:
        with servers(random_policy, 2, wrap=_hanging({"/v1/models"}, release)) as fleet:
            with pytest.raises(TimeoutError):  # (Ctrl-C, or a caller's bound)
                asyncio.run(asyncio.wait_for(connect([u for u, _, _ in fleet], 10), 0.5))
            release.set()
    finally:
        release.set()
    assert sorted(closed) == ["endpoint0", "endpoint1"]


@pytest.mark.parametrize("routing", ["groups", "round_robin"])
def test_an_endpoint_that_does_not_take_the_rl_step_holds_up_no_step(
        tmp_path: Path, random_policy: Path, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch, routing: str) -> None:
    # (groups: the run's own bound, shortened here; the router: its health timeout)
    monkeypatch.setattr(run_mod, "STEP_TIMEOUT_S", 0.2)
    release = threading.Event()
    try:
        with servers(random_policy, 1, wrap=_hanging({"/v1/rl_step"}, release)) as fleet:
            cfg = load_run_config(_write_config(tmp_path, random_policy, [fleet[0][0]],
                                                steps=1, routing_policy=routing))
            with caplog.at_level(logging.WARNING, logger="war.rollout.run"):
                # (bounded well below a generation's timeout, which bounded it before)
                result = asyncio.run(asyncio.wait_for(run_rollout(cfg), 30))
            release.set()
    finally:
        release.set()
    assert any("endpoint0 did not take RL step 0" in r.getMessage() for r in caplog.records)
    assert len(result.trajectories) == 3 * 2
    assert all(t.finish_reason != "error" for t in result.trajectories), [
        t.error for t in result.trajectories]


def test_a_quiet_run_does_not_poll_the_endpoints_load(
        tmp_path: Path, random_policy: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    polls: list[str] = []
    load = Endpoint.load

    async def counting(self: Endpoint) -> Any:
        polls.append(self.name)
        return await load(self)

    monkeypatch.setattr(Endpoint, "load", counting)
    with servers(random_policy, 1) as fleet:
        config = _write_config(tmp_path, random_policy, [fleet[0][0]], steps=1,
                               routing_policy="groups")  # (no router: it polls load too)
        assert _run(config) == 0  # (--quiet: no bars, so no progress line to poll for)
    assert polls == []


@pytest.mark.parametrize("first_remote", [True, False])
def test_a_resume_across_endpoints_and_local_replicas_says_so(
        tmp_path: Path, random_policy: Path, first_remote: bool) -> None:
    base = {"name": "r", "model": str(random_policy), "output_dir": str(tmp_path)}
    on_endpoints = RunConfig(**base, endpoints=("http://127.0.0.1:9",))  # type: ignore[arg-type]
    local = RunConfig(**base)  # type: ignore[arg-type]
    earlier, now = (on_endpoints, local) if first_remote else (local, on_endpoints)
    folder = tmp_path / "r"
    folder.mkdir()
    (folder / SETTINGS_FILE).write_text(json.dumps(trajectory_settings(earlier)))
    (folder / "trajectories.jsonl").write_text("{}\n")
    with pytest.raises(ValueError) as info:
        check_run_settings(now)
    message = str(info.value)
    engine = json.dumps({"dtype": local.engine.dtype, "max_model_len": None})
    change = f"engine: null -> {engine}" if first_remote else f"engine: {engine} -> null"
    assert change in message and "(not recorded)" not in message, message
    was, then = ("endpoints", "local replicas") if first_remote else (
        "local replicas", "endpoints")
    assert f"made on {was} and this run is on {then}" in message
