"""The engine at its edges: errors in the middle of a step, and what they must leave
consistent (a sequence's tokens, its KV and its draft tree; which turns are committed)."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import tiny_model

from war.engine.config import EngineConfig
from war.engine.engine import Engine
from war.spec.config import SpecConfig
from war.types import GenRequest, GenResult, SamplingParams


class FlakyTokenizer:
    """Characters of token ids; raises on decode while ``fail`` is set (and counts
    calls down: it fails ``fail`` times)."""

    def __init__(self) -> None:
        self.fail = 0
        self.calls = 0

    def decode(self, ids: list[int]) -> str:
        self.calls += 1
        if self.fail:
            self.fail -= 1
            raise RuntimeError("detokenizer failed")
        return "".join(chr(97 + i % 26) for i in ids)


def _engine(tokenizer: FlakyTokenizer, **kw: object) -> Engine:
    cfg = EngineConfig(dtype="float64", block_size=4, num_kv_blocks=64,
                       spec=SpecConfig(min_prob=0.0, max_spec_tokens=6), **kw)  # type: ignore[arg-type]
    return Engine(tiny_model(0, torch.float64), cfg, tokenizer=tokenizer)


def _run(engine: Engine) -> dict[str, GenResult]:
    done: dict[str, GenResult] = {}
    while engine.has_unfinished():
        for r in engine.step():
            done[r.request_id] = r
    return done


def test_a_failed_stop_string_check_leaves_tokens_and_draft_tree_in_step() -> None:
    # Never matches ("{" is no character of the tokenizer's), so every step detokenizes.
    sp = SamplingParams(temperature=0.0, max_tokens=24, stop=("{",))
    prompt = (1, 2, 3, 4, 1, 2, 3, 4, 1, 2)
    want = _engine(FlakyTokenizer(), spec_mode="always").generate(
        [GenRequest("w", prompt, sp)])[0]
    tok = FlakyTokenizer()
    eng = _engine(tok, spec_mode="always")
    eng.add_request(GenRequest("a", prompt, sp, trajectory_id="T"))
    for _ in range(3):
        eng.step()
    tok.fail = 1
    with pytest.raises(RuntimeError, match="detokenizer"):
        eng.step()
    got = _run(eng)["a"]
    assert got.output_ids == want.output_ids and got.logprobs == want.logprobs
    # What the trajectory's next turn is appended to is what was generated, exactly.
    assert eng.drafts.held_tokens("T") == [*prompt, *got.output_ids]
    eng.check_integrity()
    assert eng.blocks.num_used_blocks == 0


def test_a_turn_done_in_a_failed_step_is_not_committed_before_it_is_returned() -> None:
    # "a" finishes in the step in which "b"'s postprocessing raises: "a" must not have
    # committed its turn (its trajectory's next turn would build on a result nobody got).
    tok = FlakyTokenizer()
    eng = _engine(tok, spec_mode="off", kv_hold_s=60.0)
    short = SamplingParams(temperature=0.0, max_tokens=3)
    eng.add_request(GenRequest("a", (5, 6, 7), short, trajectory_id="T", priority=1.0))
    eng.add_request(GenRequest("b", (8, 9), SamplingParams(temperature=0.0, max_tokens=8,
                                                         stop=("{",))))
    eng.step()
    eng.step()
    tok.fail = 1
    with pytest.raises(RuntimeError, match="detokenizer"):
        eng.step()  # "a" gets its 3rd token, then "b" raises
    assert eng.held_length("T") is None and eng.scheduler.num_held == 0
    assert eng.num_unfinished == 2
    [a] = eng.step()  # returned now
    assert a.request_id == "a" and len(a.output_ids) == 3 and a.finish_reason == "length"
    assert eng.held_length("T") == 6 and eng.scheduler.num_held == 1
    rest = _run(eng)
    assert list(rest) == ["b"] and len(rest["b"].output_ids) == 8
    eng.check_integrity()


def test_a_turn_done_in_a_failed_step_and_then_aborted_commits_nothing() -> None:
    tok = FlakyTokenizer()
    eng = _engine(tok, spec_mode="off", kv_hold_s=60.0)
    eng.add_request(GenRequest("a", (5, 6, 7), SamplingParams(temperature=0.0, max_tokens=2),
                               trajectory_id="T", priority=1.0))
    eng.add_request(GenRequest("b", (8, 9), SamplingParams(temperature=0.0, max_tokens=8,
                                                         stop=("{",))))
    eng.step()
    tok.fail = 1
    with pytest.raises(RuntimeError, match="detokenizer"):
        eng.step()
    for rid in ("a", "b"):  # what AsyncEngine does after a failed step
        res = eng.abort(rid)
        assert res is not None and res.finish_reason == "abort"
    assert not eng.has_unfinished() and eng.step() == []
    assert eng.held_length("T") is None and eng.scheduler.num_held == 0
    assert eng.blocks.num_used_blocks == 0
    eng.check_integrity()


def test_a_clock_that_does_not_advance_during_a_step() -> None:
    # A virtual clock (set by its owner, as for KV holds) measures steps of 0 s: the
    # step-time model cannot learn from them, but the step must not fail after it has
    # applied its outcome.
    cfg = EngineConfig(dtype="float64", block_size=4, num_kv_blocks=64, spec_mode="auto")
    eng = Engine(tiny_model(0, torch.float64), cfg, clock=lambda: 5.0)
    sp = SamplingParams(temperature=0.0, max_tokens=6)
    [res] = eng.generate([GenRequest("a", (1, 2, 3, 1, 2, 3), sp)])
    assert len(res.output_ids) == 6 and res.finish_reason == "length"
    assert eng.stats.num_steps >= 1 and not eng.has_unfinished()


@pytest.mark.parametrize("settings", [
    {"max_model_len": 100.5}, {"max_model_len": "100"}, {"max_model_len": True},
    {"enable_prefix_cache": "no"}, {"admit_whole_prompt": "no"}, {"admit_whole_prompt": 1},
    {"spec": {"max_spec_tokens": 3}},
])
def test_engine_config_refuses_settings_of_the_wrong_type(settings: dict[str, object]) -> None:
    with pytest.raises(ValueError, match=next(iter(settings))):
        EngineConfig(**settings)  # type: ignore[arg-type]


def test_prompt_ids_that_are_not_ints_are_named_as_such() -> None:
    import numpy as np

    engine = _engine(FlakyTokenizer())
    for bad in (np.int64(3), True, 2.0):
        with pytest.raises(ValueError, match=r"prompt_ids\[1\] = .* is not an int"):
            engine.add_request(GenRequest("r", (1, bad, 2)))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="token id 10000 outside the vocabulary"):
        engine.add_request(GenRequest("r", (1, 10000)))
    assert not engine.has_unfinished()
