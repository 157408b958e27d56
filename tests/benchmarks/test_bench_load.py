"""The load benchmark's helpers and command line on a tiny random model (seconds on a CPU)."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import pytest
from bench_scripts import load_benchmark, usage_error

pytest.importorskip("war.spec._C", reason="native core war.spec._C is not built")

from war import data
from war.engine.bench import (
    LoadBenchConfig,
    RunResult,
    build_prompts,
    measure_cost_curve,
    run_sweep,
    summarize,
)
from war.engine.loader import init_random, save_model
from war.engine.model import CausalLM
from war.engine.model_config import ModelConfig
from war.spec.traces import IM_END, load_records, render
from war.train.tokenizer import TokenizerConfig, save_tokenizer, train_tokenizer

SWEEP_KEYS = {"concurrency", "mode", "tokens_per_s", "tokens_per_step"}


def load_script() -> ModuleType:
    return load_benchmark("engine", "bench_load")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A sample trace file and a model folder: a random tiny Llama and a BPE tokenizer
    trained on the sample."""
    root = tmp_path_factory.mktemp("bench_load")
    traces = root / "sample.jsonl.gz"
    traces.write_bytes(data.resource(data.SAMPLE_TRACES).read_bytes())
    folder = root / "model"
    tok_cfg = TokenizerConfig(vocab_size=384)
    tokenizer = train_tokenizer([render(r.messages) for r in load_records([traces])], tok_cfg)
    save_tokenizer(tokenizer, folder, tok_cfg)
    config = ModelConfig.from_dict({
        "model_type": "llama", "vocab_size": tokenizer.get_vocab_size(), "hidden_size": 32,
        "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
        "max_position_embeddings": 256, "tie_word_embeddings": True,
    })
    save_model(init_random(config, 0), folder)
    return traces, folder


def test_helpers_report_every_mode_and_concurrency(tiny: tuple[Path, Path]) -> None:
    traces, folder = tiny
    from war.engine.loader import load_model
    from war.spec.traces import load_tokenizer

    model: CausalLM = load_model(folder)
    tokenizer = load_tokenizer(folder / "tokenizer.json")
    config = LoadBenchConfig(concurrencies=(1, 4), repeats=2, rl_steps=2, group_size=2,
                             max_tokens=6, max_prompt_tokens=48, cost_batches=(1, 2),
                             cost_drafts=(0, 2), cost_context=8, cost_repeats=1)
    prompts = build_prompts(load_records([traces]), tokenizer, config.max_num_tasks,
                            config.max_prompt_tokens)
    assert len(prompts) == config.max_num_tasks
    assert all(0 < len(p.prompt_ids) <= 48 for p in prompts)
    cost = measure_cost_curve(model, config.cost_batches, config.cost_drafts,
                              config.cost_context, config.cost_repeats)
    assert [(c.batch, c.draft_tokens) for c in cost] == [(1, 0), (1, 2), (2, 0), (2, 2)]
    assert all(c.step_ms > 0 for c in cost)
    fastest = measure_cost_curve(model, (1,), (0,), config.cost_context, 3, statistic="min")
    assert len(fastest) == 1 and fastest[0].step_ms > 0
    with pytest.raises(ValueError, match="statistic"):
        measure_cost_curve(model, (1,), (0,), 8, 1, statistic="mean")
    stop_id = tokenizer.token_to_id(IM_END)
    assert stop_id is not None
    runs = run_sweep(model, prompts, config, stop_id)
    assert len(runs) == 2 * 2 * 3
    report = summarize(runs, config.modes)
    cells = {(s["concurrency"], s["mode"]) for s in report["sweep"]}
    assert cells == {(c, m) for c in (1, 4) for m in ("auto", "off", "always")}
    for s in report["sweep"]:
        assert set(s) >= SWEEP_KEYS
        assert s["tokens_per_s"] > 0 and s["tokens_per_step"] >= 1.0
        if s["mode"] == "off":
            assert s["tokens_per_step"] == 1.0 and s["spec_tokens_per_seq"] == 0.0
    assert [r["concurrency"] for r in report["ratios"]] == [1, 4]
    assert set(report["ratios"][0]) == {"concurrency", "auto/off", "auto/always", "always/off"}
    assert set(report["crossover"]) == {"always_vs_off", "auto_budget"}


