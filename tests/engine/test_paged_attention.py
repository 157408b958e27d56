"""The paged forward equals the dense one (float64); KV cache, batch packing, loader."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from war.engine.attention import ForwardBatch, KVCache, SeqInput, build_batch
from war.engine.loader import init_random, load_model, save_model
from war.engine.model import CausalLM
from war.engine.model_config import ModelConfig, RopeScaling

TOL = 1e-10
BLOCK = 4
NUM_BLOCKS = 48

CONFIGS = {
    "llama-gqa": ModelConfig(
        model_type="llama", vocab_size=128, hidden_size=64, intermediate_size=96,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        rope_scaling=RopeScaling("yarn", 2.0, original_max_position_embeddings=32),
        max_position_embeddings=256),
    "qwen3-mqa": ModelConfig(
        model_type="qwen3", vocab_size=128, hidden_size=64, intermediate_size=96,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1, head_dim=16,
        tie_word_embeddings=True),
}


@pytest.fixture(scope="module", params=list(CONFIGS))
def model(request: pytest.FixtureRequest) -> CausalLM:
    return init_random(CONFIGS[request.param], seed=11, dtype=torch.float64, std=0.08)


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 128, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _dense(model: CausalLM, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model.forward_dense(torch.tensor([tokens]))[0]


def _cache(model: CausalLM) -> KVCache:
    return KVCache.for_model(model.config, NUM_BLOCKS, BLOCK, torch.float64)


class Seq:
    """A sequence's tokens and scattered block table, as an engine would keep them."""

    def __init__(self, blocks: list[int]) -> None:
        self.blocks = blocks
        self.tokens: list[int] = []

    def slots(self, start: int, stop: int) -> list[int]:
        return [self.blocks[p // BLOCK] * BLOCK + p % BLOCK for p in range(start, stop)]

    def chunk(self, new: list[int], num_logits: int) -> SeqInput:
        c = len(self.tokens)
        n = len(new)
        self.tokens += new
        return SeqInput(new, list(range(c, c + n)), self.slots(c, c + n), self.slots(0, c),
                        None, num_logits)


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.shape == b.shape
    assert float((a - b).abs().max()) < TOL


def test_chunked_prefill_in_scattered_blocks(model: CausalLM) -> None:
    kv = _cache(model)
    perm = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(0)).tolist()
    seq = Seq(perm[:8])
    prompt = _tokens(27, seed=1)
    want = _dense(model, prompt)
    start = 0
    for size in (5, 1, 9, 3, 9):
        inp = seq.chunk(prompt[start:start + size], num_logits=size)
        got = model.forward(build_batch([inp], num_slots=kv.num_slots), kv)
        _close(got, want[start:start + size])
        start += size
    # decode two more tokens one at a time
    for tok in _tokens(2, seed=2):
        got = model.forward(build_batch([seq.chunk([tok], 1)]), kv)
        _close(got[0], _dense(model, seq.tokens)[-1])


def test_batched_sequences_of_different_lengths(model: CausalLM) -> None:
    kv = _cache(model)
    perm = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(3)).tolist()
    seqs = [Seq(perm[0:10]), Seq(perm[10:20]), Seq(perm[20:30])]
    prompts = [_tokens(n, seed=10 + i) for i, n in enumerate((17, 3, 9))]
    # step 1: all prefill at once (the second returns only its last logits)
    inputs = [seqs[0].chunk(prompts[0][:11], 11), seqs[1].chunk(prompts[1], 1),
              seqs[2].chunk(prompts[2], 9)]
    got = model.forward(build_batch(inputs), kv)
    assert got.shape == (21, 128)
    _close(got[:11], _dense(model, prompts[0][:11]))
    _close(got[11], _dense(model, prompts[1])[-1])
    _close(got[12:], _dense(model, prompts[2]))
    # step 2: one sequence finishes its prefill while the others decode
    inputs = [seqs[1].chunk([5], 1), seqs[0].chunk(prompts[0][11:], 2), seqs[2].chunk([7], 1)]
    batch = build_batch(inputs)
    # the 6-token chunk is attended to apart from the two 1-token decodes (no padding to 6)
    assert [tuple(m.shape) for _, _, m in batch.groups()] == [(2, 1, 10), (1, 6, 17)]
    assert batch.num_seqs == 3
    got = model.forward(batch, kv)
    _close(got[0], _dense(model, seqs[1].tokens)[-1])
    _close(got[1:3], _dense(model, seqs[0].tokens)[-2:])
    _close(got[3], _dense(model, seqs[2].tokens)[-1])
    # step 3: no logits for one sequence
    inputs = [seqs[0].chunk([1, 2], 0), seqs[2].chunk([3], 1)]
    got = model.forward(build_batch(inputs), kv)
    assert got.shape == (1, 128)
    _close(got[0], _dense(model, seqs[2].tokens)[-1])


