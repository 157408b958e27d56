"""The rollout step benchmark's interface on a tiny random policy (not its figures)."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer

from war.data import gpt2_tokenizer_json
from war.engine.loader import init_random, save_model
from war.engine.model_config import ModelConfig
from war.rollout.agent import AgentConfig
from war.rollout.bench import CONFIGS, BenchConfig, run_bench
from war.rollout.run import RunConfig


def test_bench_step_report_shape(tmp_path: Path) -> None:
    tok = Tokenizer.from_str(gpt2_tokenizer_json())
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    tok.save(str(tmp_path / "tokenizer.json"))
    cfg = ModelConfig.from_dict({
        "model_type": "llama", "vocab_size": tok.get_vocab_size(), "hidden_size": 32,
        "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
        "num_key_value_heads": 1, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0, "tie_word_embeddings": True})
    save_model(init_random(cfg, seed=0), tmp_path)
    run = RunConfig(model=str(tmp_path), replicas=2, tasks_per_step=2, group_size=2, steps=1,
                    agent=AgentConfig(max_turns=1, max_tokens_per_turn=4))
    out = run_bench(BenchConfig(run=run, low_tasks=1, low_in_flight=1, repeats=1), tmp_path,
                    log=lambda s: None)
    assert {(r["load"], r["config"]) for r in out["runs"]} == {
        (load, c) for load in ("low", "high") for c in CONFIGS}
    for r in out["runs"]:
        assert set(r) >= {"load", "config", "makespan_s", "tokens_per_s", "tokens_per_step",
                          "lower_bound_ratio", "mean_reward"}
        assert r["makespan_s"] > 0 and r["tokens_per_s"] > 0 and r["lower_bound_ratio"] > 0
    assert set(out["ratios"]["high"]) == {"war_vs_off", "war_vs_always"}
    assert 0.0 <= out["policy_success_rate"] <= 1.0
