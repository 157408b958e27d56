"""Agent trajectory traces: the JSONL record format and its chat rendering into tokens.

This module knows the trace format (`shared/data/traces/README.md`: one JSON object per
line with `task_id`, `trial`, `source`, `messages`, ...), how a conversation is rendered
as ChatML (`<|im_start|>{role}\\n{content}<|im_end|>\\n`) and tokenized, and the orders in
which trajectories are replayed. It knows nothing about suffix trees or speculation:
its output is plain token arrays, cut into turns the way an inference engine sees them.

A trajectory's turns alternate between what the engine is given and what it generates:

* `Turn.prompt_delta`: every token since the previous response ended. For the first turn
  that is the whole prompt up to and including `<|im_start|>assistant\\n`; afterwards the
  `\\n` after the previous `<|im_end|>`, the tool/user messages in between and the next
  `<|im_start|>assistant\\n`.
* `Turn.response`: the assistant message's content tokens followed by `<|im_end|>`.

Messages after the last assistant message are dropped (nothing is generated after them).
Each segment (special token, `{role}\\n` header, content, `\\n`) is tokenized on its own,
so no token ever spans a message boundary or the prompt/response boundary. Content is
tokenized as a chat template would: a literal `<|im_end|>` inside content becomes the
special token.
"""

from __future__ import annotations

import gzip
import json
import math
import os
import random
import zlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeAlias

import numpy as np
import numpy.typing as npt
from tokenizers import Tokenizer

from war import data
from war.data import Traversable

ROLES = ("system", "user", "assistant", "tool")
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
TraceSource: TypeAlias = "str | os.PathLike[str] | Traversable"  # a path or a package resource
TokenArray = npt.NDArray[np.int32]  # (num_tokens,), read-only

# Texts per `encode_batch` call: large enough to use every core, small enough that the
# tokenizer's per-token bookkeeping (offsets, token strings) stays a few hundred MB.
_ENCODE_CHUNK = 2048


@dataclass(frozen=True)
class Message:
    role: str  # one of ROLES
    content: str


@dataclass(frozen=True)
class TraceRecord:
    """One validated JSONL record (one trajectory, untokenized)."""

    task_id: str  # group key: trials of one task share it
    trial: int  # >= 0
    source: str
    model: str | None
    reward: float | None
    messages: tuple[Message, ...]
    file: str  # the trace file as given to `load_records`
    line: int  # 1-based line number in `file`


@dataclass(frozen=True, eq=False)
class Turn:
    """One engine call: the tokens it is given, then the tokens it generates."""

    prompt_delta: TokenArray  # (num_prompt_tokens,) tokens since the previous response
    response: TokenArray  # (num_response_tokens,) content tokens + <|im_end|>, never empty


@dataclass(frozen=True, eq=False)
class Trajectory:
    """One tokenized trajectory; `(task_id, trial, source)` identifies it."""

    task_id: str
    trial: int
    source: str
    file: str  # file name (no directory) of the trace file it came from
    reward: float | None
    turns: tuple[Turn, ...]

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(t.prompt_delta) for t in self.turns)

    @property
    def num_response_tokens(self) -> int:
        return sum(len(t.response) for t in self.turns)


@dataclass(frozen=True)
class ChatFormat:
    """Token ids of the fixed parts of the ChatML rendering, for one tokenizer."""

    im_start: int
    im_end: int
    newline: tuple[int, ...]  # the "\n" after <|im_end|>
    headers: Mapping[str, tuple[int, ...]]  # role -> tokens of "{role}\n"

    @classmethod
    def of(cls, tokenizer: Tokenizer) -> ChatFormat:
        """Reads the ids from `tokenizer`, which must know IM_START and IM_END (see
        `load_tokenizer`)."""
        ids = [tokenizer.token_to_id(t) for t in (IM_START, IM_END)]
        if ids[0] is None or ids[1] is None:
            raise ValueError(
                f"tokenizer lacks the special tokens {IM_START} / {IM_END}; "
                "load it with war.spec.traces.load_tokenizer"
            )

        def encode(text: str) -> tuple[int, ...]:
            return tuple(tokenizer.encode(text, add_special_tokens=False).ids)

        return cls(
            im_start=int(ids[0]),
            im_end=int(ids[1]),
            newline=encode("\n"),
            headers={role: encode(f"{role}\n") for role in ROLES},
        )