def _path(parents: list[int], i: int) -> list[int]:
    path = []
    while i >= 0:
        path.append(i)
        i = parents[i]
    return path[::-1]


def test_tree_of_new_tokens_and_compaction(model: CausalLM) -> None:
    kv = _cache(model)
    perm = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(4)).tolist()
    tree_seq, chain_seq = Seq(perm[:8]), Seq(perm[8:16])
    context = _tokens(10, seed=20)
    model.forward(build_batch([tree_seq.chunk(context, 0), chain_seq.chunk(context[:6], 0)]), kv)

    parents = [-1, 0, 0, 1, 1, 2, -1, 6, 3]
    tree = _tokens(len(parents), seed=21)
    depth = [len(_path(parents, i)) for i in range(len(parents))]
    c = len(context)
    tree_input = SeqInput(tree, [c - 1 + d for d in depth], tree_seq.slots(c, c + len(tree)),
                          tree_seq.slots(0, c), parents, len(tree))
    chain_input = chain_seq.chunk(context[6:9], 3)
    got = model.forward(build_batch([chain_input, tree_input]), kv)
    _close(got[:3], _dense(model, context[:9])[-3:])
    for i in range(len(parents)):
        branch = context + [tree[j] for j in _path(parents, i)]
        _close(got[3 + i], _dense(model, branch)[-1])

    # accept the path 0 -> 1 -> 3 -> 8: move its K/V to positions c .. c+3, then decode
    accepted = _path(parents, 8)
    src = torch.tensor(tree_seq.slots(c, c + len(tree)))[accepted]
    dst = torch.tensor(tree_seq.slots(c, c + len(accepted)))
    kv.copy_slots(src, dst)
    tree_seq.tokens = context + [tree[j] for j in accepted]
    got = model.forward(build_batch([tree_seq.chunk([9], 1)]), kv)
    _close(got[0], _dense(model, tree_seq.tokens)[-1])


def test_padded_rows_without_keys_stay_finite(model: CausalLM) -> None:
    kv = _cache(model)
    a, b = Seq(list(range(0, 8))), Seq(list(range(8, 16)))
    batch = build_batch([a.chunk(_tokens(6, 30), 6), b.chunk(_tokens(2, 31), 2)])
    batch.attn_mask[1, 2:] = False  # padded query rows of the short sequence: no key at all
    got = model.forward(batch, kv)
    assert torch.isfinite(got).all()
    _close(got[6:], _dense(model, b.tokens))


def test_build_batch_layout() -> None:
    inputs = [
        SeqInput([5, 6], [3, 4], [10, 11], [7, 8, 9], None, 1),
        SeqInput([1, 2, 3], [2, 3, 3], [20, 21, 22], [30, 31], [-1, 0, 0], 3),
    ]
    b = build_batch(inputs)
    assert b.input_ids.tolist() == [5, 6, 1, 2, 3]
    assert b.positions.tolist() == [3, 4, 2, 3, 3]
    assert b.slot_mapping.tolist() == [10, 11, 20, 21, 22]
    assert b.query_index.tolist() == [[0, 1, 5], [2, 3, 4]]
    assert b.kv_slots.tolist() == [[7, 8, 9, 10, 11], [30, 31, 20, 21, 22]]
    assert b.logits_index.tolist() == [1, 2, 3, 4]
    assert b.attn_mask.int().tolist() == [
        [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]],
        [[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 0, 1]],
    ]
    for t in (b.input_ids, b.positions, b.slot_mapping, b.query_index, b.kv_slots,
              b.logits_index):
        assert t.dtype == torch.int64
    b.check()
    np_input = SeqInput(np.array([1, 2]), np.array([0, 1]), np.array([3, 4]), np.array([9]))
    assert build_batch([np_input]).kv_slots.tolist() == [[9, 3, 4]]


