"""Helpers of the engine's load benchmark (``benchmarks/engine/bench_load.py``) and of the
small trace-trained model it runs (``benchmarks/engine/train_trace_model.py``).

Knows: how to train and cache a byte-level BPE tokenizer and a tiny Llama on the rendered
text of agent traces (a Hugging Face folder stamped with the hash of its recipe), how an
RL-rollout-like workload is cut from the traces (one prompt per task, sampled as a group,
over several synchronous RL steps), how to measure the forward pass's cost against batch
size and draft length, how to drive one ``Engine`` per mode at a fixed concurrency with
their steps interleaved (so that other jobs on the machine disturb every mode alike), and
how the modes' runs are summarised (medians, per-repeat ratios, crossover). Does not know how the
engine works inside; it only uses its public API (``Engine``, ``add_request``, ``step``,
``observe_rl_step``, ``stats``) and the model's paged ``forward``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import platform
import shutil
import statistics
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tokenizers import Tokenizer

from war.engine.attention import KVCache, SeqInput, build_batch
from war.engine.config import EngineConfig
from war.engine.engine import Engine
from war.engine.loader import init_random, save_model
from war.engine.model import CausalLM
from war.engine.model_config import ModelConfig
from war.spec.config import SpecConfig
from war.spec.traces import IM_END, TraceRecord, load_records, render, tokenize
from war.train.lm import TrainConfig, TrainLog, train_lm
from war.train.tokenizer import ENDOFTEXT, TokenizerConfig, save_tokenizer, train_tokenizer
from war.types import GenRequest, SamplingParams

STAMP_FILE = "war-stamp.json"
MODES = ("auto", "off", "always")
Log = Callable[[str], None]

# --------------------------------------------------------------------------- trace model


@dataclass(frozen=True)
class TraceModelConfig:
    """The recipe of the trace-trained model; its hash stamps the cached folder.

    A tiny Llama (tied embeddings) and a byte-level BPE tokenizer fitted to the ChatML
    rendering of every trajectory in the trace files, trained for ``steps`` optimizer
    steps (reproducible for a fixed ``threads``) on ``threads`` CPU threads (bfloat16
    autocast, float32 weights), or until ``minutes`` of wall clock have passed if that
    comes first (a busy machine; the stamp records the steps taken). One thread by
    default: on a machine shared with other jobs two threads on two cores stall each
    other (measured: 4x slower per step than one thread under a load of 4).
    """

    vocab_size: int = 4096
    hidden_size: int = 256
    intermediate_size: int = 688
    num_layers: int = 4
    num_heads: int = 4
    max_position_embeddings: int = 1024
    seq_len: int = 512
    batch_size: int = 8
    steps: int = 500
    minutes: float = 20.0
    lr: float = 3e-3
    warmup_steps: int = 30
    seed: int = 0
    threads: int = 1

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            low_ok = f.name in ("seed", "warmup_steps") and isinstance(v, int) and v >= 0
            if not low_ok and (isinstance(v, bool) or not isinstance(v, int | float)
                               or not v > 0):
                raise ValueError(f"{f.name} must be a number > 0, got {v!r}")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} not divisible by {self.num_heads}")
        if self.seq_len > self.max_position_embeddings:
            raise ValueError("seq_len must be <= max_position_embeddings")

    @classmethod
    def quick(cls, **overrides: Any) -> TraceModelConfig:
        """The same model trained for 80 steps, at most 1.5 minutes (``bench_load.py
        --quick`` when the full model is not cached; it drafts worse: loss ~5.4 against
        ~2.9, about 1.2-1.4 tokens per step against 1.6-1.9)."""
        return dataclasses.replace(cls(steps=80, minutes=1.5), **overrides)

    def model_config(self, eos_id: int, pad_id: int) -> ModelConfig:
        return ModelConfig.from_dict({
            "model_type": "llama", "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers, "num_attention_heads": self.num_heads,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": True, "rms_norm_eps": 1e-5,
            "eos_token_id": eos_id, "pad_token_id": pad_id,
        })

    def stamp(self, traces: Sequence[Path]) -> str:
        """Hash of the recipe and of the trace files' names and sizes."""
        payload = {"config": dataclasses.asdict(self),
                   "traces": [(p.name, p.stat().st_size) for p in traces]}
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def find_traces(start: Path) -> list[Path]:
    """Every ``*.jsonl`` in the nearest ``shared/data/traces`` at or above ``start``."""
    for folder in (start, *start.parents):
        candidate = folder / "shared" / "data" / "traces"
        if candidate.is_dir():
            return sorted(candidate.glob("*.jsonl"))
    return []