def find_shared_data(start: Path) -> Path | None:
    """The nearest ``shared/data`` folder at or above ``start`` (where trace files and
    the GPT-2 tokenizer sit beside a checkout of this project), or None."""
    for folder in (start, *start.parents):
        candidate = folder / "shared" / "data"
        if candidate.is_dir():
            return candidate
    return None


def shared_inputs(start: Path) -> tuple[list[Path], Path | None]:
    """The nearest shared data folder's trace files (every ``traces/*.jsonl``, sorted;
    none without the folder) and its ``tokenizer/gpt2/tokenizer.json`` (None if absent):
    the default inputs of the speculator's benchmarks."""
    shared = find_shared_data(start)
    if shared is None:
        return [], None
    folder = shared / "traces"
    traces = sorted(folder.glob("*.jsonl")) if folder.is_dir() else []
    tokenizer = shared / "tokenizer" / "gpt2" / "tokenizer.json"
    return traces, tokenizer if tokenizer.is_file() else None


def load_tokenizer(path: str | os.PathLike[str] | None = None) -> Tokenizer:
    """A `tokenizers.Tokenizer` with IM_START / IM_END added as special tokens.

    `path` is a `tokenizer.json` (or a gzip of one, `*.gz`); None means the bundled GPT-2
    tokenizer (`war.data`).
    """
    if path is None:
        tokenizer = Tokenizer.from_str(data.gpt2_tokenizer_json())
    else:
        p = Path(path)
        if not p.is_file():
            raise FileNotFoundError(f"tokenizer file not found: {os.fspath(path)}")
        if p.name.endswith(".gz"):
            tokenizer = Tokenizer.from_str(gzip.decompress(p.read_bytes()).decode("utf-8"))
        else:
            tokenizer = Tokenizer.from_file(os.fspath(p))
    tokenizer.add_special_tokens([IM_START, IM_END])
    return tokenizer


# ---------------------------------------------------------------- records


def load_records(sources: Iterable[TraceSource], limit: int | None = None) -> list[TraceRecord]:
    """Reads and validates JSONL trace files (`*.gz` is decompressed), in order; with
    `limit`, only the first `limit` records of each file.

    A source is a path or a package resource such as `war.data.resource(SAMPLE_TRACES)`.

    Raises FileNotFoundError for a missing file and ValueError naming `file:line` for a
    malformed record or a duplicate `(task_id, trial, source)`. Blank lines are skipped.
    """
    if limit is not None and (
        not isinstance(limit, int) or isinstance(limit, bool) or limit < 0
    ):
        raise ValueError(f"limit must be an int >= 0 or None, got {limit!r}")
    if isinstance(sources, str | os.PathLike):  # (a str would be read as one file per char)
        raise ValueError(f"sources must be a list of trace files, got the single path {sources!r}")
    records: list[TraceRecord] = []
    seen: dict[tuple[str, int, str], str] = {}
    for source in sources:
        name = os.fspath(source) if isinstance(source, str | os.PathLike) else source.name
        path = Path(source) if isinstance(source, str | os.PathLike) else source
        for i, rec in enumerate(parse_records(_read_text(path, name), name)):
            if i == limit:
                break
            key = (rec.task_id, rec.trial, rec.source)
            where = f"{rec.file}:{rec.line}"
            if key in seen:
                raise ValueError(
                    f"{where}: duplicate trajectory (task_id={rec.task_id!r}, "
                    f"trial={rec.trial}, source={rec.source!r}), first at {seen[key]}"
                )
            seen[key] = where
            records.append(rec)
    return records