@pytest.mark.parametrize(("make", "message"), [
    (lambda: SeqInput([], [], []), "at least one"),
    (lambda: SeqInput([1, 2], [0], [0, 1]), "positions"),
    (lambda: SeqInput([1, 2], [0, 1], [0]), "slots"),
    (lambda: SeqInput([1, 2], [0, 1], [0, 1], (), [-1], 1), "parents"),
    (lambda: SeqInput([1, 2], [0, 1], [0, 1], (), [-1, 1], 1), "parents"),
    (lambda: SeqInput([1, 2], [0, 1], [0, 1], (), [-2, 0], 1), "parents"),
    (lambda: SeqInput([1, 2], [0, 1], [0, 1], (), None, 3), "num_logits"),
    (lambda: SeqInput([1, 2], [0, 1], [0, 1], (), None, -1), "num_logits"),
])
def test_seq_input_rejects(make: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make()


def test_build_batch_rejects() -> None:
    ok = SeqInput([1], [0], [4])
    with pytest.raises(ValueError, match="at least one"):
        build_batch([])
    with pytest.raises(ValueError, match="same KV slot"):
        build_batch([ok, SeqInput([2], [0], [4])])
    with pytest.raises(ValueError, match="out of range"):
        build_batch([SeqInput([1], [0], [4], [100])], num_slots=64)
    with pytest.raises(ValueError, match="negative KV slot"):
        build_batch([SeqInput([1], [0], [-4])])
    with pytest.raises(ValueError, match="negative token"):
        build_batch([SeqInput([-1], [0], [4])])
    with pytest.raises(ValueError, match="negative position"):
        build_batch([SeqInput([1], [-1], [4])])
    with pytest.raises(ValueError, match="SeqInput"):
        build_batch([("not", "a", "seq")])  # type: ignore[list-item]
    bad = build_batch([ok])
    with pytest.raises(ValueError, match="attn_mask"):
        ForwardBatch(bad.input_ids, bad.positions, bad.slot_mapping, bad.query_index,
                     bad.kv_slots, bad.attn_mask[:, :, :0], bad.logits_index).check()


def test_kv_cache() -> None:
    config = CONFIGS["llama-gqa"]
    kv = KVCache.for_model(config, num_blocks=3, block_size=4, dtype=torch.bfloat16)
    assert (kv.num_blocks, kv.block_size, kv.num_slots, kv.num_layers) == (3, 4, 12, 2)
    assert kv.k.shape == (2, 12, 2, 16) and kv.dtype == torch.bfloat16
    assert kv.bytes == 2 * 2 * 12 * 2 * 16 * 2
    per_block = KVCache.bytes_per_block(config, 4, torch.bfloat16)
    assert per_block * 3 == kv.bytes
    assert KVCache.blocks_for_bytes(config, per_block * 7 + 5, 4, torch.bfloat16) == 7
    assert KVCache.blocks_for_bytes(config, per_block - 1, 4, torch.bfloat16) == 0
    with pytest.raises(ValueError, match="num_blocks"):
        KVCache(2, 0, 4, 2, 16)

    kv = KVCache(2, 2, 4, 1, 3, torch.float64)
    kv.k.copy_(torch.arange(kv.k.numel(), dtype=torch.float64).view_as(kv.k))
    kv.v.copy_(-kv.k)
    before_k = kv.k.clone()
    kv.copy_slots(torch.tensor([1, 2, 6]), torch.tensor([0, 1, 7]))  # overlapping src/dst
    expected = before_k.clone()
    expected[:, [0, 1, 7]] = before_k[:, [1, 2, 6]]
    assert torch.equal(kv.k, expected) and torch.equal(kv.v, -expected)
    with pytest.raises(ValueError, match="1-D"):
        kv.copy_slots(torch.tensor([1, 2]), torch.tensor([0]))


def test_gather_buffers_are_reused_and_grow() -> None:
    kv = KVCache(2, 4, 4, 2, 8, torch.float64)
    k1, v1 = kv.gather_buffers(5)
    assert k1.numel() == v1.numel() == 5 * 2 * 8 and k1.dtype == torch.float64
    k2, _ = kv.gather_buffers(3)  # smaller: the same memory
    assert k2.data_ptr() == k1.data_ptr()
    k3, v3 = kv.gather_buffers(6)  # larger: at least doubled, so growth stays rare
    assert k3.numel() == 2 * k1.numel() and v3.numel() == k3.numel()
    assert kv.gather_buffers(7)[0].data_ptr() == k3.data_ptr()


def test_forward_with_and_without_gather_buffers_agree(model: CausalLM) -> None:
    """The paged forward writes gathered keys into the cache's reused buffers; a plan
    without them allocates per layer: the logits are the same."""
    from war.engine.attention import plan_paged

    kv = _cache(model)
    perm = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(5)).tolist()
    seqs = [Seq(perm[0:8]), Seq(perm[8:16])]
    inputs = [seqs[0].chunk(_tokens(13, seed=1), 13), seqs[1].chunk(_tokens(6, seed=2), 6)]
    reused = model.forward(build_batch(inputs), kv)
    batch = build_batch(inputs)
    plan = plan_paged(batch, model.config.num_kv_groups)
    assert plan.max_gathered_slots == max(g.num_seqs * g.num_keys for g in plan.groups)
    with torch.no_grad():
        cos, sin = model.rotary.cos_sin(batch.positions, model.dtype)
        h = model.model.embed_tokens(batch.input_ids)
        for i, layer in enumerate(model.model.decoder_layers()):
            h = layer.forward_paged(h, cos, sin, plan, kv.k[i], kv.v[i])  # plan.gather: None
        fresh = model._logits(model.model.norm(h.index_select(0, batch.logits_index)))
    assert torch.equal(reused, fresh)