def is_current(folder: Path, config: TraceModelConfig, traces: Sequence[Path]) -> bool:
    """Whether ``folder`` holds a model built from this recipe and these traces."""
    stamp_path = folder / STAMP_FILE
    if not stamp_path.is_file():
        return False
    try:
        stamp = json.loads(stamp_path.read_text(encoding="utf-8"))
    except json.JSONDecodeError:
        return False
    return bool(stamp.get("stamp") == config.stamp(traces)
                and all((folder / f).is_file() for f in ("config.json", "model.safetensors",
                                                         "tokenizer.json")))


def build_trace_model(out: Path, traces: Sequence[Path], config: TraceModelConfig,
                      log: Log | None = None) -> dict[str, Any]:
    """Trains the tokenizer and the model and writes the folder (atomically: a sibling
    temporary folder is renamed over ``out``); returns the stamp written."""
    say = log or (lambda _: None)
    t0 = time.perf_counter()
    records = load_records(traces)
    texts = [render(r.messages) for r in records]
    tok_cfg = TokenizerConfig(vocab_size=config.vocab_size,
                              model_max_length=config.max_position_embeddings)
    tokenizer = train_tokenizer(texts, tok_cfg)
    eot, im_end = tokenizer.token_to_id(ENDOFTEXT), tokenizer.token_to_id(IM_END)
    assert eot is not None and im_end is not None, "special tokens missing"
    stream = np.concatenate([np.asarray([*e.ids, eot], dtype=np.int32)
                             for e in tokenizer.encode_batch(texts)])
    say(f"tokenizer: {tokenizer.get_vocab_size()} tokens, stream {len(stream)} tokens "
        f"from {len(records)} trajectories ({time.perf_counter() - t0:.1f} s)")
    mc = config.model_config(eos_id=im_end, pad_id=eot)
    model = init_random(mc, config.seed)
    train_cfg = TrainConfig(
        seq_len=config.seq_len, batch_size=config.batch_size, steps=config.steps,
        time_budget_s=config.minutes * 60.0, lr=config.lr, warmup_steps=config.warmup_steps,
        seed=config.seed, threads=config.threads, autocast="bfloat16", log_every=20,
    )

    def on_log(p: TrainLog) -> None:
        say(f"step {p.step}: loss {p.loss:.3f}, lr {p.lr:.2e}, {p.elapsed_s:.0f} s")

    result = train_lm(model, stream, train_cfg, log=on_log)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    save_model(model, tmp)
    save_tokenizer(tokenizer, tmp, tok_cfg)
    stamp = {
        "stamp": config.stamp(traces), "config": dataclasses.asdict(config),
        "traces": [p.name for p in traces], "stream_tokens": len(stream),
        "train": {"steps": result.steps, "tokens": result.tokens, "seconds": result.seconds,
                  "first_loss": result.first_loss, "final_loss": result.final_loss,
                  "curve": [dataclasses.asdict(p) for p in result.curve]},
        "num_params": sum(p.numel() for p in model.parameters()),
    }
    (tmp / STAMP_FILE).write_text(json.dumps(stamp, indent=2) + "\n", encoding="utf-8")
    shutil.rmtree(out, ignore_errors=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    os.replace(tmp, out)
    return stamp


def ensure_trace_model(out: Path, traces: Sequence[Path], config: TraceModelConfig,
                       log: Log | None = None) -> bool:
    """Builds the model into ``out`` unless it is current; returns whether it built."""
    if is_current(out, config, traces):
        return False
    if not traces:
        raise FileNotFoundError("no trace files to train the model on")
    build_trace_model(out, traces, config, log)
    return True


# --------------------------------------------------------------------------- workload


@dataclass(frozen=True)
class Prompt:
    """One task's prompt: a conversation prefix up to an assistant turn."""

    group_id: str
    prompt_ids: tuple[int, ...]


def build_prompts(records: Sequence[TraceRecord], tokenizer: Tokenizer, num_tasks: int,
                  max_prompt_tokens: int, seed: int = 0) -> list[Prompt]:
    """One prompt per task (its first trial), up to a seeded random assistant turn, in
    the engine's tokenization (``war.spec.traces.tokenize``), keeping the last
    ``max_prompt_tokens`` tokens. Tasks alternate between trace files."""
    rng = np.random.default_rng(seed)
    by_file: dict[str, dict[str, TraceRecord]] = {}
    for rec in records:
        tasks = by_file.setdefault(rec.file, {})
        if rec.task_id not in tasks or rec.trial < tasks[rec.task_id].trial:
            tasks[rec.task_id] = rec
    queues = []
    for name in sorted(by_file):
        recs = list(by_file[name].values())
        queues.append([recs[i] for i in rng.permutation(len(recs))])
    chosen = [q[i] for i in range(max(map(len, queues), default=0)) for q in queues
              if i < len(q)][:num_tasks]
    prompts = []
    for rec, traj in zip(chosen, tokenize(chosen, tokenizer), strict=True):
        if not traj.turns:
            continue
        j = int(rng.integers(len(traj.turns)))
        parts = [a for t in traj.turns[:j] for a in (t.prompt_delta, t.response)]
        ids = np.concatenate([*parts, traj.turns[j].prompt_delta])[-max_prompt_tokens:]
        prompts.append(Prompt(f"{rec.task_id}#turn{j}", tuple(int(t) for t in ids)))
    return prompts


def rl_step_requests(prompts: Sequence[Prompt], rl_step: int, group_size: int,
                     sampling: SamplingParams, seed: int = 0) -> list[GenRequest]:
    """Every prompt sampled ``group_size`` times (a group), each with its own seed."""
    out = []
    for p_idx, p in enumerate(prompts):
        for i in range(group_size):
            rid = f"s{rl_step}/p{p_idx}/{i}"
            sp = dataclasses.replace(sampling, seed=hash_index(seed, rl_step, p_idx, i))
            out.append(GenRequest(rid, p.prompt_ids, sp, trajectory_id=rid, group_id=p.group_id))
    return out


def hash_index(*parts: int) -> int:
    digest = hashlib.sha256(",".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:4], "little")


