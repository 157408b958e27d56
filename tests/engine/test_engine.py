"""The engine end to end on tiny float64 models: lossless speculation,
prefix reuse, preemption, weight reload, bad input."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import pytest
import torch
from engine_helpers import tiny_model

from war.engine.config import EngineConfig
from war.engine.engine import Engine
from war.engine.loader import save_model
from war.engine.model import CausalLM
from war.spec.config import SpecConfig
from war.types import GenRequest, GenResult, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=40)


def make_engine(model: CausalLM, **kw: object) -> Engine:
    cfg = EngineConfig(dtype="float64", block_size=kw.pop("block_size", 4),  # type: ignore[arg-type]
                       num_kv_blocks=kw.pop("num_kv_blocks", 256), **kw)  # type: ignore[arg-type]
    return Engine(model, cfg)


def prompts(seed: int, n: int, vocab: int = 97) -> list[tuple[int, ...]]:
    """Prompts with repeated patterns, so that suffix drafts get proposed."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        pattern = [rng.randrange(vocab) for _ in range(rng.randint(2, 6))]
        noise = [rng.randrange(vocab) for _ in range(rng.randint(0, 9))]
        body = pattern * rng.randint(2, 6) + noise
        out.append(tuple(body[: rng.randint(3, len(body))]))
    return out


def run(engine: Engine, reqs: list[GenRequest], stagger: int = 0) -> dict[str, GenResult]:
    """Runs requests, adding them ``stagger`` steps apart (0: all at once)."""
    pending = list(reqs)
    done: dict[str, GenResult] = {}
    for _ in range(10_000):
        if pending and (stagger == 0 or engine.stats.num_steps % stagger == 0):
            batch = pending if stagger == 0 else pending[:1]
            for r in batch:
                engine.add_request(r)
            pending = pending[len(batch):]
        for res in engine.step():
            done[res.request_id] = res
        if not pending and not engine.has_unfinished():
            break
    assert len(done) == len(reqs)
    engine.check_integrity()
    return done


def requests(ps: list[tuple[int, ...]], sp: SamplingParams = GREEDY) -> list[GenRequest]:
    return [GenRequest(f"r{i}", p, sp, group_id=f"g{i % 3}") for i, p in enumerate(ps)]


def assert_same(a: dict[str, GenResult], b: dict[str, GenResult]) -> None:
    assert a.keys() == b.keys()
    for rid in a:
        assert a[rid].output_ids == b[rid].output_ids, rid
        assert a[rid].finish_reason == b[rid].finish_reason, rid
        assert a[rid].logprobs == pytest.approx(b[rid].logprobs, abs=1e-9), rid


@pytest.mark.parametrize("tree", [False, True])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_greedy_speculation_is_lossless(model64: CausalLM, tree: bool, seed: int) -> None:
    ps = prompts(seed, 7)
    spec = SpecConfig.tree_preset() if tree else SpecConfig()
    spec = SpecConfig(**{**spec.__dict__, "min_prob": 0.0, "max_spec_tokens": 8})
    base = run(make_engine(model64, spec_mode="off"), requests(ps), stagger=seed)
    eng = make_engine(model64, spec_mode="always", spec=spec)
    spec_out = run(eng, requests(ps), stagger=seed)
    assert_same(base, spec_out)
    assert eng.stats.num_draft_tokens > 0 and eng.stats.num_accepted_tokens > 0
    assert eng.stats.tokens_per_step > 1.0


def test_greedy_lossless_under_preemption(model64: CausalLM) -> None:
    ps = prompts(7, 10)
    base = run(make_engine(model64, spec_mode="off"), requests(ps))
    spec = SpecConfig(min_prob=0.0, max_spec_tokens=6)
    # 24 blocks of 4 tokens: far too few for ten sequences of up to ~75 tokens.
    eng = make_engine(model64, spec_mode="always", spec=spec, num_kv_blocks=24,
                      max_num_batched_tokens=32)
    out = run(eng, requests(ps))
    assert_same(base, out)
    assert eng.stats.num_preemptions > 0
    assert sum(r.num_preemptions for r in out.values()) == eng.stats.num_preemptions