def test_script_writes_the_report(tiny: tuple[Path, Path], tmp_path: Path,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    traces, folder = tiny
    out = tmp_path / "out.json"
    bench = load_script()
    args = ["--quick", "--model", str(folder), "--traces", str(traces), "--json", str(out),
            "--concurrencies", "2", "--repeats", "1", "--max-tokens", "4", "--rl-steps", "1",
            "--no-cost-curve"]
    assert bench.main(args) == 0
    (line,) = capsys.readouterr().out.strip().splitlines()
    assert line.startswith("bench_load: auto/off and auto/always tokens/s: c2 ")
    report = json.loads(out.read_text(encoding="utf-8"))
    assert {"cost_curve", "sweep", "ratios", "crossover", "machine", "targets"} <= set(report)
    assert {s["mode"] for s in report["sweep"]} == {"auto", "off", "always"}
    assert all(set(s) >= SWEEP_KEYS for s in report["sweep"])


def fake_run(c: int, mode: str, rep: int, seconds: float, drafts: int) -> RunResult:
    return RunResult(concurrency=c, mode=mode, repeat=rep, generated_tokens=100,
                     seconds=seconds, forward_passes=50, draft_tokens=drafts,
                     accepted_tokens=drafts // 2, engine_steps=50, step_seconds=seconds,
                     cpu_seconds=seconds)


def test_summary_finds_the_crossover() -> None:
    # always beats off below 8 sequences and loses from 8 on; auto's budget drops at 16.
    runs = []
    for rep in range(3):
        for c, always_s, auto_drafts in ((1, 0.5, 100), (8, 1.2, 40), (16, 1.5, 2)):
            runs += [fake_run(c, "off", rep, 1.0, 0), fake_run(c, "always", rep, always_s, 100),
                     fake_run(c, "auto", rep, min(always_s, 1.0), auto_drafts)]
    report = summarize(runs, ("auto", "off", "always"))
    assert report["crossover"] == {"always_vs_off": 8, "auto_budget": 16}
    first = report["ratios"][0]
    assert first["auto/off"] == pytest.approx(2.0) and first["always/off"] == pytest.approx(2.0)
    assert report["targets"]["auto/off@1 >= 1.4"] == {"ratio": pytest.approx(2.0), "met": True}
    assert report["targets"]["auto/always@16 >= 1.1"]["met"] is True


@pytest.mark.parametrize(("argv", "message"), [
    (["--threads", "0"], "--threads must be >= 1, got 0"),
    (["--threads", "-1"], "--threads must be >= 1, got -1"),
    (["--repeats", "0"], "--repeats must be an int >= 1, got 0"),
    (["--max-tokens", "0"], "--max-tokens must be an int >= 1, got 0"),
    (["--concurrencies", "0"], "--concurrencies must be non-empty ints >= 1"),
    (["--seed", "-1"], "--seed must be >= 0, got -1"),
    (["--max-tokens", "1024"], "--max-tokens must be < 1024 (the trace model's context), "
                               "got 1024"),
])
def test_bad_values_are_refused_before_the_trace_model_is_trained(
        argv: list[str], message: str, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    err = usage_error(load_script(), ["--quick", *argv], ["ensure_trace_model", "load_model"],
                      monkeypatch, capsys)
    assert f" error: {message}" in err.splitlines()[-1]


def test_a_report_over_a_trace_file_is_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text("{}\n")
    err = usage_error(load_script(), ["--quick", "--traces", str(trace), "--json",
                                      str(tmp_path / "." / "t.jsonl")],
                      ["ensure_trace_model", "load_model"], monkeypatch, capsys)
    assert "is one of the --traces" in err.splitlines()[-1]
    assert trace.read_text() == "{}\n"


def test_max_tokens_past_the_models_context_fails_before_the_cost_curve(
        tiny: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    traces, folder = tiny  # a context of 256 tokens
    bench = load_script()

    def no_work(*_: object, **__: object) -> None:
        raise AssertionError("measured with no room for a prompt")

    monkeypatch.setattr(bench, "measure_cost_curve", no_work)
    monkeypatch.setattr(bench, "run_sweep", no_work)
    with pytest.raises(ValueError, match="leaves no room for a prompt"):
        bench.main(["--quick", "--model", str(folder), "--traces", str(traces),
                    "--max-tokens", "256"])