# --------------------------------------------------------------------------- cost curve


@dataclass(frozen=True)
class CostPoint:
    batch: int  # decoding sequences
    draft_tokens: int  # draft tokens per sequence (chain), fed after the pending token
    step_ms: float  # median of build_batch + model.forward


# how a cost-curve shape's repeats combine (``measure_cost_curve``'s ``statistic``)
COST_STATISTICS: dict[str, Callable[[Sequence[float]], float]] = {
    "median": statistics.median, "min": min}


def measure_cost_curve(model: CausalLM, batches: Sequence[int], drafts: Sequence[int],
                       context_len: int, repeats: int, seed: int = 0,
                       statistic: str = "median") -> list[CostPoint]:
    """The forward pass's duration (packing the batch included) for ``batch`` sequences
    each with ``context_len`` cached tokens and ``1 + draft_tokens`` new ones. The grid
    is measured ``repeats`` times (after one warm-up pass), each time in a new seeded
    random order, so that no shape always follows the same one (a small shape right
    after the largest runs with cold caches); a shape's figure is the ``statistic``
    (``median``, or ``min``: on a shared machine other work only slows a pass down) of
    its repeats."""
    reduce = COST_STATISTICS.get(statistic)
    if reduce is None:
        raise ValueError(f"statistic must be one of {sorted(COST_STATISTICS)}, "
                         f"got {statistic!r}")
    rng = np.random.default_rng(seed)
    span = context_len + max(drafts) + 1
    bs = 16
    kv = KVCache.for_model(model.config, math.ceil(max(batches) * span / bs), bs,
                           model.dtype, model.device)
    vocab = model.config.vocab_size
    shapes = [(b, k) for b in batches for k in drafts]
    times: dict[tuple[int, int], list[float]] = {shape: [] for shape in shapes}
    for rep in range(repeats + 1):
        for i in rng.permutation(len(shapes)):
            b, k = shapes[i]
            inputs = []
            for j in range(b):
                base = j * span
                inputs.append(SeqInput(
                    rng.integers(0, vocab, k + 1), np.arange(context_len, context_len + k + 1),
                    np.arange(base + context_len, base + context_len + k + 1),
                    np.arange(base, base + context_len), None, k + 1))
            t0 = time.perf_counter()
            with torch.inference_mode():
                model.forward(build_batch(inputs, model.device), kv)
            if rep:
                times[b, k].append(time.perf_counter() - t0)
    return [CostPoint(b, k, 1e3 * reduce(times[b, k])) for b, k in shapes]


# --------------------------------------------------------------------------- load sweep


