"""The built-in policy: demonstrations as the agent loop renders them, the tokenizer, a tiny
training run, and the shipped folder (loads, agrees with its tokenizer, answers)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

from war.cli.main import main
from war.data import policy_path
from war.engine.config import EngineConfig
from war.engine.engine import Engine
from war.engine.loader import load_model
from war.rollout.agent import PolicyIO
from war.rollout.chat import IM_END, HermesTemplate, encode_segment
from war.rollout.envs import make, sample_tasks
from war.rollout.toolcalls import parse_tool_calls
from war.train.policy import (
    BUILTIN_ENVS,
    Episode,
    PolicyTrainConfig,
    build_demonstrations,
    build_stream,
    episode_segments,
    evaluate_policy,
    tokenize_episode,
    train_policy,
    train_policy_tokenizer,
)
from war.train.tokenizer import ENDOFTEXT
from war.types import GenRequest, SamplingParams

TINY = PolicyTrainConfig(
    seed=3, tasks_per_env=6, vocab_size=1500, min_frequency=2, hidden_size=32, num_layers=1,
    num_heads=2, num_kv_heads=1, intermediate_size=64, max_position_embeddings=512, steps=3,
    seq_len=256, batch_size=2, warmup_steps=1, threads=1, log_every=1,
)


@pytest.fixture(scope="module")
def episodes() -> list[Episode]:
    return build_demonstrations(TINY)


@pytest.fixture(scope="module")
def tokenizer(episodes: list[Episode]) -> Tokenizer:
    return train_policy_tokenizer((e.text for e in episodes), TINY.tokenizer_config())


def test_demonstrations_cover_every_env_and_render_like_the_template(
        episodes: list[Episode]) -> None:
    assert sorted({e.env for e in episodes}) == sorted(BUILTIN_ENVS)
    assert len(episodes) == 6 * len(BUILTIN_ENVS)  # the experts solve every task
    template = HermesTemplate()
    for ep in episodes:
        # the rollout stops after the last <|im_end|>; the template then closes with "\n"
        assert ep.text + "\n" == template.render(list(ep.messages), list(ep.tools))
        assert ep.segments[0].text == template.render_prompt(list(ep.messages[:2]),
                                                             list(ep.tools))
        assistants = [m["content"] + IM_END for m in ep.messages if m["role"] == "assistant"]
        assert [s.text for s in ep.segments if s.sampled] == assistants
        assert not ep.segments[-1].text.endswith("\n") and ep.segments[-1].sampled


def test_same_seed_same_demonstrations(episodes: list[Episode]) -> None:
    again = build_demonstrations(TINY)
    assert [e.text for e in again] == [e.text for e in episodes]
    other = build_demonstrations(dataclasses.replace(TINY, seed=4))
    assert [e.text for e in other] != [e.text for e in episodes]


def test_episode_segments_follow_the_agent_loop() -> None:
    env = make("sqlite")
    task = next(t for t in sample_tasks("sqlite", 5, 0) if t.data["kind"] == "orders_in_year")
    from war.rollout.envs import demonstration

    messages = demonstration(env, task)
    env.close()
    tools = [s.to_openai() for s in env.tools()]
    segs = episode_segments(messages, tools)
    template = HermesTemplate()
    assert [s.sampled for s in segs] == [False, True, False, True, False, True]
    assert segs[2].text == template.render_continuation(messages[:3], messages[3:4], tools)
    with pytest.raises(ValueError, match="end with"):
        episode_segments(messages[:-1], tools)


def test_tokenized_segments_decode_to_the_render_and_mask_the_assistant(
        episodes: list[Episode], tokenizer: Tokenizer) -> None:
    im_end = tokenizer.token_to_id(IM_END)
    for ep in episodes:
        ids, mask = tokenize_episode(tokenizer, ep)
        assert len(ids) == len(mask)
        assert tokenizer.decode(ids, skip_special_tokens=False) == ep.text
        assert ids == [i for s in ep.segments for i in encode_segment(tokenizer, s.text)]
        # mask 1 exactly on the assistant turns, each ending with its <|im_end|>
        learned = tokenizer.decode([i for i, m in zip(ids, mask, strict=True) if m],
                                   skip_special_tokens=False)
        assert learned == "".join(s.text for s in ep.segments if s.sampled)
        turns = sum(m["role"] == "assistant" for m in ep.messages)
        assert sum(1 for i, m in zip(ids, mask, strict=True) if m and i == im_end) == turns
        assert sum(1 for i, m in zip(ids, mask, strict=True) if not m and i == im_end) > 0
        assert mask[-1] == 1 and ids[-1] == im_end


def test_tokenizer_spells_numbers_by_digit_and_keeps_specials_whole(tokenizer: Tokenizer) -> None:
    ids = encode_segment(tokenizer, "The answer is 391.<|im_end|>")
    pieces = [tokenizer.decode([i], skip_special_tokens=False) for i in ids]
    assert pieces[-5:] == ["3", "9", "1", ".", IM_END]
    for text in ("never seen: \u03b6 \U0001d518 \t\r\n", "x = 'a?b.c'\n\n42"):
        assert tokenizer.decode(encode_segment(tokenizer, text)) == text


def test_stream_separates_episodes(episodes: list[Episode], tokenizer: Tokenizer) -> None:
    stream = build_stream(tokenizer, episodes)
    eot = tokenizer.token_to_id(ENDOFTEXT)
    assert len(stream.tokens) == len(stream.loss_mask) == int(stream.episode_lengths.sum()) + \
        len(episodes)
    ends = stream.episode_starts + stream.episode_lengths
    assert np.all(stream.tokens[ends] == eot) and np.all(stream.loss_mask[ends] == 0)
    assert int((stream.tokens == eot).sum()) == len(episodes)
    starts = stream.window_starts(128)
    assert set(starts) <= set(stream.episode_starts) and starts.max() + 129 <= len(stream.tokens)
    with pytest.raises(ValueError, match="too short"):
        stream.window_starts(len(stream.tokens))


def test_tiny_training_run_saves_a_loadable_folder(tmp_path: Path) -> None:
    out = tmp_path / "policy"
    lines: list[str] = []
    summary = train_policy(TINY, out, log=lines.append)
    assert summary.train.steps == 3 and len(lines) == 3
    assert {p.name for p in out.iterdir()} == {"config.json", "model.safetensors",
                                              "tokenizer.json", "tokenizer_config.json"}
    model = load_model(out)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert model.config.vocab_size == tok.get_vocab_size() == summary.vocab_size
    assert model.config.eos_token_id == (tok.token_to_id(IM_END),)
    assert model.config.tie_word_embeddings and model.config.model_type == "llama"
    meta = json.loads((out / "tokenizer_config.json").read_text())
    assert meta["eos_token"] == IM_END and "chat_template" not in meta
    io = PolicyIO.from_folder(out)
    assert isinstance(io.template, HermesTemplate)
    assert io.stop_token_ids == (tok.token_to_id(IM_END),)
    assert json.dumps(summary.to_dict())  # JSON-serializable


def test_episodes_longer_than_the_window_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="longer than seq_len"):
        train_policy(dataclasses.replace(TINY, seq_len=32), tmp_path / "policy")


def test_the_command_trains_saves_and_evaluates(tmp_path: Path) -> None:
    out, report = tmp_path / "policy", tmp_path / "report.json"
    status = main(["train-policy", "--out", str(out), "--steps", "2", "--tasks-per-env", "40",
                   "--eval-tasks", "1", "--json", str(report)])
    assert status == 0
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()
    data = json.loads(report.read_text())
    assert data["train"]["train"]["steps"] == 2 and data["train"]["threads"] == 1
    assert set(data["eval"]["success_by_env"]) == set(BUILTIN_ENVS)
    assert data["eval"]["seed"] == 1000 and data["eval"]["temperature"] == 0.7
    assert main(["train-policy", "--out", str(out), "--eval-seed", "0"]) == 1


def test_config_is_validated() -> None:
    with pytest.raises(ValueError, match="tasks_per_env"):
        PolicyTrainConfig(tasks_per_env=0)
    with pytest.raises(ValueError, match="heads"):
        PolicyTrainConfig(hidden_size=100, num_heads=3)
    with pytest.raises(ValueError, match="num_kv_heads"):
        PolicyTrainConfig(num_heads=4, num_kv_heads=3)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        PolicyTrainConfig(seq_len=512, max_position_embeddings=512)
    with pytest.raises(ValueError, match="envs"):
        PolicyTrainConfig(envs=())
    with pytest.raises(ValueError, match="vocab_size"):
        PolicyTrainConfig(vocab_size=100)


@pytest.mark.parametrize("theta", [0.5, -1.0, float("nan"), "10000"])
def test_the_models_settings_are_checked_by_the_config(theta: object) -> None:
    # not only once the demonstrations and the tokenizer are built
    with pytest.raises(ValueError, match="rope_theta"):
        PolicyTrainConfig(rope_theta=theta)  # type: ignore[arg-type]


def test_an_unknown_environment_is_refused_before_any_demonstration(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import war.train.policy as policy

    def fail(*_: object, **__: object) -> None:
        raise AssertionError("demonstrations were built before the names were checked")

    monkeypatch.setattr(policy, "sample_tasks", fail)
    with pytest.raises(ValueError, match="unknown environment 'nope'"):
        build_demonstrations(dataclasses.replace(TINY, envs=("calculator", "nope")))


@pytest.mark.parametrize(("kwargs", "named"), [
    ({"envs": ()}, "envs"),
    ({"envs": "calculator"}, "envs"),
    ({"envs": ("calculator", "calculator")}, "envs"),
    ({"envs": ("nope",)}, "unknown environment 'nope'"),
    ({"threads": 0}, "threads"),
])
def test_evaluation_arguments_are_checked_first(tmp_path: Path, kwargs: dict[str, object],
                                                named: str) -> None:
    with pytest.raises(ValueError, match=named):
        evaluate_policy(tmp_path / "no-policy", tasks_per_env=1, **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("seed", [-1, 2**63])
def test_seeds_out_of_range_are_refused_by_the_config(seed: int) -> None:
    with pytest.raises(ValueError, match=r"seed must be an int in \[0, 2\*\*63\)"):
        PolicyTrainConfig(seed=seed)


def _no_training(monkeypatch: pytest.MonkeyPatch) -> None:
    """Makes any start of the work fail the test: the checks must come first."""
    import war.train.policy as policy

    def fail(*_: object, **__: object) -> None:
        raise AssertionError("the work started before the arguments were checked")

    monkeypatch.setattr(policy, "build_demonstrations", fail)
    monkeypatch.setattr(policy, "evaluate_policy", fail)


@pytest.mark.parametrize(("extra", "named"), [
    (["--seed", "-1"], "--seed"),
    (["--seed", str(2**63)], "--seed"),
    (["--eval-seed", "-5"], "--eval-seed"),
    (["--eval-seed", str(2**63)], "--eval-seed"),
    (["--seed", str(2**63 - 1)], "--eval-seed"),  # the default, seed + 1000, overflows
])
def test_the_command_checks_its_seeds_before_training(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        extra: list[str], named: str) -> None:
    _no_training(monkeypatch)
    report = tmp_path / "report.json"
    status = main(["train-policy", "--out", str(tmp_path / "policy"), "--json", str(report),
                   *extra])
    err = capsys.readouterr().err
    assert status == 1 and err.startswith("war: error: ") and named in err
    assert err.count("\n") == 1 and not report.exists()


def test_a_large_seed_without_evaluation_needs_no_eval_seed(tmp_path: Path) -> None:
    seed = 2**63 - 1
    status = main(["train-policy", "--out", str(tmp_path / "policy"), "--seed", str(seed),
                   "--steps", "1", "--tasks-per-env", "40", "--eval-tasks", "0"])
    assert status == 0 and (tmp_path / "policy" / "model.safetensors").is_file()


def test_training_again_into_a_policy_folder_replaces_the_policy(tmp_path: Path) -> None:
    out = tmp_path / "policy"
    train_policy(TINY, out)
    (out / "notes.txt").write_text("mine\n")
    bigger = dataclasses.replace(TINY, hidden_size=48, intermediate_size=96, seed=4)
    summary = train_policy(bigger, out)
    # exactly the new policy's model files (no index or shard of anything else), and the
    # user's other file kept; no temporary folder left beside it
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["config.json", "model.safetensors", "notes.txt", "tokenizer.json",
         "tokenizer_config.json"])
    assert (out / "notes.txt").read_text() == "mine\n"
    assert [p.name for p in tmp_path.iterdir()] == ["policy"]
    model = load_model(out)
    assert model.config.hidden_size == 48
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert model.config.vocab_size == tok.get_vocab_size() == summary.vocab_size
    assert summary.folder_bytes == sum(
        (out / n).stat().st_size for n in ("config.json", "model.safetensors",
                                           "tokenizer.json", "tokenizer_config.json"))


def test_training_into_the_working_folder_keeps_it_usable(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "policy"
    train_policy(TINY, out)
    (out / "runs").mkdir()
    monkeypatch.chdir(out / "runs")
    train_policy(TINY, "..")
    assert Path.cwd() == (out / "runs").resolve() and Path("../model.safetensors").is_file()
    load_model(out)


@pytest.mark.parametrize("stray", ["model.safetensors.index.json",
                                   "model-00001-of-00002.safetensors", "chat_template.jinja"])
def test_a_folder_holding_another_models_files_is_refused_before_training(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        stray: str) -> None:
    _no_training(monkeypatch)
    out = tmp_path / "model"
    out.mkdir()
    (out / "config.json").write_text("{}\n")
    (out / stray).write_text("{}\n")
    with pytest.raises(ValueError, match=rf"out_dir {out} holds another model's files \({stray}"):
        train_policy(TINY, out)
    assert main(["train-policy", "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"war: error: --out {out} holds another model's files")
    assert sorted(p.name for p in out.iterdir()) == sorted(["config.json", stray])


def test_a_failed_write_leaves_the_earlier_policy(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import war.train.policy as policy

    out = tmp_path / "policy"
    train_policy(TINY, out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def broken(*_: object, **__: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(policy, "save_policy_tokenizer", broken)
    with pytest.raises(OSError, match="No space"):
        train_policy(dataclasses.replace(TINY, seed=5), out)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert [p.name for p in tmp_path.iterdir()] == ["policy"]


# ------------------------------------------------------------------ the shipped policy


def test_shipped_policy_loads_and_agrees_with_its_tokenizer() -> None:
    folder = policy_path()
    files = {p.name: p.stat().st_size for p in folder.iterdir() if p.is_file()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "README.md"} <= set(files)
    assert sum(files.values()) <= 20 * 1024 * 1024
    engine = Engine.from_pretrained(folder, EngineConfig(kv_cache_bytes=8 * 1024 * 1024))
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    config = engine.model_config
    assert config.vocab_size == tok.get_vocab_size()
    assert config.eos_token_id == (tok.token_to_id(IM_END),)
    meta = json.loads((folder / "tokenizer_config.json").read_text())
    assert meta["eos_token"] == IM_END and "chat_template" not in meta
    io = PolicyIO.from_folder(folder)
    assert isinstance(io.template, HermesTemplate) and io.stop_token_ids == config.eos_token_id


def test_shipped_policy_calls_the_right_tool() -> None:
    folder = policy_path()
    io = PolicyIO.from_folder(folder)
    engine = Engine.from_pretrained(folder, EngineConfig(kv_cache_bytes=8 * 1024 * 1024,
                                                         spec_mode="off"))
    task = sample_tasks("calculator", 1, seed=12345)[0]
    env = make("calculator")
    messages = [{"role": "system", "content": env.system_prompt()},
                {"role": "user", "content": env.reset(task)}]
    tools = [s.to_openai() for s in env.tools()]
    prompt = io.encode(io.template.render_prompt(messages, tools))
    sampling = SamplingParams(temperature=0.0, max_tokens=96, stop_token_ids=io.stop_token_ids)
    result = engine.generate([GenRequest("r0", tuple(prompt), sampling)])[0]
    assert result.output_ids[-1] in io.stop_token_ids
    calls = parse_tool_calls(io.decode(result.output_ids)).calls
    assert [c.name for c in calls] == ["calculate" if task.data["kind"] != "convert"
                                       else "convert"]
    env.close()


@pytest.mark.slow
def test_shipped_policy_solves_held_out_tasks() -> None:
    result = evaluate_policy(policy_path(), tasks_per_env=6, seed=777, threads=2)
    assert set(result.success_by_env) == set(BUILTIN_ENVS)
    assert result.overall >= 0.5