def parse_records(text: str, file: str) -> Iterator[TraceRecord]:
    """Validates the records in `text` (JSONL); `file` names it in errors."""
    # Records end at "\n" only: str.splitlines() also splits at U+2028, U+0085, ...,
    # which JSON strings may hold unescaped.
    for lineno, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except (ValueError, RecursionError) as e:  # (also too many digits, deep nesting)
            raise ValueError(f"{file}:{lineno}: invalid JSON: {e}") from None
        yield _record(obj, file, lineno)


def missing_trace_file(path: Traversable, name: str) -> FileNotFoundError:
    """The error for a trace file ``name`` (at ``path``) that cannot be read as a file:
    absent, or a folder."""
    if isinstance(path, Path) and path.exists():
        return FileNotFoundError(f"trace file {name} is not a file")
    return FileNotFoundError(f"trace file not found: {name}")


def _read_text(path: Traversable, name: str) -> str:
    if not path.is_file():
        raise missing_trace_file(path, name)
    raw = path.read_bytes()
    if path.name.endswith(".gz"):
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError, zlib.error) as e:
            raise ValueError(f"{name}: not a valid gzip file: {e}") from None
    try:
        return raw.decode("utf-8-sig")  # (a byte-order mark, as some editors write, is not text)
    except UnicodeDecodeError as e:
        raise ValueError(f"{name}: not UTF-8: {e}") from None


def _record(obj: Any, file: str, line: int) -> TraceRecord:
    where = f"{file}:{line}"
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: a record must be a JSON object, got {type(obj).__name__}")
    missing = [k for k in ("task_id", "trial", "source", "messages") if k not in obj]
    if missing:
        raise ValueError(f"{where}: record lacks key(s) {', '.join(missing)}")
    task_id, trial, source = obj["task_id"], obj["trial"], obj["source"]
    if not isinstance(task_id, str) or not task_id:
        raise ValueError(f"{where}: 'task_id' must be a non-empty string, got {task_id!r}")
    if not isinstance(trial, int) or isinstance(trial, bool) or trial < 0:
        raise ValueError(f"{where}: 'trial' must be an integer >= 0, got {trial!r}")
    if not isinstance(source, str):
        raise ValueError(f"{where}: 'source' must be a string, got {source!r}")
    model = obj.get("model")
    if model is not None and not isinstance(model, str):
        raise ValueError(f"{where}: 'model' must be a string or null, got {model!r}")
    reward = obj.get("reward")
    if reward is not None and (not isinstance(reward, int | float) or isinstance(reward, bool)):
        raise ValueError(f"{where}: 'reward' must be a number or null, got {reward!r}")
    if reward is not None and (
        (isinstance(reward, int) and abs(reward) > 2**1023) or not math.isfinite(reward)
    ):  # (json reads NaN and Infinity; float() of a huge int overflows)
        raise ValueError(f"{where}: 'reward' must be finite, got {reward!r}")
    raw_messages = obj["messages"]
    if not isinstance(raw_messages, list):
        raise ValueError(f"{where}: 'messages' must be a list")
    messages = tuple(_message(m, f"{where}: messages[{i}]") for i, m in enumerate(raw_messages))
    return TraceRecord(
        task_id=task_id,
        trial=trial,
        source=source,
        model=model,
        reward=None if reward is None else float(reward),
        messages=messages,
        file=file,
        line=line,
    )


def _message(obj: Any, where: str) -> Message:
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: a message must be an object, got {type(obj).__name__}")
    missing = [k for k in ("role", "content") if k not in obj]
    if missing:
        raise ValueError(f"{where}: message lacks key(s) {', '.join(missing)}")
    role, content = obj["role"], obj["content"]
    if role not in ROLES:
        raise ValueError(f"{where}: unknown role {role!r} (expected one of {', '.join(ROLES)})")
    if not isinstance(content, str):
        raise ValueError(f"{where}: 'content' must be a string, got {type(content).__name__}")
    return Message(role=role, content=content)


# ---------------------------------------------------------------- tokens


