"""AsyncEngine: one thread owns the engine, commands in order, errors and
cancellation reach the right place, close stops the thread; with a fake engine
and with a real tiny one."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from types import SimpleNamespace
from typing import Any, TypeVar

import pytest
import torch

from war.engine.async_engine import (
    AsyncEngine,
    DuplicateRequestError,
    EngineClosedError,
    EngineStepError,
)
from war.engine.config import EngineConfig
from war.engine.engine import Engine
from war.engine.loader import init_random
from war.engine.model_config import ModelConfig
from war.engine.stats import EngineStats
from war.types import GenRequest, GenResult, ReplicaLoad, SamplingParams

T = TypeVar("T")
TIMEOUT_S = 10.0

TINY = {
    "model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 128, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}


class FakeEngine:
    """Finishes a request after ``max_tokens`` steps; records calls and their threads."""

    def __init__(self, step_s: float = 0.0) -> None:
        self.model_config = SimpleNamespace(vocab_size=50, eos_token_id=())
        self.tokenizer = None
        self.max_model_len = 1000
        self.weight_version = 0
        self.stats = EngineStats()
        self.calls: list[tuple[str, object]] = []
        self.threads: set[int] = set()
        self.step_s = step_s
        self.fail_steps = 0  # how many next steps raise
        self.polls = 0  # has_unfinished() calls
        self._left: dict[str, tuple[GenRequest, int]] = {}

    def _record(self, name: str, arg: object) -> None:
        self.threads.add(threading.get_ident())
        self.calls.append((name, arg))

    def add_request(self, request: GenRequest) -> None:
        self._record("add_request", request.request_id)
        if request.prompt_ids[0] >= self.model_config.vocab_size:
            raise ValueError(f"request {request.request_id}: token outside the vocabulary")
        self._left[request.request_id] = (request, request.sampling.max_tokens)

    def abort(self, request_id: str) -> GenResult | None:
        self._record("abort", request_id)
        if request_id not in self._left:
            return None
        req, left = self._left.pop(request_id)
        n = req.sampling.max_tokens - left
        return GenResult(request_id, (7,) * n, (), "abort", len(req.prompt_ids))

    def step(self) -> list[GenResult]:
        self._record("step", len(self._left))
        if self.step_s:
            time.sleep(self.step_s)
        self.stats.num_steps += 1
        if self.fail_steps:
            self.fail_steps -= 1
            raise RuntimeError("boom")
        done = []
        for rid, (req, left) in list(self._left.items()):
            if left <= 1:
                del self._left[rid]
                n = req.sampling.max_tokens
                done.append(GenResult(rid, (7,) * n, (-1.0,) * n, "length", len(req.prompt_ids)))
            else:
                self._left[rid] = (req, left - 1)
        self.stats.num_generated_tokens += len(self._left) + len(done)
        return done

    def has_unfinished(self) -> bool:
        self.polls += 1
        return bool(self._left)

    def finish_trajectory(self, trajectory_id: str) -> bool:
        return False

    def wait_s(self) -> float | None:
        return None

    def load(self) -> ReplicaLoad:
        return ReplicaLoad(len(self._left), 0, 0, 0, 10, 16, 0.0, self.weight_version)

    def add_history(self, token_ids: Sequence[int], group_id: str | None = None) -> None:
        self._record("add_history", (tuple(token_ids), group_id))

    def observe_rl_step(self, rl_step: int) -> None:
        self._record("observe_rl_step", rl_step)

    def load_weights(self, weights: Any) -> int:
        self._record("load_weights", None)
        self.weight_version += 1
        return self.weight_version


def req(rid: str, max_tokens: int = 1, first: int = 1) -> GenRequest:
    return GenRequest(rid, (first, 2, 3), SamplingParams(max_tokens=max_tokens))


def run(fn: Callable[[], Awaitable[T]]) -> T:
    async def bounded() -> T:
        return await asyncio.wait_for(fn(), TIMEOUT_S)

    return asyncio.run(bounded())


async def until(cond: Callable[[], bool]) -> None:
    for _ in range(int(TIMEOUT_S / 0.01)):
        if cond():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached in time")


def test_results_order_and_one_owner_thread() -> None:
    fake = FakeEngine()

    async def main() -> list[GenResult]:
        async with AsyncEngine(fake) as ae:  # type: ignore[arg-type]
            await ae.add_history([5, 6], "g")
            await ae.observe_rl_step(3)
            finished: list[str] = []

            async def one(r: GenRequest) -> GenResult:
                res = await ae.generate(r)
                finished.append(res.request_id)
                return res

            results = await asyncio.gather(one(req("c", 3)), one(req("a", 1)), one(req("b", 2)))
            assert finished == ["a", "b", "c"]  # finish order follows the step counts
            assert await ae.load_weights({}) == 1
            assert ae.weight_version == 1 and ae.load().weight_version == 1
            assert ae.stats().num_steps == 3
            return results

    results = run(main)
    assert [r.request_id for r in results] == ["c", "a", "b"]
    assert [len(r.output_ids) for r in results] == [3, 1, 2]
    names = [name for name, _ in fake.calls]
    assert names[:2] == ["add_history", "observe_rl_step"]  # FIFO before the requests
    assert fake.calls[0][1] == ((5, 6), "g")
    assert names.index("load_weights") > max(i for i, n in enumerate(names) if n == "step")
    assert len(fake.threads) == 1 and threading.get_ident() not in fake.threads


def test_value_error_propagates_and_engine_keeps_serving() -> None:
    fake = FakeEngine()

    async def main() -> None:
        async with AsyncEngine(fake) as ae:  # type: ignore[arg-type]
            with pytest.raises(ValueError, match="outside the vocabulary"):
                await ae.generate(req("bad", first=99))
            assert (await ae.generate(req("good", 2))).finish_reason == "length"
            # A request id in flight twice is refused without touching the first one.
            first = asyncio.ensure_future(ae.generate(req("dup", 3)))
            await asyncio.sleep(0)
            with pytest.raises(DuplicateRequestError, match="already in flight"):
                await ae.generate(req("dup", 1))
            assert len((await first).output_ids) == 3
            long = asyncio.ensure_future(ae.generate(req("long", 10**9)))
            await asyncio.sleep(0)
            with pytest.raises(DuplicateRequestError, match="request long is already"):
                await ae.generate_all([req("other", 1), req("long", 1)])
            assert issubclass(DuplicateRequestError, ValueError)  # still a refusal
            long.cancel()
            with pytest.raises(asyncio.CancelledError):
                await long

    run(main)


def test_step_error_fails_inflight_and_thread_survives() -> None:
    fake = FakeEngine()

    async def main() -> None:
        async with AsyncEngine(fake) as ae:  # type: ignore[arg-type]
            fake.fail_steps = 1
            outcomes = await asyncio.gather(ae.generate(req("x", 2)), ae.generate(req("y", 5)),
                                            return_exceptions=True)
            for out in outcomes:
                assert isinstance(out, EngineStepError)
                assert isinstance(out.__cause__, RuntimeError) and "boom" in str(out)
            assert not fake.has_unfinished()  # both were aborted in the engine
            assert ae.is_running
            assert (await ae.generate(req("z", 2))).request_id == "z"

    run(main)


def test_a_failing_engine_thread_fails_every_request_and_refuses_new_ones() -> None:
    fake = FakeEngine(step_s=0.001)
    ae = AsyncEngine(fake)  # type: ignore[arg-type]

    def broken() -> None:  # a bug in the thread's own loop, not in a step
        raise OverflowError("timeout value is too large")

    async def main() -> None:
        ae.start()
        task = asyncio.ensure_future(ae.generate(req("long", 10**9)))
        await until(lambda: fake.stats.num_steps >= 2)
        ae._snapshot = broken  # type: ignore[method-assign]
        queued = asyncio.ensure_future(ae.add_history([5], None))
        with pytest.raises(EngineClosedError, match="engine thread failed: OverflowError"):
            await task
        # A command queued meanwhile is answered too (done before the failure, or failed).
        await asyncio.wait([queued])
        assert queued.done()
        assert not ae.is_running
        with pytest.raises(EngineClosedError):
            await ae.generate(req("late"))
        await ae.close()

    run(main)
    assert ("abort", "long") in fake.calls and not fake._left


def test_generate_all_admits_all_or_none() -> None:
    engine = Engine(init_random(ModelConfig.from_dict(TINY), seed=0),
                    EngineConfig(num_kv_blocks=8, block_size=8, max_num_batched_tokens=256))
    sp = SamplingParams(temperature=0.0, max_tokens=4)
    ok = GenRequest("ok", (1, 2, 3), sp)
    too_big = GenRequest("big", (1,) * 100, sp)  # within the context, beyond the KV cache

    async def main() -> list[GenResult]:
        async with AsyncEngine(engine) as ae:
            with pytest.raises(ValueError, match="KV cache"):
                await ae.generate_all([ok, too_big])
            assert ae.stats().num_aborted == 0 and ae.load().num_waiting == 0
            return await ae.generate_all([ok, GenRequest("ok2", (4, 5), sp)])

    results = run(main)
    assert [r.request_id for r in results] == ["ok", "ok2"]
    assert engine.stats.num_aborted == 0 and engine.stats.num_finished == 2

    # An engine without add_requests gets them one by one (a refusal aborts the ones
    # before it).
    fake = FakeEngine()

    async def fake_main() -> None:
        async with AsyncEngine(fake) as ae:  # type: ignore[arg-type]
            with pytest.raises(ValueError, match="outside the vocabulary"):
                await ae.generate_all([req("a", 3), req("b", first=99)])
            assert ("abort", "a") in fake.calls and not fake._left
            assert [r.request_id for r in await ae.generate_all([req("c"), req("d", 2)])] \
                == ["c", "d"]

    run(fake_main)


def test_cancelled_generate_aborts_the_request() -> None:
    fake = FakeEngine(step_s=0.001)

    async def main() -> None:
        async with AsyncEngine(fake) as ae:  # type: ignore[arg-type]
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(ae.generate(req("long", 10**9)), 0.05)
            await until(lambda: ("abort", "long") in fake.calls)
            await until(lambda: ae.load().num_running == 0)
            assert not fake._left

    run(main)


def test_explicit_abort_returns_partial_result_to_generate() -> None:
    fake = FakeEngine(step_s=0.001)

    async def main() -> None:
        async with AsyncEngine(fake) as ae:  # type: ignore[arg-type]
            task = asyncio.ensure_future(ae.generate(req("long", 10**9)))
            await until(lambda: fake.stats.num_steps >= 3)
            partial = await ae.abort("long")
            assert partial is not None and partial.finish_reason == "abort"
            assert await task == partial
            assert await ae.abort("unknown") is None

    run(main)


def test_close_fails_inflight_and_stops_the_thread() -> None:
    fake = FakeEngine(step_s=0.001)
    ae = AsyncEngine(fake)  # type: ignore[arg-type]

    async def main() -> None:
        ae.start()
        ae.start()  # idempotent
        task = asyncio.ensure_future(ae.generate(req("long", 10**9)))
        await until(lambda: fake.stats.num_steps >= 2)
        await ae.close()
        with pytest.raises(EngineClosedError):
            await task
        with pytest.raises(EngineClosedError):
            await ae.generate(req("late"))
        await ae.close()  # idempotent

    run(main)
    assert ae._thread is not None and not ae._thread.is_alive()
    assert not ae.is_running
    assert ("abort", "long") in fake.calls and not fake._left
    assert not any(t.name == "war-engine" and t.is_alive() for t in threading.enumerate())


def test_idle_thread_sleeps_instead_of_polling() -> None:
    fake = FakeEngine()

    async def main() -> None:
        async with AsyncEngine(fake) as ae:  # type: ignore[arg-type]
            await ae.generate(req("a", 2))
            polls = fake.polls
            await asyncio.sleep(0.2)
            assert fake.polls - polls <= 2  # no busy-waiting while idle
            await ae.generate(req("b", 1))  # and it wakes up for new work

    run(main)


def test_not_started_is_an_error() -> None:
    async def main() -> None:
        ae = AsyncEngine(FakeEngine())  # type: ignore[arg-type]
        with pytest.raises(RuntimeError, match="not started"):
            await ae.generate(req("a"))

    run(main)


def test_real_engine_concurrent_generates_match_a_plain_engine() -> None:
    config = ModelConfig.from_dict(TINY)
    engine_cfg = EngineConfig(num_kv_blocks=128, block_size=8, max_num_batched_tokens=256)
    greedy = SamplingParams(temperature=0.0, max_tokens=12)
    requests = [GenRequest(f"r{i}", tuple((i * 7 + j) % 64 for j in range(3 + i)), greedy,
                           group_id="g") for i in range(6)]
    sampled = [GenRequest(f"s{i}", (1, 2, 3, i), SamplingParams(max_tokens=8, seed=i))
               for i in range(3)]
    expected = Engine(init_random(config, seed=0), engine_cfg).generate(requests)

    async def main() -> list[GenResult]:
        engine = Engine(init_random(config, seed=0), engine_cfg)
        async with AsyncEngine(engine) as ae:
            results = await asyncio.gather(*(ae.generate(r) for r in requests + sampled))
            assert ae.load().num_running == 0 and ae.stats().num_finished == 9
            return list(results)

    results = run(main)
    assert [r.output_ids for r in results[:6]] == [r.output_ids for r in expected]
    for r in results[6:]:
        assert len(r.output_ids) == 8 and len(r.logprobs) == 8
    assert all(lp <= 0 for r in results for lp in r.logprobs)


def test_real_engine_load_weights_between_steps() -> None:
    config = ModelConfig.from_dict(TINY)
    engine = Engine(init_random(config, seed=0),
                    EngineConfig(num_kv_blocks=64, block_size=8, max_num_batched_tokens=256))
    new_weights = {k: v.clone() for k, v in init_random(config, seed=1).state_dict().items()}

    async def main() -> None:
        async with AsyncEngine(engine) as ae:
            task = asyncio.ensure_future(
                ae.generate(GenRequest("a", (1, 2, 3), SamplingParams(max_tokens=30))))
            assert await ae.load_weights(new_weights) == 1
            res = await task
            assert len(res.output_ids) == 30 and res.weight_version == 1
            assert ae.weight_version == 1

    run(main)
    assert torch.equal(engine.model.state_dict()["lm_head.weight"], new_weights["lm_head.weight"])