@dataclass(frozen=True)
class LoadBenchConfig:
    """The load sweep's workload; validated on construction.

    ``tasks_per_seq`` sets a run's pool: ``max(min_tasks, ceil(tasks_per_seq *
    concurrency))`` tasks (at most the prompts available), each sampled ``group_size``
    times per RL step, for ``rl_steps`` synchronous steps.
    """

    concurrencies: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    modes: tuple[str, ...] = MODES
    repeats: int = 3
    group_size: int = 8
    rl_steps: int = 3
    min_tasks: int = 1
    tasks_per_seq: float = 0.25
    max_tokens: int = 192
    max_prompt_tokens: int = 320
    temperature: float = 0.7
    seed: int = 0
    cost_batches: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    cost_drafts: tuple[int, ...] = (0, 1, 2, 4, 8, 16)
    cost_context: int = 320
    cost_repeats: int = 5
    spec: SpecConfig = dataclasses.field(default_factory=SpecConfig)

    def __post_init__(self) -> None:
        for name in ("repeats", "group_size", "rl_steps", "min_tasks", "max_tokens",
                     "max_prompt_tokens", "cost_context", "cost_repeats"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        for name in ("concurrencies", "cost_batches"):
            v = getattr(self, name)
            if not v or any(isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in v):
                raise ValueError(f"{name} must be non-empty ints >= 1, got {v!r}")
        if not self.cost_drafts or min(self.cost_drafts) < 0:
            raise ValueError(f"cost_drafts must be non-empty ints >= 0, got {self.cost_drafts!r}")
        if not self.modes or any(m not in MODES for m in self.modes):
            raise ValueError(f"modes must be among {MODES}, got {self.modes!r}")
        if not self.tasks_per_seq > 0 or not self.temperature >= 0:
            raise ValueError("tasks_per_seq must be > 0 and temperature >= 0")

    @classmethod
    def quick(cls, **overrides: Any) -> LoadBenchConfig:
        """A few minutes on 2 cores: four concurrencies, shorter outputs, two repeats, two
        RL steps, half the pool (at 64 sequences one RL step is one burst of 64 samples)."""
        values: dict[str, Any] = dict(
            concurrencies=(1, 4, 16, 64), repeats=2, rl_steps=2, max_tokens=96, tasks_per_seq=0.125,
            cost_batches=(1, 4, 16, 64), cost_drafts=(0, 4, 16), cost_repeats=3,
        )
        values.update(overrides)
        return cls(**values)

    def num_tasks(self, concurrency: int) -> int:
        return max(self.min_tasks, math.ceil(self.tasks_per_seq * concurrency))

    @property
    def max_num_tasks(self) -> int:
        return max(self.num_tasks(c) for c in self.concurrencies)


@dataclass(frozen=True)
class RunResult:
    """One mode at one concurrency, all RL steps of one repeat."""

    concurrency: int
    mode: str
    repeat: int
    generated_tokens: int
    seconds: float  # wall time of this mode's own engine steps (and request feeding)
    forward_passes: int  # sequence-steps (GenResult.num_forward_passes summed)
    draft_tokens: int
    accepted_tokens: int
    engine_steps: int
    step_seconds: float  # time inside Engine.step
    cpu_seconds: float  # process CPU time (all threads) during this mode's steps

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def tokens_per_step(self) -> float:
        return self.generated_tokens / self.forward_passes if self.forward_passes else 0.0

    @property
    def spec_tokens_per_seq(self) -> float:
        """Draft tokens verified per sequence and step (the budget the mode chose)."""
        return self.draft_tokens / self.forward_passes if self.forward_passes else 0.0


class RolloutDriver:
    """Feeds one engine synchronous RL steps: each pool is one step, ``concurrency``
    requests in flight (refilled as they finish), the next step starts when the last
    request of this one is done. ``advance()`` runs one engine step and is the only
    place time is measured, so drivers of several engines can take turns."""

    def __init__(self, engine: Engine, pools: Sequence[Sequence[GenRequest]], concurrency: int,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.engine = engine
        self.concurrency = concurrency
        self._pools = deque(deque(pool) for pool in pools)
        self._queue: deque[GenRequest] = deque()
        self._rl_step = -1
        self._clock = clock
        self.seconds = 0.0  # wall time inside advance()
        self.cpu_seconds = 0.0  # process CPU time inside advance()
        self.generated_tokens = 0
        self.forward_passes = 0
        self.draft_tokens = 0
        self.accepted_tokens = 0

    @property
    def done(self) -> bool:
        return not self._pools and not self._queue and not self.engine.has_unfinished()

    def advance(self) -> None:
        """One engine step (starting the next RL step first if this one is over)."""
        t0, cpu0 = self._clock(), time.process_time()
        engine = self.engine
        if not self._queue and not engine.has_unfinished() and self._pools:
            self._rl_step += 1
            engine.observe_rl_step(self._rl_step)
            self._queue = self._pools.popleft()
        while self._queue and engine.num_unfinished < self.concurrency:
            engine.add_request(self._queue.popleft())
        for res in engine.step():
            self.generated_tokens += len(res.output_ids)
            self.forward_passes += res.num_forward_passes
            self.draft_tokens += res.num_draft_tokens
            self.accepted_tokens += res.num_accepted_tokens
        self.seconds += self._clock() - t0
        self.cpu_seconds += time.process_time() - cpu0


def make_driver(model: CausalLM, prompts: Sequence[Prompt], config: LoadBenchConfig,
                concurrency: int, mode: str, repeat: int, stop_id: int) -> RolloutDriver:
    """A fresh engine in ``mode`` with the pools of all RL steps of one repeat (the same
    requests and seeds in every mode)."""
    tasks = list(prompts[: config.num_tasks(concurrency)])
    sampling = SamplingParams(temperature=config.temperature, max_tokens=config.max_tokens,
                              stop_token_ids=(stop_id,), logprobs=True)
    pools = [rl_step_requests(tasks, s, config.group_size, sampling,
                              seed=config.seed + 7919 * repeat) for s in range(config.rl_steps)]
    longest = max(len(p.prompt_ids) for p in tasks) + config.max_tokens + 64
    block = 16
    in_flight = concurrency + config.group_size
    num_blocks = math.ceil(1.25 * in_flight * longest / block) + len(tasks) * longest // block
    engine = Engine(model, EngineConfig(spec_mode=mode, spec=config.spec, num_kv_blocks=num_blocks,
                                        block_size=block, seed=config.seed,
                                        max_num_seqs=max(128, concurrency)))
    return RolloutDriver(engine, pools, concurrency)


def run_side_by_side(model: CausalLM, prompts: Sequence[Prompt], config: LoadBenchConfig,
                     concurrency: int, modes: Sequence[str], repeat: int,
                     stop_id: int) -> list[RunResult]:
    """One engine per mode, stepped in turn (one step each, round robin) until all are
    done: a disturbance of the machine (other jobs) hits every mode alike. A mode's time
    is the time of its own steps."""
    drivers = {m: make_driver(model, prompts, config, concurrency, m, repeat, stop_id)
               for m in modes}
    while True:
        active = [d for d in drivers.values() if not d.done]
        if not active:
            break
        for d in active:
            d.advance()
    return [RunResult(
        concurrency=concurrency, mode=m, repeat=repeat, generated_tokens=d.generated_tokens,
        seconds=d.seconds, forward_passes=d.forward_passes, draft_tokens=d.draft_tokens,
        accepted_tokens=d.accepted_tokens, engine_steps=d.engine.stats.num_steps,
        step_seconds=d.engine.stats.total_step_s, cpu_seconds=d.cpu_seconds,
    ) for m, d in drivers.items()]


def run_sweep(model: CausalLM, prompts: Sequence[Prompt], config: LoadBenchConfig, stop_id: int,
              log: Log | None = None) -> list[RunResult]:
    """Every concurrency, ``repeats`` times, the modes side by side (``run_side_by_side``,
    their turn order rotated each repeat)."""
    runs = []
    for rep in range(config.repeats):
        for c in config.concurrencies:
            k = rep % len(config.modes)
            modes = config.modes[k:] + config.modes[:k]
            for r in run_side_by_side(model, prompts, config, c, modes, rep, stop_id):
                runs.append(r)
                if log is not None:
                    log(f"repeat {rep} concurrency {c} {r.mode}: {r.tokens_per_s:.1f} tok/s, "
                        f"{r.tokens_per_step:.2f} tok/step, budget {r.spec_tokens_per_seq:.2f}, "
                        f"{r.seconds:.1f} s")
    return runs


# --------------------------------------------------------------------------- report


def _median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs)) if xs else math.nan