def test_auto_mode_is_lossless_and_counts(model64: CausalLM) -> None:
    ps = prompts(11, 5)
    base = run(make_engine(model64, spec_mode="off"), requests(ps))
    eng = make_engine(model64, spec_mode="auto")
    out = run(eng, requests(ps))
    assert_same(base, out)
    for r in out.values():
        assert len(r.output_ids) == len(r.logprobs) == GREEDY.max_tokens
        assert r.finish_reason == "length"
        assert 1 <= r.num_forward_passes <= len(r.output_ids)
    st = eng.stats
    assert st.num_generated_tokens == sum(len(r.output_ids) for r in out.values())
    assert st.num_decode_passes == sum(r.num_forward_passes for r in out.values())
    assert len(eng.timeline) == st.num_steps
    assert sum(r.draft_tokens for r in eng.timeline) == st.num_draft_tokens
    assert sum(r.accepted_tokens for r in eng.timeline) == st.num_accepted_tokens


def test_calibration_learns_once_per_step(model64: CausalLM,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Every sequence's verified draft tokens reach the calibration in one call per
    step (its forgetting counts steps), and all of them do."""
    eng = make_engine(model64, spec_mode="always",
                      spec=SpecConfig(min_prob=0.0, max_spec_tokens=6))
    calls: list[tuple[int, int, int]] = []  # (step, draft tokens, accepted)
    learn = eng.policy.observe_verification

    def observe(probs: object, accepted: object) -> None:
        calls.append((eng.stats.num_steps, len(probs), int(sum(accepted))))  # type: ignore[arg-type]
        learn(probs, accepted)  # type: ignore[arg-type]

    monkeypatch.setattr(eng.policy, "observe_verification", observe)
    run(eng, requests(prompts(5, 6)))
    steps = [c[0] for c in calls]
    assert len(steps) == len(set(steps)) > 0  # at most one call a step
    assert sum(c[1] for c in calls) == eng.stats.num_draft_tokens
    assert sum(c[2] for c in calls) == eng.stats.num_accepted_tokens
    assert eng.policy.calibrator.num_observations == eng.stats.num_draft_tokens
    assert max(r.num_seqs for r in eng.timeline if r.draft_tokens) > 1  # batched steps


def test_prefix_cache_reuse_and_multi_turn(model64: CausalLM) -> None:
    eng = make_engine(model64, spec_mode="off")
    prompt = tuple(range(1, 23))  # 22 tokens = 5 full blocks of 4 + 2
    sp = SamplingParams(temperature=0.0, max_tokens=6)
    first = eng.generate([GenRequest("a", prompt, sp, trajectory_id="t")])[0]
    assert first.num_cached_tokens == 0
    second = eng.generate([GenRequest("b", prompt, sp)])[0]
    assert second.num_cached_tokens == 20  # whole blocks, leaving one token to compute
    assert second.output_ids == first.output_ids
    # The next turn re-sends the whole context plus new tokens: earlier turns are cached.
    turn2 = prompt + first.output_ids + (5, 6, 7)
    third = eng.generate([GenRequest("c", turn2, sp, trajectory_id="t")])[0]
    assert third.num_cached_tokens == (len(prompt) + len(first.output_ids) - 1) // 4 * 4
    assert eng.stats.prefix_hit_rate == pytest.approx(
        (20 + third.num_cached_tokens) / (2 * len(prompt) + len(turn2)))


def test_weight_reload_clears_cache_and_bumps_version(model64: CausalLM) -> None:
    eng = make_engine(model64, spec_mode="off")
    prompt = tuple(range(3, 30))
    sp = SamplingParams(temperature=0.0, max_tokens=5)
    eng.generate([GenRequest("a", prompt, sp)])
    other = tiny_model(5)
    assert eng.load_weights(other.state_dict()) == 1
    res = eng.generate([GenRequest("b", prompt, sp)])[0]
    assert res.num_cached_tokens == 0 and res.weight_version == 1
    fresh = make_engine(tiny_model(5), spec_mode="off").generate([GenRequest("x", prompt, sp)])[0]
    assert res.output_ids == fresh.output_ids


def test_weight_reload_mid_flight_recomputes(model64: CausalLM) -> None:
    eng = make_engine(model64, spec_mode="off")
    sp = SamplingParams(temperature=0.0, max_tokens=12)
    eng.add_request(GenRequest("a", tuple(range(5, 20)), sp))
    for _ in range(4):
        eng.step()
    eng.load_weights(tiny_model(9).state_dict())
    out = []
    while eng.has_unfinished():
        out += eng.step()
    assert [r.request_id for r in out] == ["a"]
    assert out[0].weight_version == 1 and out[0].num_preemptions == 1
    assert len(out[0].output_ids) == 12
    eng.check_integrity()


@pytest.mark.parametrize("odd", ["array", "ints"])
def test_weights_that_are_not_float_tensors_are_refused_before_any_is_copied(odd: str) -> None:
    # A value that is no float tensor failed in its copy, after the tensors before it
    # had been copied: the weights were half updated while the version, the prefix
    # cache and the sequences in flight stayed as they were.
    eng = make_engine(tiny_model(0), spec_mode="off")
    sp = SamplingParams(temperature=0.0, max_tokens=6)
    prompt = tuple(range(3, 20))
    want = eng.generate([GenRequest("a", prompt, sp)])[0]
    before = {k: v.clone() for k, v in eng.model.state_dict().items()}
    new = dict(tiny_model(5).state_dict())
    last = list(new)[-1]
    new[last] = new[last].numpy() if odd == "array" else new[last].long()  # type: ignore[assignment]
    with pytest.raises(ValueError, match=last):
        eng.load_weights(new)
    assert all(torch.equal(v, before[k]) for k, v in eng.model.state_dict().items())
    assert eng.weight_version == 0
    again = eng.generate([GenRequest("b", prompt, sp)])[0]
    assert again.output_ids == want.output_ids and again.num_cached_tokens > 0


def test_priority_orders_the_queue(model64: CausalLM) -> None:
    eng = make_engine(model64, spec_mode="off", max_num_seqs=1)
    sp = SamplingParams(temperature=0.0, max_tokens=3)
    eng.add_request(GenRequest("low", (1, 2, 3), sp, priority=0.0))
    eng.add_request(GenRequest("high", (4, 5, 6), sp, priority=5.0))
    order = []
    while eng.has_unfinished():
        order += [r.request_id for r in eng.step()]
    assert order == ["high", "low"]


def test_sampling_with_seed_is_reproducible_and_speculation_keeps_logprobs(
    model64: CausalLM,
) -> None:
    ps = prompts(5, 4)
    sp = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=20, seed=123)
    a = run(make_engine(model64, spec_mode="off"), requests(ps, sp))
    b = run(make_engine(model64, spec_mode="off"), requests(ps, sp))
    assert_same(a, b)
    eng = make_engine(model64, spec_mode="always", spec=SpecConfig(min_prob=0.0))
    c = run(eng, requests(ps, sp))
    # Logprobs are the model's: rescoring the sampled tokens without drafts gives them.
    for rid, res in c.items():
        i = int(rid[1:])
        ctx = torch.tensor([list(ps[i]) + list(res.output_ids)])
        with torch.inference_mode():
            logits = model64.forward_dense(ctx)[0]
        lp = torch.log_softmax(logits, -1)
        want = [lp[len(ps[i]) - 1 + j, t].item() for j, t in enumerate(res.output_ids)]
        assert res.logprobs == pytest.approx(want, abs=1e-9)


def test_stop_tokens_and_stop_strings(model64: CausalLM) -> None:
    class CharTokenizer:
        def decode(self, ids: list[int]) -> str:
            return "".join(chr(97 + i % 26) for i in ids)

    eng = make_engine(model64, spec_mode="off")
    prompt = (1, 2, 3, 4)
    free = eng.generate([GenRequest("f", prompt, GREEDY)])[0].output_ids
    stop_tok = free[5]
    first = free.index(stop_tok)
    sp = SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=(stop_tok,))
    res = eng.generate([GenRequest("s", prompt, sp)])[0]
    assert res.output_ids == free[: first + 1] and res.finish_reason == "stop"
    eng2 = Engine(model64, EngineConfig(dtype="float64", block_size=4, num_kv_blocks=64),
                  tokenizer=CharTokenizer())
    text = CharTokenizer().decode(list(free))
    stop = text[6:8]
    res2 = eng2.generate([GenRequest(
        "t", prompt, SamplingParams(temperature=0.0, max_tokens=40, stop=(stop,)))])[0]
    assert res2.finish_reason == "stop"
    got = CharTokenizer().decode(list(res2.output_ids))
    assert got.endswith(stop) and stop not in got[:-1]


def test_a_stop_string_ends_a_step_that_also_holds_a_stop_token() -> None:
    # With drafts one step emits several tokens: here a stop string completes at the
    # 6th token and the stop token is the 8th, both in the second step. The output
    # ends at whichever comes first, as without speculation. (Its own model: the
    # shared one gets other weights loaded by earlier tests.)
    model = tiny_model(0, torch.float64)

    class CharTokenizer:
        def decode(self, ids: list[int]) -> str:
            return "".join(chr(97 + i % 26) for i in ids)

    def engine(mode: str) -> Engine:
        return Engine(model, EngineConfig(
            dtype="float64", block_size=4, num_kv_blocks=64, spec_mode=mode,
            spec=SpecConfig(min_prob=0.0, max_spec_tokens=8)), tokenizer=CharTokenizer())

    prompt = (1, 2, 3, 4)
    off, spec = engine("off"), engine("always")
    free = off.generate([GenRequest("f", prompt, GREEDY)])[0].output_ids
    spec.generate([GenRequest("f", prompt, GREEDY)])  # its history drafts the next one
    stop_tok = free[7]
    stop = CharTokenizer().decode(list(free[4:6]))
    assert free.index(stop_tok) == 7 and stop not in CharTokenizer().decode(list(free[:5]))
    sp = SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=(stop_tok,),
                        stop=(stop,))
    want = off.generate([GenRequest("a", prompt, sp)])[0]
    got = spec.generate([GenRequest("b", prompt, sp)])[0]
    assert want.output_ids == free[:6] and want.finish_reason == "stop"
    assert got.output_ids == want.output_ids and got.finish_reason == "stop"
    assert got.logprobs == pytest.approx(want.logprobs, abs=1e-9)
    assert got.num_forward_passes == 2  # the prefill, then one step of drafts
    spec.check_integrity()


def test_bad_requests_raise_and_engine_keeps_working(model64: CausalLM) -> None:
    eng = make_engine(model64, spec_mode="off", num_kv_blocks=64)
    sp = SamplingParams(temperature=0.0, max_tokens=4)
    with pytest.raises(ValueError, match="vocabulary"):
        eng.add_request(GenRequest("v", (1, 97), sp))
    with pytest.raises(ValueError, match="vocabulary"):
        eng.add_request(GenRequest("n", (1, -1), sp))
    with pytest.raises(ValueError, match="context length"):
        eng.add_request(GenRequest("c", (1,) * 500, SamplingParams(max_tokens=100)))
    with pytest.raises(ValueError, match="KV cache"):
        eng.add_request(GenRequest("k", (1,) * 250, SamplingParams(max_tokens=10)))
    with pytest.raises(ValueError, match="tokenizer"):
        eng.add_request(GenRequest("s", (1, 2), SamplingParams(max_tokens=4, stop=("x",))))
    eng.add_request(GenRequest("ok", (1, 2, 3), sp))
    with pytest.raises(ValueError, match="already in flight"):
        eng.add_request(GenRequest("ok", (1, 2, 3), sp))
    out = []
    while eng.has_unfinished():
        out += eng.step()
    assert [r.request_id for r in out] == ["ok"] and len(out[0].output_ids) == 4
    assert eng.stats.num_finished == 1


def test_requests_added_together_are_all_or_none(model64: CausalLM) -> None:
    eng = make_engine(model64, spec_mode="off", num_kv_blocks=64)  # 256 tokens of KV
    sp = SamplingParams(temperature=0.0, max_tokens=4)
    eng.generate([GenRequest("t1", (5, 6, 7), sp, trajectory_id="T")])
    assert eng.held_length("T") == 7 and eng.held_length("other") is None
    turn = GenRequest("t2", (8, 9), sp, trajectory_id="T", continues=True)
    refused = [
        ([turn, GenRequest("big", (1,) * 250, SamplingParams(max_tokens=10))], "KV cache"),
        ([turn, dataclasses.replace(turn, request_id="t2b")], "not held"),  # one claim each
        ([GenRequest("x", (1,), sp, trajectory_id="T"), turn], "not held"),
        ([turn, turn], "twice"),
    ]
    for batch, needle in refused:
        with pytest.raises(ValueError, match=needle):
            eng.add_requests(batch)
        # Nothing was queued, aborted or taken over: the trajectory still continues.
        assert not eng.has_unfinished() and eng.stats.num_aborted == 0
        assert eng.held_length("T") == 7 and eng.drafts.num_idle == 1
    [res] = eng.generate([turn])
    assert res.num_prompt_tokens == 7 + 2 and len(res.output_ids) == 4
    eng.check_integrity()


def test_abort_returns_partial_result(model64: CausalLM) -> None:
    eng = make_engine(model64, spec_mode="off")
    eng.add_request(GenRequest("a", (1, 2, 3), SamplingParams(temperature=0.0, max_tokens=30)))
    for _ in range(5):
        eng.step()
    res = eng.abort("a")
    assert res is not None and res.finish_reason == "abort" and 0 < len(res.output_ids) < 30
    assert eng.abort("a") is None
    assert not eng.has_unfinished()
    eng.check_integrity()
    assert eng.blocks.num_used_blocks == 0


def test_load_reports_in_flight_work(model64: CausalLM) -> None:
    eng = make_engine(model64, spec_mode="off", max_num_seqs=2)
    sp = SamplingParams(temperature=0.0, max_tokens=8)
    for i in range(4):
        eng.add_request(GenRequest(f"r{i}", (1, 2, 3, 4, 5), sp))
    eng.step()
    load = eng.load()
    assert load.num_running == 2 and load.num_waiting == 2
    assert load.kv_blocks_used > 0 and load.kv_blocks_total == 256
    assert load.tokens_in_flight >= 20


def test_speculative_sampling_matches_the_model_distribution() -> None:
    """Chi-square over the first two sampled tokens of a 6-token model, with drafts
    verified every step, against the exact distribution computed densely."""
    from test_verify import chi_square_p

    from war.engine.sampling import sampling_probs

    model = tiny_model(3, torch.float64, vocab_size=6)
    prompt = (1, 2, 3, 1, 2, 3, 1, 2)
    sp = SamplingParams(temperature=0.3, max_tokens=3)  # the second token may be a draft's
    with torch.inference_mode():
        p1 = sampling_probs(model.forward_dense(torch.tensor([prompt]))[0, -1:], sp)[0]
        ctx = torch.tensor([[*prompt, t] for t in range(6)])
        p2 = sampling_probs(model.forward_dense(ctx)[:, -1], sp)
    expected = {(a, b): float(p1[a] * p2[a, b]) for a in range(6) for b in range(6)}
    eng = make_engine(model, spec_mode="always", spec=SpecConfig(min_prob=0.0),
                      max_num_seqs=256, max_num_batched_tokens=4096, num_kv_blocks=2048)
    total = 3000
    counts: dict[tuple[int, int], int] = {}
    for start in range(0, total, 250):
        reqs = [GenRequest(f"s{i}", prompt, sp, group_id="g") for i in range(start, start + 250)]
        for res in eng.generate(reqs):
            pair = (res.output_ids[0], res.output_ids[1])
            counts[pair] = counts.get(pair, 0) + 1
    assert eng.stats.num_draft_tokens >= total // 2  # drafts were verified, not skipped
    assert 0 < eng.stats.num_accepted_tokens < eng.stats.num_draft_tokens
    assert chi_square_p(counts, expected, total) > 1e-4


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_runs_in_lower_precision(dtype: str) -> None:
    model = tiny_model(4, torch.float32)
    eng = Engine(model, EngineConfig(dtype=dtype, block_size=8, num_kv_blocks=64,
                                     spec_mode="always", spec=SpecConfig(min_prob=0.0)))
    assert eng.kv.dtype == getattr(torch, dtype)
    res = eng.generate(requests(prompts(3, 3), SamplingParams(temperature=0.7, max_tokens=12)))
    for r in res:
        assert len(r.output_ids) == 12 and all(lp <= 0.0 for lp in r.logprobs)
    eng.check_integrity()


def test_continuing_requests_send_only_new_tokens(model64: CausalLM) -> None:
    from war.types import UnknownTrajectory

    eng = make_engine(model64, spec_mode="off")
    sp = SamplingParams(temperature=0.0, max_tokens=5)
    prompt = tuple(range(1, 15))
    first = eng.generate([GenRequest("a", prompt, sp, trajectory_id="t")])[0]
    new = (7, 8, 9)
    cont = eng.generate([GenRequest("b", new, sp, trajectory_id="t", continues=True)])[0]
    full = prompt + first.output_ids + new
    ref = make_engine(model64, spec_mode="off").generate([GenRequest("c", full, sp)])[0]
    assert cont.output_ids == ref.output_ids
    assert cont.num_prompt_tokens == len(full)
    assert cont.num_cached_tokens == (len(prompt) + len(first.output_ids) - 1) // 4 * 4
    with pytest.raises(UnknownTrajectory, match="whole context"):
        eng.add_request(GenRequest("d", new, sp, trajectory_id="other", continues=True))
    with pytest.raises(ValueError, match="trajectory_id"):
        GenRequest("e", new, sp, continues=True)
    # While a turn is in flight the trajectory cannot be continued a second time.
    eng.add_request(GenRequest("f", (1, 2), sp, trajectory_id="t", continues=True))
    with pytest.raises(UnknownTrajectory):
        eng.add_request(GenRequest("g", (3,), sp, trajectory_id="t", continues=True))


@pytest.mark.parametrize(("settings", "message"), [
    ({"device": ""}, "device must be a torch device name"),
    ({"device": 0}, "device must be a torch device name"),
    ({"seed": "x"}, "seed must be an int"),
    ({"seed": -1}, "seed must be an int"),
    ({"seed": True}, "seed must be an int"),
])
def test_engine_config_refuses_bad_devices_and_seeds(settings: dict[str, object],
                                                     message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig(**settings)  # type: ignore[arg-type]


@pytest.mark.parametrize(("device", "message"), [
    ("foo", "is not a torch device"),
    ("gpu", "is not a torch device"),
    ("ipu", "WAR runs on cpu, cuda or mps devices"),
])
def test_an_unusable_device_is_a_value_error_before_anything_is_built(
        model64: CausalLM, device: str, message: str) -> None:
    """A device torch does not know, or one this process cannot use, is one ValueError
    naming it (not a RuntimeError or AssertionError from inside torch), from the engine
    and from the loader alike."""
    from war.engine.loader import torch_device

    with pytest.raises(ValueError, match=message):
        torch_device(device)
    with pytest.raises(ValueError, match=message):
        Engine(model64, EngineConfig(dtype="float64", device=device))
    assert torch_device("cpu") == torch.device("cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA device"):
            torch_device("cuda:0")


def test_history_with_out_of_vocabulary_tokens_is_refused(model64: CausalLM) -> None:
    """A history token outside the vocabulary would be drafted and fed to the model,
    failing every later step: ``add_history`` refuses it up front."""
    spec = SpecConfig(min_prob=0.0, max_spec_tokens=8)
    eng = make_engine(model64, spec_mode="always", spec=spec, num_kv_blocks=64)
    prompt = (1, 2, 3, 4, 5, 6, 7)
    sp = SamplingParams(temperature=0.0, max_tokens=8)
    [ref] = make_engine(model64, spec_mode="off").generate([GenRequest("ref", prompt, sp)])
    # A history that continues the greedy output with a token id the model lacks.
    history = [*prompt, *ref.output_ids[:2], 97, 98]
    for bad in (history, [*prompt, -1], [*prompt, 1.5]):
        with pytest.raises(ValueError, match="outside the vocabulary"):
            eng.add_history(bad)  # type: ignore[arg-type]
    assert eng.speculator.num_history_entries == 0
    [res] = eng.generate([GenRequest("a", prompt, sp)])
    assert res.output_ids == ref.output_ids
    eng.check_integrity()


def test_an_infinite_temperature_is_refused(model64: CausalLM) -> None:
    """Sampling would divide the logits by inf (a uniform draw, NaN for a -inf logit):
    ``SamplingParams`` refuses it, and a huge finite temperature still samples."""
    with pytest.raises(ValueError, match="temperature must be a finite number"):
        SamplingParams(temperature=float("inf"), max_tokens=4, seed=1)
    eng = make_engine(model64, spec_mode="off", num_kv_blocks=64)
    [res] = eng.generate([GenRequest("ok", (1, 2, 3), SamplingParams(temperature=1e300,
                                                                      max_tokens=4, seed=1))])
    assert len(res.output_ids) == 4


@pytest.mark.parametrize("other", [{"tie_word_embeddings": True}, {"rms_norm_eps": 0.25},
                                   {"rope_theta": 500.0}])
def test_a_folder_of_another_architecture_is_refused(other: dict[str, object],
                                                     tmp_path: Path) -> None:
    # Its tensors have the engine's names and shapes, so they loaded, and the engine
    # then served a model that was neither (with a tied engine an untied folder's head
    # was dropped; the folder's eps or RoPE never applied).
    eng = make_engine(tiny_model(0, **other), spec_mode="off")
    sp = SamplingParams(temperature=0.0, max_tokens=6)
    want = eng.generate([GenRequest("a", (3, 4, 5), sp)])[0]
    save_model(tiny_model(3, torch.float32), tmp_path)
    name = next(iter(other))
    with pytest.raises(ValueError, match=name):
        eng.load_weights(tmp_path)
    assert eng.weight_version == 0
    again = eng.generate([GenRequest("b", (3, 4, 5), sp)])[0]
    assert again.output_ids == want.output_ids
    same = make_engine(tiny_model(0), spec_mode="off")
    assert same.load_weights(tmp_path) == 1  # the same architecture loads
    fresh = make_engine(tiny_model(3), spec_mode="off")
    assert same.generate([GenRequest("c", (3, 4, 5), sp)])[0].output_ids == \
        fresh.generate([GenRequest("c", (3, 4, 5), sp)])[0].output_ids


def test_a_seeded_sample_is_the_same_with_and_without_speculation() -> None:
    """A seed fixes the tokens whatever the drafts (``war.engine.verify``: the emitted
    token of each position is the target's own inverse-CDF draw): an engine that
    speculates (with its history growing between the requests, so that the drafts
    differ) gives the seeded request's tokens of an engine that does not."""
    model = tiny_model(0, torch.float64)

    def engine(mode: str) -> Engine:
        return Engine(model, EngineConfig(
            dtype="float64", block_size=4, num_kv_blocks=128, spec_mode=mode,
            spec=SpecConfig(min_prob=0.0, max_spec_tokens=8)))

    off, spec = engine("off"), engine("always")
    drafted = 0
    for seed, prompt in enumerate(prompts(5, 6)):
        sp = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=24, seed=seed)
        want = off.generate([GenRequest(f"o{seed}", prompt, sp)])[0]
        for again in range(2):  # (the second time, the first one's output drafts)
            got = spec.generate([GenRequest(f"s{seed}.{again}", prompt, sp)])[0]
            assert got.output_ids == want.output_ids, (seed, again)
            assert got.logprobs == pytest.approx(want.logprobs, abs=1e-9)
            drafted += got.num_draft_tokens
    assert drafted > 0 and spec.stats.num_accepted_tokens > 0  # (it did speculate)
    spec.check_integrity()