def test_cache_must_fit_the_model() -> None:
    model = init_random(CONFIGS["llama-gqa"], seed=0)
    with pytest.raises(ValueError, match="KV cache"):
        model.forward(build_batch([SeqInput([1], [0], [0])]),
                      KVCache(2, 2, 4, 1, 16))
    with pytest.raises(ValueError, match="KV cache"):
        model.forward(build_batch([SeqInput([1], [0], [0])]),
                      KVCache.for_model(model.config, 2, 4, torch.float64))


# ---------------------------------------------------------------------------------
# loader and weight updates
# ---------------------------------------------------------------------------------


@pytest.fixture
def saved(tmp_path: Path) -> tuple[CausalLM, Path]:
    model = init_random(CONFIGS["qwen3-mqa"], seed=2)
    save_model(model, tmp_path)
    return model, tmp_path


def _same(a: CausalLM, b: CausalLM) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k].to(sa[k])) for k in sa)


def test_load_model_round_trip_and_shards(saved: tuple[CausalLM, Path], tmp_path: Path) -> None:
    model, folder = saved
    assert _same(load_model(folder), model)
    loaded64 = load_model(folder, dtype=torch.float64)
    assert loaded64.dtype == torch.float64 and not loaded64.training
    # sharded layout with an index
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    (sharded / "config.json").write_text((folder / "config.json").read_text())
    tensors = load_file(str(folder / "model.safetensors"))
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2],
              "model-00002-of-00002.safetensors": names[1::2]}
    for file, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(sharded / file), metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {k: f for f, ks in shards.items() for k in ks}}
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    assert _same(load_model(sharded), model)
    (sharded / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="00002"):
        load_model(sharded)


def _rewrite(folder: Path, change: Any) -> None:
    tensors = load_file(str(folder / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})