def summarize(runs: Sequence[RunResult], modes: Sequence[str]) -> dict[str, Any]:
    """``sweep`` (medians per concurrency and mode), ``ratios`` (median over repeats of
    the per-repeat ratio), ``crossover`` and ``targets`` (reported, not asserted)."""
    cells: dict[tuple[int, str], list[RunResult]] = {}
    for r in runs:
        cells.setdefault((r.concurrency, r.mode), []).append(r)
    sweep: list[dict[str, Any]] = [{
        "concurrency": c, "mode": m,
        "tokens_per_s": _median([r.tokens_per_s for r in rs]),
        "tokens_per_step": _median([r.tokens_per_step for r in rs]),
        "spec_tokens_per_seq": _median([r.spec_tokens_per_seq for r in rs]),
        "acceptance_rate": _median([r.accepted_tokens / r.draft_tokens if r.draft_tokens
                                    else 0.0 for r in rs]),
        "generated_tokens": _median([float(r.generated_tokens) for r in rs]),
        "seconds": _median([r.seconds for r in rs]),
        "step_fraction": _median([r.step_seconds / r.seconds if r.seconds else 0.0
                                  for r in rs]),
        "tokens_per_cpu_s": _median([r.generated_tokens / r.cpu_seconds if r.cpu_seconds
                                     else 0.0 for r in rs]),
        "repeats": len(rs),
    } for (c, m), rs in sorted(cells.items())]
    concurrencies = sorted({r.concurrency for r in runs})
    by_rep = {(r.concurrency, r.mode, r.repeat): r for r in runs}
    pairs = [(a, b) for a in modes for b in modes if a != b
             and (a, b) in (("auto", "off"), ("auto", "always"), ("always", "off"))]
    ratios = []
    for c in concurrencies:
        entry: dict[str, Any] = {"concurrency": c}
        for a, b in pairs:
            vals = [by_rep[c, a, rep].tokens_per_s / by_rep[c, b, rep].tokens_per_s
                    for rep in sorted({r.repeat for r in runs})
                    if (c, a, rep) in by_rep and (c, b, rep) in by_rep
                    and by_rep[c, b, rep].tokens_per_s > 0]
            entry[f"{a}/{b}"] = _median(vals)
        ratios.append(entry)
    budget = {(s["concurrency"], s["mode"]): float(s["spec_tokens_per_seq"]) for s in sweep}
    crossover: dict[str, int | None] = {"always_vs_off": None, "auto_budget": None}
    if "always" in modes and "off" in modes:
        crossover["always_vs_off"] = next(
            (e["concurrency"] for e in ratios if e.get("always/off", math.inf) <= 1.0), None)
    if "auto" in modes:
        peak = max((budget[c, "auto"] for c in concurrencies), default=0.0)
        crossover["auto_budget"] = next(
            (c for c in concurrencies if budget[c, "auto"] <= max(0.1, 0.1 * peak)), None)
    return {"sweep": sweep, "ratios": ratios, "crossover": crossover,
            "targets": _targets(ratios)}


