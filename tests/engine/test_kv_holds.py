"""KV holds for agentic trajectories and whole-prompt admission in the engine: a
finished turn's context stays held through the tool call, a cold request waits
instead of evicting it, holds expire, give way before anyone is preempted, end with
the trajectory, and never change what is generated."""

from __future__ import annotations

import asyncio
import time

import pytest

from war.engine.async_engine import AsyncEngine
from war.engine.config import EngineConfig
from war.engine.engine import Engine
from war.engine.model import CausalLM
from war.types import GenRequest, GenResult, SamplingParams

SP = SamplingParams(temperature=0.0, max_tokens=6)
# 16 blocks of 4 tokens. Trajectory "t": 30 prompt tokens + 6 generated, of which 35
# are computed: 8 full blocks stay held. A cold request of 34 tokens needs 9 to start.
PROMPT_T = tuple(range(1, 31))
PROMPT_C = tuple(range(40, 74))


class Clock:
    """Virtual time: a microsecond per reading (steps take time), set by the test."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1e-6
        return self.now


def make(model: CausalLM, hold: float, whole: bool = True, blocks: int = 16
         ) -> tuple[Engine, Clock]:
    clock = Clock()
    cfg = EngineConfig(dtype="float64", block_size=4, num_kv_blocks=blocks, spec_mode="off",
                       kv_hold_s=hold, admit_whole_prompt=whole)
    return Engine(model, cfg, clock=clock), clock


def drain(engine: Engine, clock: Clock, limit: int = 500) -> dict[str, GenResult]:
    done: dict[str, GenResult] = {}
    for _ in range(limit):
        clock.now += 0.001
        for r in engine.step():
            done[r.request_id] = r
        if not engine.has_unfinished() or engine.wait_s() is not None:
            break
    engine.check_integrity()
    return done


def test_a_held_context_survives_a_cold_request(model64: CausalLM) -> None:
    eng, clock = make(model64, hold=10.0)
    first = eng.generate([GenRequest("t0", PROMPT_T, SP, trajectory_id="t")])[0]
    assert eng.scheduler.num_held == 1
    # The tool call: a cold request arrives and cannot fit beside the held 8 blocks.
    eng.add_request(GenRequest("c", PROMPT_C, SP))
    assert drain(eng, clock) == {}
    assert eng.wait_s() == pytest.approx(10.0 - clock.now, abs=0.01)
    # The trajectory's next turn takes its context over: nothing recomputed.
    turn2 = PROMPT_T + first.output_ids + (5, 6, 7)
    eng.add_request(GenRequest("t1", turn2, SP, trajectory_id="t"))
    done = drain(eng, clock)
    assert set(done) == {"t1"} and done["t1"].num_cached_tokens == 32
    t1 = done["t1"].output_ids
    assert eng.scheduler.num_holds_used == 1
    # The trajectory ends: its hold goes, and the cold request runs.
    assert eng.finish_trajectory("t") and not eng.finish_trajectory("t")
    done = drain(eng, clock)
    assert set(done) == {"c"}
    assert eng.scheduler.num_held == 0 and eng.stats.num_preemptions == 0
    # Holds change the order of work, never what is generated.
    plain = Engine(model64, EngineConfig(dtype="float64", block_size=4, num_kv_blocks=64,
                                         spec_mode="off"))
    ref = plain.generate([GenRequest("t0", PROMPT_T, SP), GenRequest("t1", turn2, SP),
                          GenRequest("c", PROMPT_C, SP)])
    assert [r.output_ids for r in ref] == [first.output_ids, t1, done["c"].output_ids]


def test_without_a_hold_the_cold_request_evicts_the_context(model64: CausalLM) -> None:
    eng, clock = make(model64, hold=0.0)
    first = eng.generate([GenRequest("t0", PROMPT_T, SP, trajectory_id="t")])[0]
    eng.add_request(GenRequest("c", PROMPT_C, SP))
    assert set(drain(eng, clock)) == {"c"}
    turn2 = PROMPT_T + first.output_ids + (5, 6, 7)
    t1 = eng.generate([GenRequest("t1", turn2, SP, trajectory_id="t")])[0]
    assert t1.num_cached_tokens < 32


def test_a_hold_expires(model64: CausalLM) -> None:
    eng, clock = make(model64, hold=2.0)
    eng.generate([GenRequest("t0", PROMPT_T, SP, trajectory_id="t")])
    eng.add_request(GenRequest("c", PROMPT_C, SP))
    assert drain(eng, clock) == {}
    clock.now = 2.5  # the tool call outlasted the hold
    assert eng.wait_s() == 0.0
    assert set(drain(eng, clock)) == {"c"}
    # "t"'s hold expired ("c", with no trajectory, holds nothing)
    assert eng.scheduler.num_held == 0 and eng.scheduler.hold_expiry is None


def test_holds_give_way_before_a_running_sequence_is_preempted(model64: CausalLM) -> None:
    eng, clock = make(model64, hold=10.0)
    eng.generate([GenRequest("t0", PROMPT_T, SP, trajectory_id="t")])  # 8 blocks held
    # 4 prompt tokens + 36 generated: 10 blocks, more than the 8 left once it grows.
    eng.add_request(GenRequest("g", (90, 91, 92, 93), SamplingParams(temperature=0.0,
                                                                     max_tokens=36)))
    done = drain(eng, clock)
    assert set(done) == {"g"} and len(done["g"].output_ids) == 36
    assert eng.scheduler.num_holds_broken == 1 and eng.stats.num_preemptions == 0


def test_a_request_of_higher_priority_waits_too(model64: CausalLM) -> None:
    eng, clock = make(model64, hold=10.0)
    eng.generate([GenRequest("t0", PROMPT_T, SP, trajectory_id="t")])
    eng.add_request(GenRequest("c", PROMPT_C, SP, priority=5.0))  # "t" held at 0.0
    assert drain(eng, clock) == {}
    assert eng.scheduler.num_holds_broken == 0 and eng.scheduler.num_held == 1


def test_a_held_turn_that_cannot_fit_waits_for_another_hold(model64: CausalLM) -> None:
    eng, clock = make(model64, hold=10.0)
    first = eng.generate([GenRequest("t0", PROMPT_T, SP, trajectory_id="t")])[0]  # 8 held
    clock.now = 5.0
    eng.generate([GenRequest("u0", tuple(range(40, 62)), SP, trajectory_id="u")])  # 6 held
    # "t"'s next turn needs 4 more blocks and 2 are free: it waits for a hold to end
    # (the first expires at 10 s), rather than evicting "u"'s context.
    turn2 = PROMPT_T + first.output_ids + tuple(range(80, 90))
    eng.add_request(GenRequest("t1", turn2, SP, trajectory_id="t"))
    assert drain(eng, clock) == {}
    assert eng.wait_s() == pytest.approx(10.0 - clock.now, abs=0.01)
    # "u" ends: its blocks are free, and "t1" runs on its whole held context.
    assert eng.finish_trajectory("u")
    done = drain(eng, clock)
    assert set(done) == {"t1"} and done["t1"].num_cached_tokens == 32
    assert eng.scheduler.num_holds_broken == 0


def test_generate_does_not_wait_for_holds(model64: CausalLM) -> None:
    eng, _ = make(model64, hold=10.0)
    out = eng.generate([GenRequest("t0", PROMPT_T, SP, trajectory_id="t"),
                        GenRequest("c", PROMPT_C, SP, trajectory_id="u"),
                        GenRequest("d", tuple(range(70, 96)), SP, trajectory_id="v")])
    assert len(out) == 3  # holds of finished turns are broken when nothing else runs
    eng.check_integrity()


def test_weight_reload_releases_holds(model64: CausalLM) -> None:
    eng, _ = make(model64, hold=10.0)
    eng.generate([GenRequest("t0", PROMPT_T, SP, trajectory_id="t")])
    eng.load_weights(model64.state_dict())
    assert eng.scheduler.num_held == 0
    eng.check_integrity()
    assert eng.blocks.num_free_blocks == 16


def test_async_engine_waits_for_the_hold_then_serves(model64: CausalLM) -> None:
    cfg = EngineConfig(dtype="float64", block_size=4, num_kv_blocks=16, spec_mode="off",
                       kv_hold_s=0.5, admit_whole_prompt=True)
    engine = Engine(model64, cfg)
    calls = 0
    step = engine.step

    def counted() -> list[GenResult]:
        nonlocal calls
        calls += 1
        return step()

    engine.step = counted  # type: ignore[method-assign]

    async def main() -> tuple[float, int]:
        async with AsyncEngine(engine) as ae:
            await ae.generate(GenRequest("t0", PROMPT_T, SP, trajectory_id="t"))
            t0 = time.perf_counter()
            before = calls
            await ae.generate(GenRequest("c", PROMPT_C, SP))  # waits out the hold
            return time.perf_counter() - t0, calls - before

    waited, steps = asyncio.run(main())
    assert waited < 30.0  # it woke up when the hold expired
    assert steps < 50  # and slept until then instead of spinning (thousands of steps)


def test_a_hold_longer_than_a_wait_can_be(model64: CausalLM) -> None:
    # 1e10 s is beyond threading.TIMEOUT_MAX: waiting for its expiry must not kill the
    # engine thread; the cold request waits until the trajectory is finished.
    cfg = EngineConfig(dtype="float64", block_size=4, num_kv_blocks=16, spec_mode="off",
                       kv_hold_s=1e10, admit_whole_prompt=True)
    engine = Engine(model64, cfg)

    async def main() -> GenResult:
        async with AsyncEngine(engine) as ae:
            await ae.generate(GenRequest("t0", PROMPT_T, SP, trajectory_id="t"))
            cold = asyncio.ensure_future(ae.generate(GenRequest("c", PROMPT_C, SP)))
            for _ in range(500):
                if engine.scheduler.blocked:
                    break
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.05)  # the thread waits on the hold now
            assert engine.scheduler.blocked and not cold.done() and ae.is_running
            assert await ae.finish_trajectory("t")
            return await cold

    async def bounded() -> GenResult:
        return await asyncio.wait_for(main(), 30.0)

    res = asyncio.run(bounded())
    assert res.finish_reason == "length" and len(res.output_ids) == SP.max_tokens


def test_hold_settings_are_validated() -> None:
    for bad in (-1.0, float("inf"), float("nan"), True, "1"):
        with pytest.raises(ValueError, match="kv_hold_s"):
            EngineConfig(kv_hold_s=bad)  # type: ignore[arg-type]


def test_aborting_a_queued_turn_releases_its_hold(model64: CausalLM) -> None:
    eng, _ = make(model64, hold=10.0)
    first = eng.generate([GenRequest("t0", PROMPT_T, SP, trajectory_id="t")])[0]
    assert eng.scheduler.num_held == 1 and eng.blocks.num_free_blocks == 8
    turn2 = PROMPT_T + first.output_ids + (5, 6, 7)
    eng.add_request(GenRequest("t1", turn2, SP, trajectory_id="t"))
    assert eng.abort("t1") is not None  # cancelled before it was scheduled
    # As aborting it once running would: the hold is gone, its blocks free (and
    # still cached), and the trajectory's next turn sends its whole context.
    assert eng.scheduler.num_held == 0 and eng.blocks.num_free_blocks == 16
    assert eng.blocks.num_used_blocks == 0 and eng.blocks.num_cached_blocks >= 8
    assert eng.held_length("t") is None and eng.scheduler.num_holds_used == 0
    eng.check_integrity()
    again = eng.generate([GenRequest("t2", turn2, SP, trajectory_id="t")])[0]
    assert again.num_cached_tokens == 32


def test_aborting_a_running_turn_leaves_the_same(model64: CausalLM) -> None:
    eng, _ = make(model64, hold=10.0)
    first = eng.generate([GenRequest("t0", PROMPT_T, SP, trajectory_id="t")])[0]
    turn2 = PROMPT_T + first.output_ids + (5, 6, 7)
    eng.add_request(GenRequest("t1", turn2, SP, trajectory_id="t"))
    eng.step()  # admitted: it took the hold over
    assert eng.scheduler.num_holds_used == 1
    eng.abort("t1")
    assert eng.scheduler.num_held == 0 and eng.blocks.num_free_blocks == 16
    assert eng.held_length("t") is None
    eng.check_integrity()


def test_aborting_one_of_two_queued_turns_keeps_the_hold(model64: CausalLM) -> None:
    eng, clock = make(model64, hold=10.0)
    first = eng.generate([GenRequest("t0", PROMPT_T, SP, trajectory_id="t")])[0]
    turn2 = PROMPT_T + first.output_ids + (5, 6, 7)
    eng.add_request(GenRequest("a", turn2, SP, trajectory_id="t"))
    eng.add_request(GenRequest("b", turn2, SP, trajectory_id="t"))
    eng.abort("a")
    assert eng.scheduler.num_held == 1  # "b" takes it over
    done = drain(eng, clock)
    assert set(done) == {"b"} and done["b"].num_cached_tokens == 32
    assert eng.scheduler.num_holds_used == 1
