"""Trace loading, validation, ChatML rendering into turns, and replay orders."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from tokenizers import Tokenizer

from war import data
from war.spec import traces
from war.spec.traces import (
    ChatFormat,
    Message,
    load_records,
    load_tokenizer,
    load_trajectories,
    render,
    shuffled,
    tokenize,
    trial_major,
)

SAMPLE = data.resource(data.SAMPLE_TRACES)


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return load_tokenizer()


def record(**overrides: Any) -> dict[str, Any]:
    rec: dict[str, Any] = {
        "task_id": "t/1",
        "trial": 0,
        "source": "test",
        "model": "m",
        "reward": 1.0,
        "meta": {},
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi there"},
            {"role": "assistant", "content": "Hello!"},
            {"role": "tool", "content": "ok"},
            {"role": "assistant", "content": ""},
            {"role": "user", "content": "bye"},
        ],
    }
    rec.update(overrides)
    return rec


def write_jsonl(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_bundled_sample_loads(tok: Tokenizer) -> None:
    records = load_records([SAMPLE])
    assert len(records) == 24
    assert [r.task_id for r in records[::4]] == [f"airline/{i}" for i in range(6)]
    assert all(Path(r.file).name == "sample_traces.jsonl.gz" for r in records)
    trajs = tokenize(records, tok)
    for rec, traj in zip(records, trajs, strict=True):
        assert (traj.task_id, traj.trial, traj.source) == (rec.task_id, rec.trial, rec.source)
        assert len(traj.turns) == sum(m.role == "assistant" for m in rec.messages)
        assert traj.file == "sample_traces.jsonl.gz"


def test_turns_render_chatml(tok: Tokenizer) -> None:
    [rec] = traces.parse_records(json.dumps(record()), "mem")
    [traj] = tokenize([rec], tok)
    fmt = ChatFormat.of(tok)
    assert len(traj.turns) == 2
    # all turns together decode to the rendering, up to the last response's <|im_end|>
    ids = np.concatenate([np.concatenate([t.prompt_delta, t.response]) for t in traj.turns])
    text = tok.decode(ids.tolist(), skip_special_tokens=False)
    assert text == render(rec.messages[:5])[: -len("\n")]
    first, second = traj.turns
    assert tok.decode(first.prompt_delta.tolist(), skip_special_tokens=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert tok.decode(second.prompt_delta.tolist(), skip_special_tokens=False) == (
        "\n<|im_start|>tool\nok<|im_end|>\n<|im_start|>assistant\n"
    )
    # responses: the content's own tokens (no merge across the boundary) + <|im_end|>
    assert first.response.tolist() == [*tok.encode("Hello!").ids, fmt.im_end]
    assert second.response.tolist() == [fmt.im_end]  # empty content
    assert first.prompt_delta.dtype == np.int32 and not first.response.flags.writeable
    assert traj.num_response_tokens == len(first.response) + 1
    assert traj.num_prompt_tokens == len(first.prompt_delta) + len(second.prompt_delta)


def test_segments_are_tokenized_apart(tok: Tokenizer) -> None:
    msgs = [{"role": "user", "content": "\nx"}, {"role": "assistant", "content": "\n\n"}]
    [rec] = traces.parse_records(json.dumps(record(messages=msgs)), "mem")
    [traj] = tokenize([rec], tok)
    fmt = ChatFormat.of(tok)

    def enc(text: str) -> list[int]:
        return list(tok.encode(text, add_special_tokens=False).ids)

    [turn] = traj.turns
    assert turn.prompt_delta.tolist() == [
        *[fmt.im_start, *enc("user\n"), *enc("\nx"), fmt.im_end, *enc("\n")],
        *[fmt.im_start, *enc("assistant\n")],
    ]
    assert turn.response.tolist() == [*enc("\n\n"), fmt.im_end]
    assert enc("\n\n") == [628]  # one token: the response does not start with "\n" alone


def test_no_assistant_means_no_turns(tok: Tokenizer) -> None:
    msgs = [{"role": "user", "content": "hi"}]
    [rec] = traces.parse_records(json.dumps(record(messages=msgs)), "mem")
    assert tokenize([rec], tok)[0].turns == ()
    msgs = [{"role": "assistant", "content": "hi"}]
    [rec] = traces.parse_records(json.dumps(record(messages=msgs)), "mem")
    [turn] = tokenize([rec], tok)[0].turns
    assert tok.decode(turn.prompt_delta.tolist(), skip_special_tokens=False) == (
        "<|im_start|>assistant\n"
    )


BAD = [
    ("{not json", "invalid JSON"),
    ("[1, 2]", "must be a JSON object"),
    (json.dumps({k: v for k, v in record().items() if k != "trial"}), "lacks key.*trial"),
    (json.dumps(record(task_id="")), "'task_id' must be a non-empty string"),
    (json.dumps(record(trial="0")), "'trial' must be an integer"),
    (json.dumps(record(trial=True)), "'trial' must be an integer"),
    (json.dumps(record(trial=-1)), "'trial' must be an integer"),
    (json.dumps(record(source=3)), "'source' must be a string"),
    (json.dumps(record(model=3)), "'model' must be a string"),
    (json.dumps(record(reward="1")), "'reward' must be a number"),
    (json.dumps(record(reward=float("nan"))), "'reward' must be finite"),
    (json.dumps(record(reward=float("inf"))), "'reward' must be finite"),
    (json.dumps(record(reward=10**400)), "'reward' must be finite"),
    ('{"trial": ' + "1" * 5000 + "}", "invalid JSON"),  # beyond int() digits
    ("[" * 100_000, "invalid JSON"),  # nesting beyond the recursion limit
    (json.dumps(record(messages={})), "'messages' must be a list"),
    (json.dumps(record(messages=["hi"])), r"messages\[0\]: a message must be an object"),
    (json.dumps(record(messages=[{"role": "user"}])), r"messages\[0\].*lacks key.*content"),
    (
        json.dumps(record(messages=[{"role": "bot", "content": ""}])),
        r"messages\[0\]: unknown role 'bot'",
    ),
    (
        json.dumps(record(messages=[{"role": "user", "content": None}])),
        "'content' must be a string",
    ),
]


@pytest.mark.parametrize(("line", "message"), BAD)
def test_malformed_records_name_file_and_line(tmp_path: Path, line: str, message: str) -> None:
    path = write_jsonl(tmp_path / "bad.jsonl", [json.dumps(record()), "", line])
    with pytest.raises(ValueError, match=message) as err:
        load_records([path])
    assert f"{path}:3: " in str(err.value)


def test_duplicates_missing_files_and_gzip(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "a.jsonl", [json.dumps(record())])
    dup = r"a\.jsonl:1: duplicate trajectory .* first at .*a\.jsonl:1"
    with pytest.raises(ValueError, match=dup):
        load_records([path, path])
    with pytest.raises(FileNotFoundError, match=r"missing\.jsonl"):
        load_records([tmp_path / "missing.jsonl"])
    gz = tmp_path / "b.jsonl.gz"
    gz.write_bytes(gzip.compress(path.read_bytes()))
    [rec] = load_records([gz])
    assert rec.file == str(gz) and rec.line == 1
    (tmp_path / "c.jsonl.gz").write_bytes(b"not gzip")
    with pytest.raises(ValueError, match="not a valid gzip file"):
        load_records([tmp_path / "c.jsonl.gz"])
    (tmp_path / "d.jsonl").write_bytes(b"\xff\xfe")
    with pytest.raises(ValueError, match="not UTF-8"):
        load_records([tmp_path / "d.jsonl"])


def test_load_tokenizer_from_paths(tmp_path: Path) -> None:
    plain = tmp_path / "tokenizer.json"
    plain.write_text(data.gpt2_tokenizer_json(), encoding="utf-8")
    gz = tmp_path / "tokenizer.json.gz"
    gz.write_bytes(gzip.compress(plain.read_bytes()))
    for path in (plain, gz):
        fmt = ChatFormat.of(load_tokenizer(path))
        assert (fmt.im_start, fmt.im_end, fmt.newline) == (50257, 50258, (198,))
    with pytest.raises(FileNotFoundError, match=r"nope\.json"):
        load_tokenizer(tmp_path / "nope.json")
    with pytest.raises(ValueError, match="special tokens"):
        ChatFormat.of(Tokenizer.from_file(str(plain)))


def test_orders(tmp_path: Path, tok: Tokenizer) -> None:
    lines = [
        json.dumps(record(task_id=task, trial=trial))
        for task, trial in [("b", 1), ("a", 0), ("b", 0), ("c", 2), ("a", 1), ("b", 2)]
    ]
    trajs = load_trajectories([write_jsonl(tmp_path / "o.jsonl", lines)], tok)
    order = [(t.task_id, t.trial) for t in trial_major(trajs)]
    # tasks by first appearance (b, a, c); round r = each task's r-th trial
    assert order == [("b", 0), ("a", 0), ("c", 2), ("b", 1), ("a", 1), ("b", 2)]
    mixed = shuffled(trajs, seed=3)
    assert sorted(id(t) for t in mixed) == sorted(id(t) for t in trajs)
    assert [id(t) for t in shuffled(trajs, seed=3)] == [id(t) for t in mixed]
    assert trial_major([]) == []


def test_render() -> None:
    assert render([Message("user", "a"), Message("assistant", "b")]) == (
        "<|im_start|>user\na<|im_end|>\n<|im_start|>assistant\nb<|im_end|>\n"
    )


def test_records_split_only_at_newlines(tmp_path: Path) -> None:
    # json.dumps leaves U+2028 and U+0085 unescaped; CRLF endings are fine too.
    content = "a\u2028b\x85c\x1ed"
    line = json.dumps(record(messages=[{"role": "user", "content": content}]), ensure_ascii=False)
    path = tmp_path / "u.jsonl"
    path.write_bytes((line + "\r\n" + json.dumps(record(trial=1)) + "\r\n").encode("utf-8"))
    recs = load_records([path])
    assert [r.line for r in recs] == [1, 2]
    assert recs[0].messages[0].content == content


def test_a_byte_order_mark_is_not_part_of_the_first_record(tmp_path: Path) -> None:
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + (json.dumps(record()) + "\n").encode())
    assert [r.line for r in load_records([path])] == [1]
    gz = tmp_path / "bom.jsonl.gz"
    gz.write_bytes(gzip.compress(path.read_bytes()))
    assert len(load_records([gz])) == 1


def test_corrupt_gzip_and_bad_arguments_are_value_errors(tmp_path: Path) -> None:
    data = gzip.compress((json.dumps(record()) + "\n").encode())
    bad = tmp_path / "x.jsonl.gz"
    bad.write_bytes(data[:10] + b"\xff" * 20 + data[30:])  # a broken deflate stream
    with pytest.raises(ValueError, match="not a valid gzip file"):
        load_records([bad])
    path = write_jsonl(tmp_path / "a.jsonl", [json.dumps(record())])
    for limit in (0.5, "1", True):
        with pytest.raises(ValueError, match="limit"):
            load_records([path], limit=limit)  # type: ignore[arg-type]
    for single in (str(path), path):
        with pytest.raises(ValueError, match="single path"):
            load_records(single)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="seed"):
        shuffled([], [1])  # type: ignore[arg-type]


def test_shared_inputs_are_found_above_a_folder(tmp_path: Path) -> None:
    from war.spec.traces import find_shared_data, shared_inputs

    deep = tmp_path / "repo" / "benchmarks" / "spec"
    deep.mkdir(parents=True)
    assert find_shared_data(deep) is None and shared_inputs(deep) == ([], None)
    data = tmp_path / "shared" / "data"
    (data / "traces").mkdir(parents=True)
    for name in ("b.jsonl", "a.jsonl", "notes.txt"):
        (data / "traces" / name).write_text("")
    assert find_shared_data(deep) == data
    assert shared_inputs(deep) == ([data / "traces" / "a.jsonl", data / "traces" / "b.jsonl"],
                                   None)
    tokenizer = data / "tokenizer" / "gpt2" / "tokenizer.json"
    tokenizer.parent.mkdir(parents=True)
    tokenizer.write_text("{}")
    assert shared_inputs(deep)[1] == tokenizer
