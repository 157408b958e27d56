"""The built-in tiny policy: imitation of the scripted experts of the tool environments.

Knows: how expert demonstrations of registered environments are rendered exactly as
the agent loop renders an episode (``HermesTemplate``: the first prompt, then each
assistant text with its end-of-turn token, then the template's continuation) and
tokenized segment by segment with ``encode_segment``, so that training sees the token
boundaries of rollouts; which segments are learned (the assistant's, loss mask 1);
the policy's BPE tokenizer (byte-level, fitted to the demonstrations, merges across
words but never across lines, digits, ``.``, ``?`` or ``'``, so that boilerplate
becomes few tokens and numbers are copied digit by digit); the model (a small Llama
with tied embeddings); training it with ``war.train.lm.train_lm`` on windows that
start at episode starts; saving the Hugging Face folder (written beside its place and
moved there, so that an earlier policy is replaced whole; a folder holding another
model's files is refused before any work); and evaluating the saved
policy's success rate per environment with the rollout driver and an in-process engine.

Does not know the environments' tools or experts (``war.rollout.envs``), the agent
loop (``war.rollout.agent``), the engine's internals or where the shipped policy lives
(``war.data.policy_path``). Reproducibility: a seed and a step budget give the same
demonstrations, tokenizer and weights when run with the same number of threads on the
same machine and torch build (see ``war.train.lm``).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from war.engine.loader import WEIGHTS_FILE, init_random, save_model
from war.engine.model_config import ModelConfig
from war.rollout.chat import IM_END, HermesTemplate, encode_segment
from war.rollout.envs import (
    Environment,
    ToolEnvConfig,
    demonstration,
    make,
    sample_tasks,
)
from war.rollout.envs import names as env_names
from war.train.lm import TrainConfig, TrainLog, TrainResult, check_seed, train_lm
from war.train.tokenizer import ENDOFTEXT, IM_START, TokenizerConfig, save_tokenizer

BUILTIN_ENVS = ("calculator", "files", "sqlite")
PolicyMessage = Mapping[str, Any]


def _positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")


@dataclass(frozen=True)
class PolicyTrainConfig:
    """How the built-in policy is made; validated on construction.

    * ``seed``: of the training tasks, the episode order, the initial weights and the
      training windows; in [0, 2**63).
    * ``envs``: registered environments with scripted experts; ``tasks_per_env``
      demonstrations of each.
    * ``vocab_size``: most tokens of the BPE tokenizer (fewer when fewer merges reach
      ``min_frequency``); the model's vocabulary is the tokenizer's real size.
    * ``hidden_size``, ``num_layers``, ``num_heads``, ``num_kv_heads``,
      ``intermediate_size``, ``max_position_embeddings``, ``rope_theta``: the Llama.
    * ``steps``, ``seq_len``, ``batch_size``, ``lr``, ``min_lr_ratio``,
      ``warmup_steps``, ``weight_decay``: training (``war.train.lm.TrainConfig``);
      windows start at episode starts.
    * ``threads``: torch CPU threads while training (``None``: unchanged); the weights
      depend on it.
    * ``log_every``: steps between loss-curve points.
    """

    seed: int = 0
    envs: tuple[str, ...] = BUILTIN_ENVS
    tasks_per_env: int = 3000
    vocab_size: int = 2048
    min_frequency: int = 20
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 4
    intermediate_size: int = 384
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    steps: int = 3000
    seq_len: int = 256
    batch_size: int = 8
    lr: float = 5e-3
    min_lr_ratio: float = 0.2
    warmup_steps: int = 30
    weight_decay: float = 0.1
    threads: int | None = 1
    log_every: int = 50

    def __post_init__(self) -> None:
        # (checked here, not after the demonstrations and the tokenizer are built)
        check_seed("seed", self.seed)
        if (not isinstance(self.envs, tuple) or not self.envs
                or not all(isinstance(e, str) and e for e in self.envs)
                or len(set(self.envs)) != len(self.envs)):
            raise ValueError(f"envs must be a non-empty tuple of distinct names, got {self.envs!r}")
        for name in ("tasks_per_env", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                     "intermediate_size", "max_position_embeddings", "steps", "seq_len",
                     "batch_size", "min_frequency", "log_every"):
            _positive_int(name, getattr(self, name))
        if self.hidden_size % self.num_heads or (self.hidden_size // self.num_heads) % 2:
            raise ValueError(f"hidden_size {self.hidden_size} must split into {self.num_heads} "
                             "heads of an even size")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads "
                             f"{self.num_kv_heads}")
        if self.seq_len >= self.max_position_embeddings:
            raise ValueError(f"seq_len {self.seq_len} must be below max_position_embeddings "
                             f"{self.max_position_embeddings}")
        # the rest is checked by the configs it builds (the model's with stand-in token
        # ids: its real vocabulary is known only once the tokenizer is fitted)
        self.tokenizer_config()
        self.train_config()
        self._llama(vocab_size=self.vocab_size, eos_token_id=0, pad_token_id=0)

    def tokenizer_config(self) -> TokenizerConfig:
        return TokenizerConfig(vocab_size=self.vocab_size, min_frequency=self.min_frequency,
                               special_tokens=(ENDOFTEXT, IM_START, IM_END),
                               model_max_length=self.max_position_embeddings)

    def train_config(self) -> TrainConfig:
        return TrainConfig(seq_len=self.seq_len, batch_size=self.batch_size, steps=self.steps,
                           lr=self.lr, min_lr_ratio=self.min_lr_ratio,
                           warmup_steps=self.warmup_steps, weight_decay=self.weight_decay,
                           seed=self.seed, threads=self.threads, log_every=self.log_every)

    def model_config(self, tokenizer: Tokenizer) -> ModelConfig:
        """The Llama for ``tokenizer`` (its vocabulary size, ``<|im_end|>`` as eos)."""
        return self._llama(vocab_size=tokenizer.get_vocab_size(),
                           eos_token_id=_token_id(tokenizer, IM_END),
                           pad_token_id=_token_id(tokenizer, ENDOFTEXT))

    def _llama(self, *, vocab_size: int, eos_token_id: int, pad_token_id: int) -> ModelConfig:
        return ModelConfig(
            model_type="llama", vocab_size=vocab_size,
            hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers, num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads, rms_norm_eps=1e-5,
            rope_theta=self.rope_theta, max_position_embeddings=self.max_position_embeddings,
            tie_word_embeddings=True, eos_token_id=(eos_token_id,), pad_token_id=pad_token_id,
        )


# ------------------------------------------------------------------ demonstrations


@dataclass(frozen=True)
class Segment:
    """A piece of an episode's text as the agent loop appends it: ``sampled`` pieces
    are the assistant's turns (with their end-of-turn token), the rest is template,
    prompt and tool output."""

    text: str
    sampled: bool


@dataclass(frozen=True)
class Episode:
    """One expert demonstration, rendered: its messages, tools and segments."""

    env: str
    task_id: str
    messages: tuple[PolicyMessage, ...]
    tools: tuple[Mapping[str, Any], ...]
    segments: tuple[Segment, ...]

    @property
    def text(self) -> str:
        return "".join(s.text for s in self.segments)


def episode_segments(messages: Sequence[PolicyMessage], tools: Sequence[Mapping[str, Any]],
                     template: HermesTemplate | None = None) -> list[Segment]:
    """The segments of a finished conversation (system, user, then assistant turns with
    their tool messages, ending with an assistant turn) in the order the agent loop
    appends them: ``render_prompt`` of the messages up to the first assistant turn,
    then each assistant text plus ``<|im_end|>`` (sampled) followed by
    ``render_continuation`` of the messages up to the next assistant turn."""
    tmpl = template if template is not None else HermesTemplate()
    roles = [m["role"] for m in messages]
    if "assistant" not in roles or roles[-1] != "assistant":
        raise ValueError("a demonstration must contain assistant turns and end with one")
    first = roles.index("assistant")
    if first == 0:
        raise ValueError("a demonstration must start with a prompt before the assistant")
    segments = [Segment(tmpl.render_prompt(messages[:first], tools), sampled=False)]
    i = first
    while i < len(messages):
        segments.append(Segment(str(messages[i]["content"]) + tmpl.end_of_turn, sampled=True))
        j = i + 1
        while j < len(messages) and messages[j]["role"] != "assistant":
            j += 1
        if j > i + 1:
            segments.append(Segment(
                tmpl.render_continuation(messages[:i + 1], messages[i + 1:j], tools),
                sampled=False))
        elif j < len(messages):
            raise ValueError(f"message {j}: two assistant turns in a row")
        i = j
    return segments


def _make_env(name: str) -> Environment:
    """``name``'s environment with tools run inline (no worker threads: demonstrations
    are built fast and have no deadline); environments without a config take none."""
    try:
        return make(name, config=ToolEnvConfig(timeout_s=None))
    except TypeError:
        return make(name)


def _check_envs(envs: object, what: str) -> tuple[str, ...]:
    """``envs`` as a tuple, or ValueError naming ``what`` unless it is a non-empty
    sequence of distinct registered environment names (checked before any of them is
    used, so that a misspelt last name does not fail after the others' work)."""
    if (isinstance(envs, str) or not isinstance(envs, Sequence) or not envs
            or not all(isinstance(e, str) and e for e in envs)
            or len(set(envs)) != len(envs)):
        raise ValueError(f"{what} must be a non-empty sequence of distinct environment "
                         f"names, got {envs!r}")
    unknown = [e for e in envs if e not in env_names()]
    if unknown:
        raise ValueError(f"{what}: unknown environment {', '.join(map(repr, unknown))} "
                         f"(known: {', '.join(env_names()) or 'none'})")
    return tuple(envs)


def build_demonstrations(config: PolicyTrainConfig) -> list[Episode]:
    """``config.tasks_per_env`` expert episodes of each of ``config.envs`` (tasks
    ``sample_tasks(env, n, config.seed)``), in a seeded shuffled order. Episodes the
    expert does not solve (score below 1) are left out."""
    _check_envs(config.envs, "envs")
    tmpl = HermesTemplate()
    episodes: list[Episode] = []
    for name in config.envs:
        env = _make_env(name)
        try:
            tools = tuple(spec.to_openai() for spec in env.tools())
            for task in sample_tasks(name, config.tasks_per_env, config.seed):
                messages = demonstration(env, task)
                if env.score(str(messages[-1]["content"])) < 1.0:
                    continue
                episodes.append(Episode(name, task.task_id, tuple(messages), tools,
                                        tuple(episode_segments(messages, tools, tmpl))))
        finally:
            env.close()
    random.Random(config.seed).shuffle(episodes)
    return episodes


# ------------------------------------------------------------------ tokenizer


def train_policy_tokenizer(texts: Iterable[str], config: TokenizerConfig) -> Tokenizer:
    """A byte-level BPE tokenizer fitted to ``texts`` whose merges may span words (the
    chat template's and tools' boilerplate becomes a few tokens) but never a newline,
    a digit (numbers are spelled digit by digit), ``.``, ``?`` or ``'``. Special tokens
    get the lowest ids in ``config.special_tokens`` order; every string round-trips."""
    if isinstance(texts, str):  # its letters would be the texts: nothing to merge
        raise ValueError("texts must be an iterable of strings, not one string")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split("\n", "isolated"),
        pre_tokenizers.Split(Regex(r"[.?']"), "isolated"),
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=config.vocab_size, min_frequency=config.min_frequency,
        special_tokens=list(config.special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    specials = config.special_tokens

    def plain(items: Iterable[str]) -> Iterable[str]:
        for text in items:  # no merge learns the pieces of a special token
            for tok in specials:
                text = text.replace(tok, "\n")
            yield text

    tokenizer.train_from_iterator(plain(texts), trainer=trainer)
    return tokenizer


def _token_id(tokenizer: Tokenizer, token: str) -> int:
    tid = tokenizer.token_to_id(token)
    if tid is None or encode_segment(tokenizer, token) != [tid]:
        raise ValueError(f"{token!r} is not a single token of the tokenizer")
    return int(tid)


def save_policy_tokenizer(tokenizer: Tokenizer, folder: str | os.PathLike[str],
                          config: TokenizerConfig) -> None:
    """``tokenizer.json`` and ``tokenizer_config.json`` (eos ``<|im_end|>``, pad
    ``<|endoftext|>``) without a chat template: WAR then uses its built-in Hermes
    template, the one the policy was trained with."""
    save_tokenizer(tokenizer, folder, config)
    path = Path(folder) / "tokenizer_config.json"
    meta = json.loads(path.read_text(encoding="utf-8"))
    meta.pop("chat_template", None)
    path.write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")


def tokenize_episode(tokenizer: Tokenizer, episode: Episode) -> tuple[list[int], list[int]]:
    """Token ids and loss mask of ``episode``: each segment encoded on its own with
    ``encode_segment``; mask 1 on the sampled segments' tokens."""
    ids: list[int] = []
    mask: list[int] = []
    for seg in episode.segments:
        seg_ids = encode_segment(tokenizer, seg.text)
        ids.extend(seg_ids)
        mask.extend([int(seg.sampled)] * len(seg_ids))
    return ids, mask


@dataclass(frozen=True)
class TokenStream:
    """Episodes one after the other, each followed by ``<|endoftext|>`` (mask 0)."""

    tokens: npt.NDArray[np.int32]
    loss_mask: npt.NDArray[np.uint8]
    episode_starts: npt.NDArray[np.int64]
    episode_lengths: npt.NDArray[np.int64]  # without the separator

    def window_starts(self, seq_len: int) -> npt.NDArray[np.int64]:
        """Episode starts where a training window of ``seq_len`` fits in the stream."""
        starts = self.episode_starts[self.episode_starts <= len(self.tokens) - seq_len - 1]
        if len(starts) == 0:
            raise ValueError(f"the stream ({len(self.tokens)} tokens) is too short for "
                             f"seq_len {seq_len}")
        return starts


def build_stream(tokenizer: Tokenizer, episodes: Sequence[Episode]) -> TokenStream:
    """The training stream of ``episodes`` (in order)."""
    eot = _token_id(tokenizer, ENDOFTEXT)
    tokens: list[int] = []
    mask: list[int] = []
    starts: list[int] = []
    lengths: list[int] = []
    for episode in episodes:
        ids, m = tokenize_episode(tokenizer, episode)
        starts.append(len(tokens))
        lengths.append(len(ids))
        tokens.extend([*ids, eot])
        mask.extend([*m, 0])
    return TokenStream(np.asarray(tokens, dtype=np.int32), np.asarray(mask, dtype=np.uint8),
                       np.asarray(starts, dtype=np.int64), np.asarray(lengths, dtype=np.int64))


# ------------------------------------------------------------------ training


# What ``train_policy`` writes into its folder; a folder holding only these (and files
# that are no model's) is an earlier policy, replaced as a whole.
POLICY_FILES = ("config.json", WEIGHTS_FILE, "tokenizer.json", "tokenizer_config.json")
# Files that make a folder another model's: the engine loads every ``*.safetensors``
# (an index first) and the chat template prefers ``chat_template.jinja``, so one left
# beside a new policy would mix with it; the others are what a Hugging Face download
# holds. ``train_policy`` refuses such a folder rather than delete someone's model.
_MODEL_FILE_PATTERNS = (
    "*.safetensors", "*.safetensors.index.json", "*.bin", "*.bin.index.json", "*.pt", "*.pth",
    "*.gguf", "chat_template.jinja", "tokenizer.model", "special_tokens_map.json",
    "generation_config.json", "vocab.json", "merges.txt", "added_tokens.json",
)


def _foreign_model_files(folder: Path) -> list[str]:
    if not folder.is_dir():
        return []
    return sorted(p.name for p in folder.iterdir()
                  if p.name not in POLICY_FILES and not p.is_dir()
                  and any(p.match(pattern) for pattern in _MODEL_FILE_PATTERNS))


def check_policy_out(out_dir: str | os.PathLike[str], what: str = "out_dir") -> Path:
    """Checks, before any training, that a policy can be written to ``out_dir``: it is
    missing, empty, or holds an earlier policy (``POLICY_FILES``, replaced) and files
    that are no model's (kept), but no other model's files (``*.safetensors`` shards,
    an index, a ``chat_template.jinja``...); and its parent folder takes the temporary
    folder the new policy is written to first. Raises ValueError naming ``what``."""
    out = Path(out_dir)
    try:
        if out.exists() and not out.is_dir():
            raise ValueError(f"{what} {out} exists and is not a folder")
        foreign = _foreign_model_files(out)
    except OSError as e:  # e.g. a name too long for the file system
        raise ValueError(f"{what} {out}: {e.strerror or e}") from None
    if foreign:
        raise ValueError(f"{what} {out} holds another model's files ({', '.join(foreign)}), "
                         "which would mix with the new policy: choose another folder or "
                         "remove them")
    parent = Path(os.path.realpath(out)).parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryDirectory(dir=parent).cleanup()
    except OSError as e:
        raise ValueError(f"{what} {out}: cannot write in {parent}, where the new policy is "
                         f"written before it is moved into place: {e.strerror or e}") from None
    return out


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _write_policy(out: Path, write: Callable[[Path], None]) -> None:
    """Runs ``write`` on a temporary folder beside ``out``, then puts that folder in
    the place of ``out``, carrying over the files of ``out`` that are not
    ``POLICY_FILES``: ``out`` then holds exactly the new policy's model files, never a
    mix with an earlier one (a reader sees the old folder or the new one), and a
    failed write leaves ``out`` as it was."""
    real = Path(os.path.realpath(out))  # a symlinked --out: replace what it points to
    real.parent.mkdir(parents=True, exist_ok=True)
    # the name is cut so that the temporary's (and its ".old") fits where out's does
    tmp = Path(tempfile.mkdtemp(prefix=f".{real.name[:32]}.", suffix=".tmp", dir=real.parent))
    try:
        write(tmp)
        # mkdtemp makes the folder private: give it the replaced folder's mode (or a
        # plain mkdir's)
        os.chmod(tmp, real.stat().st_mode & 0o7777 if real.is_dir() else 0o777 & ~_umask())
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if not real.exists():
        os.rename(tmp, real)
        return
    # checked again: such files may have appeared while the model trained
    foreign = _foreign_model_files(real)
    if foreign:
        raise ValueError(f"{out} now holds another model's files ({', '.join(foreign)}); "
                         f"the new policy was left in {tmp}")
    try:
        cwd: str | None = os.getcwd()
    except OSError:
        cwd = None
    old = Path(f"{tmp}.old")
    try:
        os.rename(real, old)
        try:
            os.rename(tmp, real)
        except OSError:
            os.rename(old, real)
            raise
    except OSError as e:  # the trained policy is kept: say where
        raise OSError(e.errno, f"cannot replace {out} ({e.strerror}); the new policy was "
                      f"left in {tmp}") from e
    for entry in old.iterdir():
        if entry.name not in POLICY_FILES:
            os.rename(entry, real / entry.name)
    shutil.rmtree(old)
    # a process working inside the replaced folder would otherwise be left in the
    # removed one: return it to the same path, now inside the new folder
    if cwd is not None and Path(cwd).is_relative_to(real):
        os.chdir(cwd)


@dataclass(frozen=True)
class PolicySummary:
    """What ``train_policy`` made and how long each part took."""

    out_dir: str
    config: PolicyTrainConfig
    episodes_by_env: dict[str, int]
    stream_tokens: int
    sampled_tokens: int
    longest_episode: int
    mean_episode: float
    vocab_size: int
    parameters: int
    folder_bytes: int
    threads: int
    demo_seconds: float
    tokenizer_seconds: float
    train_seconds: float
    total_seconds: float
    train: TrainResult

    def to_dict(self) -> dict[str, Any]:
        train = self.train
        return {
            "out_dir": self.out_dir, "config": _config_dict(self.config),
            "episodes_by_env": dict(self.episodes_by_env), "stream_tokens": self.stream_tokens,
            "sampled_tokens": self.sampled_tokens, "longest_episode": self.longest_episode,
            "mean_episode": self.mean_episode, "vocab_size": self.vocab_size,
            "parameters": self.parameters, "folder_bytes": self.folder_bytes,
            "threads": self.threads, "demo_seconds": self.demo_seconds,
            "tokenizer_seconds": self.tokenizer_seconds, "train_seconds": self.train_seconds,
            "total_seconds": self.total_seconds,
            "train": {"steps": train.steps, "tokens": train.tokens, "seconds": train.seconds,
                      "first_loss": train.first_loss, "final_loss": train.final_loss,
                      "curve": [[p.step, round(p.loss, 4)] for p in train.curve]},
        }


def _config_dict(config: PolicyTrainConfig) -> dict[str, Any]:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in vars(config).items()}


def train_policy(config: PolicyTrainConfig, out_dir: str | os.PathLike[str],
                 log: Callable[[str], None] | None = None,
                 on_step: Callable[[TrainLog], None] | None = None) -> PolicySummary:
    """Builds the demonstrations, fits the tokenizer, trains the model and writes the
    Hugging Face folder ``out_dir`` (``config.json``, ``model.safetensors``,
    ``tokenizer.json``, ``tokenizer_config.json``); returns the summary. ``log`` gets
    progress lines, ``on_step`` the loss-curve points.

    ``out_dir`` is checked first (``check_policy_out``: a folder holding another
    model's files is refused). The policy is written to a temporary folder beside it
    that then takes its place, so an earlier policy there is replaced as a whole (its
    other files are kept) and never mixed with the new one."""
    say = log if log is not None else (lambda _: None)
    out = check_policy_out(out_dir)
    t0 = time.perf_counter()
    episodes = build_demonstrations(config)
    if not episodes:
        raise ValueError("the experts solved no task: nothing to learn from")
    by_env: dict[str, int] = {}
    for ep in episodes:
        by_env[ep.env] = by_env.get(ep.env, 0) + 1
    t1 = time.perf_counter()
    say(f"{len(episodes)} demonstrations ({', '.join(f'{k} {v}' for k, v in by_env.items())}) "
        f"in {t1 - t0:.1f} s")
    tok_config = config.tokenizer_config()
    tokenizer = train_policy_tokenizer((ep.text for ep in episodes), tok_config)
    stream = build_stream(tokenizer, episodes)
    median = float(np.median(stream.episode_lengths))
    if median > config.seq_len:
        raise ValueError(f"half the episodes are longer than seq_len ({median:.0f} > "
                         f"{config.seq_len} tokens): demonstrate more tasks (the tokenizer then "
                         "compresses the prompts better) or raise seq_len")
    t2 = time.perf_counter()
    say(f"tokenizer: {tokenizer.get_vocab_size()} tokens; stream {len(stream.tokens)} tokens, "
        f"{int(stream.loss_mask.sum())} sampled; episodes mean "
        f"{float(stream.episode_lengths.mean()):.0f}, longest "
        f"{int(stream.episode_lengths.max())} tokens ({t2 - t1:.1f} s)")
    model_config = config.model_config(tokenizer)
    model = init_random(model_config, config.seed)
    params = sum(p.numel() for p in model.parameters())
    threads = config.threads if config.threads is not None else torch.get_num_threads()
    say(f"model: llama {config.num_layers} layers x {config.hidden_size}, {params / 1e6:.2f} M "
        f"parameters; training {config.steps} steps of {config.batch_size} x {config.seq_len} "
        f"tokens on {threads} threads")
    result = train_lm(model, stream.tokens, config.train_config(), log=on_step,
                      loss_mask=stream.loss_mask,
                      window_starts=stream.window_starts(config.seq_len))
    t3 = time.perf_counter()

    def write(folder: Path) -> None:
        save_model(model, folder)
        save_policy_tokenizer(tokenizer, folder, tok_config)

    _write_policy(out, write)
    folder_bytes = sum((out / name).stat().st_size for name in POLICY_FILES)
    return PolicySummary(
        out_dir=str(out), config=config, episodes_by_env=by_env,
        stream_tokens=len(stream.tokens), sampled_tokens=int(stream.loss_mask.sum()),
        longest_episode=int(stream.episode_lengths.max()),
        mean_episode=float(stream.episode_lengths.mean()),
        vocab_size=tokenizer.get_vocab_size(), parameters=params, folder_bytes=folder_bytes,
        threads=threads, demo_seconds=t1 - t0, tokenizer_seconds=t2 - t1,
        train_seconds=t3 - t2, total_seconds=time.perf_counter() - t0, train=result)


# ------------------------------------------------------------------ evaluation


@dataclass(frozen=True)
class PolicyEval:
    """Success rates of a policy on fresh tasks (a success: reward 1)."""

    tasks_per_env: int
    seed: int
    temperature: float
    success_by_env: dict[str, float]
    finish_reasons: dict[str, int] = field(default_factory=dict)
    mean_turns: float = 0.0
    sampled_tokens: int = 0
    seconds: float = 0.0

    @property
    def overall(self) -> float:
        """The mean of the per-environment success rates."""
        rates = list(self.success_by_env.values())
        return sum(rates) / len(rates) if rates else math.nan

    def to_dict(self) -> dict[str, Any]:
        return {"tasks_per_env": self.tasks_per_env, "seed": self.seed,
                "temperature": self.temperature, "success_by_env": dict(self.success_by_env),
                "overall": self.overall, "finish_reasons": dict(self.finish_reasons),
                "mean_turns": self.mean_turns, "sampled_tokens": self.sampled_tokens,
                "seconds": self.seconds}


def evaluate_policy(folder: str | os.PathLike[str], *, envs: Sequence[str] = BUILTIN_ENVS,
                    tasks_per_env: int = 50, seed: int = 1000, temperature: float = 0.7,
                    threads: int | None = None) -> PolicyEval:
    """Runs one episode of each of ``tasks_per_env`` tasks (``sample_tasks(env, n,
    seed)``: pick a seed the policy was not trained on) of every environment through
    the rollout driver, on an in-process engine serving ``folder``, sampling at
    ``temperature``; returns the success rate of each environment."""
    # imported here: evaluation needs the engine and the agent loop, training does not
    from war.engine.async_engine import AsyncEngine
    from war.engine.config import EngineConfig
    from war.engine.engine import Engine
    from war.rollout.agent import AgentConfig, PolicyIO
    from war.rollout.driver import RolloutConfig, run_step_async

    envs = _check_envs(envs, "envs")
    _positive_int("tasks_per_env", tasks_per_env)
    check_seed("seed", seed)
    if threads is not None:
        _positive_int("threads", threads)
    tasks = [t for env in envs for t in sample_tasks(env, tasks_per_env, seed)]
    io = PolicyIO.from_folder(Path(folder))
    engine_config = EngineConfig(kv_cache_bytes=256 * 1024 * 1024, max_num_seqs=64, seed=seed)
    rollout = RolloutConfig(group_size=1, agent=AgentConfig(temperature=temperature), seed=seed)
    old_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    start = time.perf_counter()
    try:
        engine = Engine.from_pretrained(Path(folder), engine_config)

        async def run() -> list[Any]:
            async with AsyncEngine(engine) as replica:
                return await run_step_async(tasks, {"policy": replica}, io, rollout)

        trajectories = asyncio.run(run())
    finally:
        torch.set_num_threads(old_threads)
    rewards: dict[str, list[float]] = {env: [] for env in envs}
    reasons: dict[str, int] = {}
    for traj in trajectories:
        rewards[traj.env].append(traj.reward)
        reasons[traj.finish_reason] = reasons.get(traj.finish_reason, 0) + 1
    return PolicyEval(
        tasks_per_env=tasks_per_env, seed=seed, temperature=temperature,
        success_by_env={env: sum(r >= 1.0 for r in rs) / len(rs) for env, rs in rewards.items()},
        finish_reasons=reasons,
        mean_turns=sum(t.num_turns for t in trajectories) / max(len(trajectories), 1),
        sampled_tokens=sum(t.num_sampled_tokens for t in trajectories),
        seconds=time.perf_counter() - start)
