"""Trajectories: the token-exact record of one agentic rollout, and how they are stored.

Knows: the fields an RL trainer needs from a rollout (token ids, loss mask, sampled
logprobs, reward) and the bookkeeping around them (ids, timings, speculation counters,
weights version, replicas), how to build the three token lists consistently one segment
at a time, and two storage formats: JSON Lines written one durable, atomic append per
trajectory (so a crashed step resumes without redoing finished trajectories) and Parquet
written atomically as a whole. Does not know how tokens are produced, what the
environment or reward is, or how segments are rendered (``war.rollout.chat``).

One writer per JSONL file is assumed: the file is opened with ``O_APPEND``, each record is
one ``os.write`` of a whole line followed by ``fsync``, and on reopening a trailing line
that is partial (a crash mid-write) or does not parse is cut off.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import operator
import os
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from types import TracebackType
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

__all__ = [
    "FINISH_REASONS",
    "JsonlWriter",
    "Trajectory",
    "TrajectoryBuilder",
    "completed_ids",
    "read_jsonl",
    "read_parquet",
    "write_parquet",
]

# "done": the agent answered without calling tools; "max_turns": the turn limit was
# reached; "max_tokens": the trajectory's token budget (or the model's context) is used
# up; "length": one generation hit its max_tokens without the end-of-turn token;
# "error": the rollout failed (``error`` says why).
FINISH_REASONS = ("done", "max_turns", "max_tokens", "error", "length")

_MAX_TOKEN_ID = 2**31 - 1  # token ids are stored as int32 in Parquet
_LOGPROB_TOLERANCE = 1e-4  # a sampled token's logprob may exceed 0 by rounding only


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_float_dict(name: str, value: Any) -> None:
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a dict of str to float, got {type(value).__name__}")
    for k, v in value.items():
        if not isinstance(k, str) or not _is_number(v) or not math.isfinite(v):
            raise ValueError(f"{name}[{k!r}] must map a string to a finite number, got {v!r}")


@dataclass(kw_only=True)
class Trajectory:
    """One rollout of one task.

    ``token_ids`` is the whole sequence the policy saw and produced; ``loss_mask[i]`` is 1
    when token ``i`` was sampled by the policy and 0 for prompt, template and tool output
    tokens; ``logprobs[i]`` is the sampled token's log-probability (0.0 where the mask is
    0). ``messages`` is the conversation for humans; ``timings`` holds seconds
    (``start``, ``end``, ``total``, ``generation``, ``tool``, ...), ``spec`` speculation
    counters (draft tokens, accepted, forward passes, tokens per step, ...).
    ``weight_version`` is the version of the weights that sampled it and ``replica_ids``
    the replicas that served its turns, in turn order. ``check`` validates everything;
    nothing is validated on construction, so a trajectory can be filled in stages.
    """

    trajectory_id: str
    group_id: str
    task_id: str
    env: str
    rl_step: int
    sample_index: int
    token_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    reward: float = 0.0
    num_turns: int = 0
    finish_reason: str = "done"
    messages: list[dict[str, Any]] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    spec: dict[str, float] = field(default_factory=dict)
    weight_version: int = 0
    replica_ids: list[str] = field(default_factory=list)
    error: str | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_sampled_tokens(self) -> int:
        """Tokens sampled by the policy (the ones the loss is computed on)."""
        return sum(self.loss_mask)

    def check(self) -> Trajectory:
        """Raises ValueError when a field has the wrong type or the token lists are
        inconsistent; returns ``self``."""
        for name in ("trajectory_id", "group_id", "task_id", "env"):
            value = getattr(self, name)
            if not isinstance(value, str) or (name == "trajectory_id" and not value):
                raise ValueError(f"{name} must be a{' non-empty' * (name == 'trajectory_id')} "
                                 f"string, got {value!r}")
        tid = self.trajectory_id
        for name in ("rl_step", "sample_index", "num_turns", "weight_version"):
            value = getattr(self, name)
            if not _is_int(value) or value < 0:
                raise ValueError(f"trajectory {tid}: {name} must be an int >= 0, got {value!r}")
        for name in ("token_ids", "loss_mask", "logprobs"):
            if not isinstance(getattr(self, name), list):
                raise ValueError(f"trajectory {tid}: {name} must be a list")
        n = len(self.token_ids)
        if len(self.loss_mask) != n or len(self.logprobs) != n:
            raise ValueError(
                f"trajectory {tid}: token_ids, loss_mask and logprobs must have the same "
                f"length, got {n}, {len(self.loss_mask)}, {len(self.logprobs)}"
            )
        for i, (tok, mask, lp) in enumerate(zip(self.token_ids, self.loss_mask, self.logprobs,
                                                strict=True)):
            if not _is_int(tok) or not 0 <= tok <= _MAX_TOKEN_ID:
                raise ValueError(f"trajectory {tid}: token_ids[{i}] = {tok!r} is not a token id")
            if mask not in (0, 1) or not _is_int(mask):
                raise ValueError(f"trajectory {tid}: loss_mask[{i}] = {mask!r} is not 0 or 1")
            if not _is_number(lp):
                raise ValueError(f"trajectory {tid}: logprobs[{i}] = {lp!r} is not a number")
            if mask == 0 and lp != 0.0:
                raise ValueError(f"trajectory {tid}: logprobs[{i}] = {lp!r} but the token is "
                                 "not sampled (loss_mask 0), so it must be 0.0")
            if mask == 1 and not (math.isfinite(lp) and lp <= _LOGPROB_TOLERANCE):
                raise ValueError(f"trajectory {tid}: logprobs[{i}] = {lp!r} is not a finite "
                                 "log-probability (<= 0)")
        if not _is_number(self.reward) or not math.isfinite(self.reward):
            raise ValueError(f"trajectory {tid}: reward must be a finite number, "
                             f"got {self.reward!r}")
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(f"trajectory {tid}: finish_reason must be one of {FINISH_REASONS}, "
                             f"got {self.finish_reason!r}")
        if self.error is not None and not isinstance(self.error, str):
            raise ValueError(f"trajectory {tid}: error must be a string or None")
        if self.finish_reason == "error" and not self.error:
            raise ValueError(f"trajectory {tid}: finish_reason 'error' needs an error message")
        if not isinstance(self.messages, list) or not all(
                isinstance(m, dict) for m in self.messages):
            raise ValueError(f"trajectory {tid}: messages must be a list of dicts")
        _check_float_dict(f"trajectory {tid}: timings", self.timings)
        _check_float_dict(f"trajectory {tid}: spec", self.spec)
        if not isinstance(self.replica_ids, list) or not all(
                isinstance(r, str) for r in self.replica_ids):
            raise ValueError(f"trajectory {tid}: replica_ids must be a list of strings")
        return self

    def to_dict(self) -> dict[str, Any]:
        """A JSON-compatible dict of every field (lists and dicts are copies)."""
        return {f.name: copy.deepcopy(getattr(self, f.name)) for f in fields(self)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Trajectory:
        """The trajectory ``to_dict`` produced; validated with ``check``. Integral
        ``reward``/``logprobs``/``timings``/``spec`` values become floats."""
        if not isinstance(data, Mapping):
            raise ValueError(f"a trajectory must be a mapping, got {type(data).__name__}")
        names = {f.name for f in fields(cls)}
        unknown = set(data) - names
        if unknown:
            raise ValueError(f"unknown trajectory fields {sorted(unknown)}")
        required = {"trajectory_id", "group_id", "task_id", "env", "rl_step", "sample_index"}
        missing = required - set(data)
        if missing:
            raise ValueError(f"missing trajectory fields {sorted(missing)}")
        values = {k: copy.deepcopy(v) for k, v in data.items()}
        if _is_number(values.get("reward")):
            values["reward"] = float(values["reward"])
        if isinstance(values.get("logprobs"), list):
            values["logprobs"] = [float(x) if _is_number(x) else x for x in values["logprobs"]]
        for name in ("timings", "spec"):
            if isinstance(values.get(name), dict):
                values[name] = {k: float(v) if _is_number(v) else v
                                for k, v in values[name].items()}
        return cls(**values).check()


def _ids(ids: Iterable[int], what: str) -> list[int]:
    out = []
    for tok in ids:
        if isinstance(tok, bool):
            raise ValueError(f"{what}: token ids must be ints, got {tok!r}")
        try:
            value = operator.index(tok)
        except TypeError as exc:
            raise ValueError(f"{what}: token ids must be ints, got {tok!r}") from exc
        if not 0 <= value <= _MAX_TOKEN_ID:
            raise ValueError(f"{what}: {value} is not a token id")
        out.append(value)
    return out


class TrajectoryBuilder:
    """Accumulates a trajectory's token ids, loss mask and logprobs segment by segment.

    ``segments`` records ``(kind, start, end)`` for every non-empty append, ``kind``
    being ``"prompt"``, ``"sampled"`` or ``"observation"``.
    """

    def __init__(self) -> None:
        self._token_ids: list[int] = []
        self._loss_mask: list[int] = []
        self._logprobs: list[float] = []
        self.segments: list[tuple[str, int, int]] = []

    def __len__(self) -> int:
        return len(self._token_ids)

    @property
    def token_ids(self) -> list[int]:
        """A copy of the token ids so far."""
        return list(self._token_ids)

    @property
    def loss_mask(self) -> list[int]:
        return list(self._loss_mask)

    @property
    def logprobs(self) -> list[float]:
        return list(self._logprobs)

    @property
    def num_sampled_tokens(self) -> int:
        return sum(self._loss_mask)

    def _append(self, kind: str, ids: list[int], mask: int, logprobs: list[float]) -> None:
        if not ids:
            return
        start = len(self._token_ids)
        self._token_ids.extend(ids)
        self._loss_mask.extend([mask] * len(ids))
        self._logprobs.extend(logprobs)
        self.segments.append((kind, start, len(self._token_ids)))

    def append_prompt(self, ids: Iterable[int]) -> None:
        """Prompt or template tokens (loss mask 0, logprob 0.0)."""
        tokens = _ids(ids, "append_prompt")
        self._append("prompt", tokens, 0, [0.0] * len(tokens))

    def append_sampled(self, ids: Iterable[int], logprobs: Iterable[float]) -> None:
        """Tokens sampled by the policy with their logprobs (loss mask 1)."""
        tokens = _ids(ids, "append_sampled")
        lps: list[float] = []
        for lp in logprobs:
            if isinstance(lp, (bool, str, bytes)):
                raise ValueError(f"append_sampled: logprobs must be numbers, got {lp!r}")
            try:
                value = float(lp)
            except (TypeError, ValueError) as exc:
                raise ValueError(f"append_sampled: logprobs must be numbers, got {lp!r}") from exc
            if not (math.isfinite(value) and value <= _LOGPROB_TOLERANCE):
                raise ValueError(f"append_sampled: {value!r} is not a finite log-probability")
            lps.append(value)
        if len(lps) != len(tokens):
            raise ValueError(f"append_sampled: {len(tokens)} token ids but {len(lps)} logprobs")
        self._append("sampled", tokens, 1, lps)

    def append_observation(self, ids: Iterable[int]) -> None:
        """Tool-response, user and template tokens between turns (loss mask 0)."""
        tokens = _ids(ids, "append_observation")
        self._append("observation", tokens, 0, [0.0] * len(tokens))

    def build(self, **fields_: Any) -> Trajectory:
        """A checked ``Trajectory`` with the tokens so far and the other ``fields_``."""
        for name in ("token_ids", "loss_mask", "logprobs"):
            if name in fields_:
                raise ValueError(f"build: {name} comes from the builder")
        try:
            traj = Trajectory(token_ids=self.token_ids, loss_mask=self.loss_mask,
                              logprobs=self.logprobs, **fields_)
        except TypeError as exc:
            raise ValueError(f"build: {exc}") from exc
        return traj.check()


# ---------------------------------------------------------------- JSON Lines


def _encode_line(traj: Trajectory) -> bytes:
    traj.check()
    try:
        text = json.dumps(traj.to_dict(), ensure_ascii=False, allow_nan=False)
        # (a lone surrogate dumps as itself but is not UTF-8: UnicodeEncodeError)
        return (text + "\n").encode("utf-8")
    except (TypeError, ValueError) as exc:
        raise ValueError(f"trajectory {traj.trajectory_id} is not JSON-serializable "
                         f"(messages?): {exc}") from exc


def _decode_line(line: bytes) -> Trajectory:
    try:
        data = json.loads(line.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ValueError(f"not a JSON line: {exc}") from exc
    return Trajectory.from_dict(data)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _last_newline(fd: int, end: int) -> int:
    """The offset of the last ``\\n`` before ``end`` in the file, or -1."""
    chunk = 1 << 16
    pos = end
    while pos > 0:
        start = max(0, pos - chunk)
        data = os.pread(fd, pos - start, start)
        i = data.rfind(b"\n")
        if i >= 0:
            return start + i
        pos = start
    return -1


class JsonlWriter:
    """Appends trajectories to a JSON Lines file, one durable atomic line each.

    Opening creates the file (and fsyncs its folder) or repairs it: a trailing partial
    line, or a trailing line that is not a valid trajectory, is truncated away. Use as a
    context manager or call ``close``.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        if self.path.is_dir():
            raise ValueError(f"{self.path} is a directory")
        if not self.path.parent.is_dir():
            raise ValueError(f"folder {self.path.parent} does not exist")
        created = not self.path.exists()
        self._fd: int | None = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            if created:
                os.fsync(self._fd)
                _fsync_dir(self.path.parent)
            self.repaired_bytes = self._repair(self._fd)
        except BaseException:
            os.close(self._fd)
            self._fd = None
            raise

    @staticmethod
    def _repair(fd: int) -> int:
        """Cuts a partial or invalid last line; returns the bytes removed."""
        size = os.fstat(fd).st_size
        if size == 0:
            return 0
        if os.pread(fd, 1, size - 1) == b"\n":
            start = _last_newline(fd, size - 1) + 1
            try:
                _decode_line(os.pread(fd, size - start, start))
                return 0
            except ValueError:
                keep = start
        else:
            keep = _last_newline(fd, size) + 1
        os.ftruncate(fd, keep)
        os.fsync(fd)
        return size - keep

    def append(self, traj: Trajectory) -> None:
        """Writes ``traj`` as one line (checked first) and fsyncs it. If the write fails
        part-way the file is cut back to its previous size before the error propagates."""
        if self._fd is None:
            raise ValueError(f"JsonlWriter for {self.path} is closed")
        data = _encode_line(traj)
        fd = self._fd
        before = os.fstat(fd).st_size
        try:
            written = os.write(fd, data)
            if written != len(data):
                raise OSError(f"short write to {self.path}: {written} of {len(data)} bytes")
            os.fsync(fd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, before)
            raise

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> JsonlWriter:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