def test_loader_errors(saved: tuple[CausalLM, Path], tmp_path: Path) -> None:
    _, folder = saved
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model(tmp_path / "nowhere")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="config"):
        load_model(empty)
    (empty / "config.json").write_text((folder / "config.json").read_text())
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_model(empty)

    def wrong_shape(t: dict[str, torch.Tensor]) -> None:
        t["model.norm.weight"] = torch.ones(3)

    _rewrite(folder, wrong_shape)
    with pytest.raises(ValueError, match=r"model\.norm\.weight: got \(3,\)"):
        load_model(folder)

    def extra(t: dict[str, torch.Tensor]) -> None:
        t["model.norm.weight"] = torch.ones(64)
        t["model.layers.0.mlp.extra.weight"] = torch.ones(2)

    _rewrite(folder, extra)
    with pytest.raises(ValueError, match=r"unexpected tensors: model\.layers\.0\.mlp\.extra"):
        load_model(folder)

    def missing(t: dict[str, torch.Tensor]) -> None:
        del t["model.layers.0.mlp.extra.weight"]
        del t["model.layers.1.self_attn.k_norm.weight"]

    _rewrite(folder, missing)
    with pytest.raises(ValueError, match=r"missing tensors: model\.layers\.1\.self_attn\.k_norm"):
        load_model(folder)

    def tolerated(t: dict[str, torch.Tensor]) -> None:
        t["model.layers.1.self_attn.k_norm.weight"] = torch.ones(16)
        t["lm_head.weight"] = t["model.embed_tokens.weight"].clone()  # tied model
        t["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)

    _rewrite(folder, tolerated)
    assert "lm_head.weight" not in load_model(folder).state_dict()


def test_malformed_weight_files_are_value_errors(saved: tuple[CausalLM, Path],
                                                 tmp_path: Path) -> None:
    # safetensors' own error is a plain Exception, and a non-string shard name in an
    # index a TypeError: both are bad input, named as such.
    _, folder = saved
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text((folder / "config.json").read_text())
    weights = bad / "model.safetensors"
    weights.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00garbagegarbage")
    with pytest.raises(ValueError, match=r"model\.safetensors is not a valid safetensors"):
        load_model(bad)
    weights.write_bytes((folder / "model.safetensors").read_bytes()[:-100])  # truncated
    with pytest.raises(ValueError, match="is not a valid safetensors"):
        load_model(bad)
    weights.unlink()
    index = bad / "model.safetensors.index.json"
    for weight_map, needle in (({"a": 5}, r"weight_map\['a'\] must be a file name, got 5"),
                               ({"a": ""}, "must be a file name"),
                               (["x.safetensors"], "weight_map must map"),
                               ({"a": None}, "got None")):
        index.write_text(json.dumps({"weight_map": weight_map}))
        with pytest.raises(ValueError, match=needle):
            load_model(bad)


def test_load_weights(saved: tuple[CausalLM, Path]) -> None:
    model, _ = saved
    other = init_random(model.config, seed=9, dtype=torch.float64)
    assert not _same(other, model)
    ids = torch.tensor([_tokens(8, seed=40)])
    state = model.state_dict()
    bad = {**state, "model.norm.weight": torch.ones(5)}
    snapshot = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(ValueError, match="wrong shapes"):
        other.load_weights(bad)
    assert all(torch.equal(v, snapshot[k]) for k, v in other.state_dict().items())
    with pytest.raises(ValueError, match="unexpected"):
        other.load_weights({**state, "model.bogus": torch.ones(1)})
    partial = {k: v for k, v in state.items() if "layers.1" not in k}
    with pytest.raises(ValueError, match="missing"):
        other.load_weights(partial)
    other.load_weights(partial, strict=False)
    assert not _same(other, model)
    other.load_weights({k: v for k, v in state.items() if "layers.1" in k}, strict=False)
    assert _same(other, model)
    assert other.dtype == torch.float64
    with torch.no_grad():
        torch.testing.assert_close(other.forward_dense(ids).float(), model.forward_dense(ids),
                                   atol=1e-5, rtol=0)


def test_init_random_is_seeded() -> None:
    config = CONFIGS["llama-gqa"]
    a, b = init_random(config, seed=1), init_random(config, seed=1)
    assert _same(a, b)
    assert not _same(a, init_random(config, seed=2))
    norm = a.state_dict()["model.layers.0.input_layernorm.weight"]
    assert 0.5 < float(norm.mean()) < 1.5 and float(norm.std()) > 0.01
    half = init_random(config, seed=1, dtype=torch.bfloat16).state_dict()
    assert all(torch.equal(half[k], v.to(torch.bfloat16)) for k, v in a.state_dict().items())