def tokenize(records: Sequence[TraceRecord], tokenizer: Tokenizer) -> list[Trajectory]:
    """Renders and tokenizes each record into turns (see the module docstring)."""
    fmt = ChatFormat.of(tokenizer)
    contents = [m.content for rec in records for m in rec.messages]
    content_ids: list[TokenArray] = []
    for lo in range(0, len(contents), _ENCODE_CHUNK):
        batch = tokenizer.encode_batch(contents[lo : lo + _ENCODE_CHUNK], add_special_tokens=False)
        content_ids.extend(np.asarray(e.ids, dtype=np.int32) for e in batch)
    pieces = iter(content_ids)
    return [_trajectory(rec, [next(pieces) for _ in rec.messages], fmt) for rec in records]


def _trajectory(rec: TraceRecord, content_ids: list[TokenArray], fmt: ChatFormat) -> Trajectory:
    start, end = np.array([fmt.im_start], np.int32), np.array([fmt.im_end], np.int32)
    newline = np.array(fmt.newline, np.int32)
    headers = {role: np.array(ids, np.int32) for role, ids in fmt.headers.items()}
    turns: list[Turn] = []
    pending: list[TokenArray] = []  # prompt tokens since the last response ended
    for msg, ids in zip(rec.messages, content_ids, strict=True):
        pending += [start, headers[msg.role]]
        if msg.role == "assistant":
            turns.append(Turn(_frozen(pending), _frozen([ids, end])))
            pending = [newline]
        else:
            pending += [ids, end, newline]
    return Trajectory(
        task_id=rec.task_id,
        trial=rec.trial,
        source=rec.source,
        file=Path(rec.file).name,
        reward=rec.reward,
        turns=tuple(turns),
    )


def _frozen(parts: list[TokenArray]) -> TokenArray:
    out = np.concatenate(parts).astype(np.int32, copy=False)
    out.flags.writeable = False
    return out


def load_trajectories(
    sources: Iterable[TraceSource], tokenizer: Tokenizer | None = None, limit: int | None = None
) -> list[Trajectory]:
    """`tokenize(load_records(sources, limit), tokenizer or load_tokenizer())`, in file
    order."""
    return tokenize(load_records(sources, limit), tokenizer or load_tokenizer())


def render(messages: Sequence[Message]) -> str:
    """The ChatML text of `messages` (what the token ids of all turns decode to, plus the
    messages after the last response)."""
    return "".join(f"{IM_START}{m.role}\n{m.content}{IM_END}\n" for m in messages)


# ---------------------------------------------------------------- orders

ORDERS = ("trial-major", "shuffled")


def trial_major(trajectories: Sequence[Trajectory]) -> list[Trajectory]:
    """Trial 0 of every task (tasks in order of first appearance), then trial 1, ...

    "Trial r" is a task's r-th trajectory by `(trial, source)`, so tasks with gaps or
    fewer trials still interleave; this mimics RL steps that each roll out every task once.
    """
    by_task: dict[str, list[Trajectory]] = {}
    for traj in trajectories:
        by_task.setdefault(traj.task_id, []).append(traj)
    for trials in by_task.values():
        trials.sort(key=lambda t: (t.trial, t.source))
    num_rounds = max((len(trials) for trials in by_task.values()), default=0)
    return [trials[r] for r in range(num_rounds) for trials in by_task.values() if r < len(trials)]


def shuffled(trajectories: Sequence[Trajectory], seed: int) -> list[Trajectory]:
    """A copy of `trajectories` in a random order fixed by `seed`."""
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise ValueError(f"seed must be an int, got {seed!r}")
    out = list(trajectories)
    random.Random(seed).shuffle(out)
    return out


def ordered(trajectories: Sequence[Trajectory], order: str, seed: int = 0) -> list[Trajectory]:
    """`trial_major(trajectories)` or `shuffled(trajectories, seed)`, by name (ORDERS)."""
    if order == "trial-major":
        return trial_major(trajectories)
    if order == "shuffled":
        return shuffled(trajectories, seed)
    raise ValueError(f"unknown order {order!r} (expected one of {', '.join(ORDERS)})")