def read_jsonl(path: str | os.PathLike[str], containing: bytes | None = None
               ) -> list[Trajectory]:
    """The trajectories of a JSON Lines file, in file order. A trailing line that is
    partial or invalid (a crash mid-write) is skipped; an invalid line elsewhere raises
    ValueError. A missing file raises FileNotFoundError. With ``containing``, only the
    lines holding those bytes are read (decoding is most of the time: a run's file
    holds every step's trajectories, and a step looks for its own)."""
    data = Path(path).read_bytes()
    lines = data.split(b"\n")
    complete, tail = lines[:-1], lines[-1]  # tail: after the last newline ("" if none)
    out: list[Trajectory] = []
    for i, line in enumerate(complete):
        if containing is not None and containing not in line:
            continue
        try:
            out.append(_decode_line(line))
        except ValueError as exc:
            if i == len(complete) - 1 and not tail:
                break
            raise ValueError(f"{path}:{i + 1}: {exc}") from exc
    return out


def completed_ids(path: str | os.PathLike[str]) -> set[str]:
    """The ids of the trajectories already in a JSON Lines file (empty when the file does
    not exist yet), failed ones and every step's included; what a restarted step
    reuses of them is ``war.rollout.driver.reusable``."""
    if not Path(path).exists():
        return set()
    return {t.trajectory_id for t in read_jsonl(path)}