def _targets(ratios: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The goals (auto >= 1.4x off at 1-4 sequences; at the highest concurrency auto >=
    0.98x off and >= 1.1x always), each with the measured ratio and whether it was met."""
    out: dict[str, Any] = {}
    for e in ratios:
        if e["concurrency"] <= 4 and "auto/off" in e:
            out[f"auto/off@{e['concurrency']} >= 1.4"] = _met(e["auto/off"], 1.4)
    if ratios:
        top = ratios[-1]
        c = top["concurrency"]
        if "auto/off" in top:
            out[f"auto/off@{c} >= 0.98"] = _met(top["auto/off"], 0.98)
        if "auto/always" in top:
            out[f"auto/always@{c} >= 1.1"] = _met(top["auto/always"], 1.1)
    return out


def _met(value: float, goal: float) -> dict[str, Any]:
    return {"ratio": value, "met": bool(value >= goal)}


def machine_info() -> dict[str, Any]:
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"platform": platform.platform(), "cpu": cpu, "cpu_count": os.cpu_count(),
            "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "python": platform.python_version()}


def summary_line(report: dict[str, Any]) -> str:
    """One line: per concurrency the auto/off and auto/always ratios, then the crossover."""
    parts = []
    for e in report["ratios"]:
        ro, ra = e.get("auto/off", math.nan), e.get("auto/always", math.nan)
        parts.append(f"c{e['concurrency']} {ro:.2f}/{ra:.2f}")
    x = report["crossover"]

    def at(c: int | None) -> str:
        return "never" if c is None else f"c{c}"

    return (f"bench_load: auto/off and auto/always tokens/s: {', '.join(parts)}; crossover "
            f"always<=off at {at(x['always_vs_off'])}, auto budget ~0 at "
            f"{at(x['auto_budget'])}; {report['seconds']:.0f} s")
