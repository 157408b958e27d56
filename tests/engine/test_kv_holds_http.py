"""KV holds end to end: an engine with ``kv_hold_s`` behind the replica's HTTP app,
served by uvicorn on loopback, sent multi-turn trajectories as the router and the
rollout driver send them (a trajectory id; the whole context, or only the new tokens
with ``continues``). The continuing turns report their held context as cached."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import torch
from engine_helpers import tiny_model

from loopback import serve
from war.engine.async_engine import AsyncEngine
from war.engine.config import EngineConfig
from war.engine.engine import Engine
from war.engine.server import create_app

BS = 4


@contextlib.contextmanager
def serving(engine: Engine) -> Iterator[str]:
    """The engine's app on 127.0.0.1 (a free port); yields its base URL. The engine
    may be read once this exits (its thread is stopped)."""
    ae = AsyncEngine(engine)
    try:
        with serve(create_app(ae, model_name="tiny"), lifespan="auto", start_s=20.0) as (url, _):
            yield url
    finally:
        asyncio.run(ae.close())


def engine(spec_mode: str = "off", hold: float = 30.0, blocks: int = 128,
           whole: bool = False) -> Engine:
    cfg = EngineConfig(block_size=BS, num_kv_blocks=blocks, spec_mode=spec_mode,
                       kv_hold_s=hold, admit_whole_prompt=whole)
    return Engine(tiny_model(0, torch.float32), cfg)


def post(client: httpx.Client, **body: Any) -> dict[str, Any]:
    body = {"model": "tiny", "temperature": 0.0, "ignore_eos": True, **body}
    r = client.post("/v1/completions", json=body, timeout=60.0)
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def cached(resp: dict[str, Any]) -> int:
    return int(resp["usage"]["prompt_tokens_details"]["cached_tokens"])


def full_blocks(computed: int) -> int:
    return computed // BS * BS


@pytest.mark.parametrize("spec_mode", ["off", "always", "auto"])
def test_continuing_turns_report_their_held_context_as_cached(spec_mode: str) -> None:
    eng = engine(spec_mode)
    turns = 4
    with serving(eng) as base, httpx.Client(base_url=base) as client:
        for form, start in (("whole", 2), ("continues", 40)):
            tid = f"traj-{form}"
            context = list(range(start, start + 23))
            new = context
            previous = 0  # the previous turn's prompt and output
            for turn in range(turns):
                cont = form == "continues" and turn > 0
                r = post(client, prompt=new if cont else context, max_tokens=5 + turn,
                         trajectory_id=tid, continues=cont)
                assert r["usage"]["prompt_tokens"] == len(context)
                if turn:  # the previous turn's context, but its last sampled token
                    assert cached(r) == full_blocks(previous - 1), (form, turn)
                context += r["choices"][0]["token_ids"]
                previous = len(context)
                new = [60 + turn, 61 + turn, 62 + turn]
                context += new
            r = client.post("/v1/trajectories/finish", json={"trajectory_id": tid})
            assert r.status_code == 200 and r.json()["held"] is True
    sched = eng.scheduler
    assert sched.num_holds == 2 * turns and sched.num_holds_used == 2 * (turns - 1)
    assert sched.num_held == 0 and eng.blocks.num_used_blocks == 0


def test_a_re_rendered_turn_and_an_expired_hold_keep_what_is_cached() -> None:
    eng = engine(hold=0.05)
    with serving(eng) as base, httpx.Client(base_url=base) as client:
        prompt = list(range(2, 25))
        first = post(client, prompt=prompt, max_tokens=6, trajectory_id="t")
        out = first["choices"][0]["token_ids"]
        time.sleep(0.3)  # the tool call outlasts the hold; nothing evicts the context
        # A chat template renders the previous answer's last tokens differently.
        turn2 = prompt + out[:-2] + [90, 91] + [70, 71, 72]
        second = post(client, prompt=turn2, max_tokens=6, trajectory_id="t")
        assert cached(second) == full_blocks(len(prompt) + len(out) - 2)
    assert eng.scheduler.num_holds == 2 and eng.scheduler.num_holds_used == 0