# ---------------------------------------------------------------- Parquet

_F64_MAP = pa.map_(pa.string(), pa.float64())
PARQUET_SCHEMA = pa.schema([
    pa.field("trajectory_id", pa.string(), nullable=False),
    pa.field("group_id", pa.string(), nullable=False),
    pa.field("task_id", pa.string(), nullable=False),
    pa.field("env", pa.string(), nullable=False),
    pa.field("rl_step", pa.int64(), nullable=False),
    pa.field("sample_index", pa.int64(), nullable=False),
    pa.field("token_ids", pa.list_(pa.int32()), nullable=False),
    pa.field("loss_mask", pa.list_(pa.int8()), nullable=False),
    pa.field("logprobs", pa.list_(pa.float64()), nullable=False),
    pa.field("reward", pa.float64(), nullable=False),
    pa.field("num_turns", pa.int64(), nullable=False),
    pa.field("finish_reason", pa.string(), nullable=False),
    pa.field("messages", pa.string(), nullable=False),  # JSON: messages are heterogeneous
    pa.field("timings", _F64_MAP, nullable=False),
    pa.field("spec", _F64_MAP, nullable=False),
    pa.field("weight_version", pa.int64(), nullable=False),
    pa.field("replica_ids", pa.list_(pa.string()), nullable=False),
    pa.field("error", pa.string(), nullable=True),
])


def write_parquet(trajectories: Sequence[Trajectory], path: str | os.PathLike[str]) -> None:
    """Writes ``trajectories`` (each checked) as one Parquet file, atomically: a
    temporary file in the same folder is written and fsynced, then renamed over
    ``path``. Token lists are list columns; ``messages`` is a JSON string column."""
    target = Path(path)
    if not target.parent.is_dir():
        raise ValueError(f"folder {target.parent} does not exist")
    rows: dict[str, list[Any]] = {name: [] for name in PARQUET_SCHEMA.names}
    for traj in trajectories:
        if not isinstance(traj, Trajectory):
            raise ValueError(f"expected Trajectory, got {type(traj).__name__}")
        d = traj.check().to_dict()
        try:
            d["messages"] = json.dumps(d["messages"], ensure_ascii=False, allow_nan=False)
            d["messages"].encode("utf-8")  # (a lone surrogate is not UTF-8)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"trajectory {traj.trajectory_id}: messages are not "
                             f"JSON-serializable: {exc}") from exc
        d["timings"] = list(d["timings"].items())
        d["spec"] = list(d["spec"].items())
        for name in PARQUET_SCHEMA.names:
            rows[name].append(d[name])
    table = pa.Table.from_pydict(rows, schema=PARQUET_SCHEMA)
    tmp = target.with_name(f".{target.name}.{uuid.uuid4().hex}.tmp")
    try:
        pq.write_table(table, tmp)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    _fsync_dir(target.parent)


def read_parquet(path: str | os.PathLike[str]) -> list[Trajectory]:
    """The trajectories ``write_parquet`` wrote, in order (each checked)."""
    table = pq.read_table(path)
    missing = set(PARQUET_SCHEMA.names) - set(table.column_names)
    if missing:
        raise ValueError(f"{path} lacks trajectory columns {sorted(missing)}")
    out = []
    for row in table.select(PARQUET_SCHEMA.names).to_pylist():
        try:
            row["messages"] = json.loads(row["messages"])
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{path}: messages of {row['trajectory_id']!r} are not JSON") from exc
        row["timings"] = dict(row["timings"])
        row["spec"] = dict(row["spec"])
        out.append(Trajectory.from_dict(row))
    return out
