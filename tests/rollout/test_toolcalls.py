"""Parsing ``<tool_call>`` blocks out of model output; it never raises on model text."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from war.rollout.toolcalls import (
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    ToolCall,
    format_tool_response,
    parse_tool_calls,
)


def block(body: str) -> str:
    return f"{TOOL_CALL_OPEN}\n{body}\n{TOOL_CALL_CLOSE}"


def test_plain_answer() -> None:
    parsed = parse_tool_calls("  The answer is 42.\n")
    assert parsed.calls == [] and parsed.errors == [] and not parsed.has_calls
    assert parsed.content == "The answer is 42."


def test_calls_and_surrounding_text() -> None:
    text = ("Let me check. " + block('{"name": "search", "arguments": {"q": "ünï ✓", "n": 3}}')
            + "\n" + block('{"name": "get", "arguments": {}}') + " done")
    parsed = parse_tool_calls(text)
    assert parsed.calls == [ToolCall("search", {"q": "ünï ✓", "n": 3}), ToolCall("get", {})]
    assert parsed.errors == []
    assert parsed.content == "Let me check. \n done"


def test_argument_forms() -> None:
    as_string = parse_tool_calls(block(json.dumps({"name": "f", "arguments": '{"x": [1, 2]}'})))
    assert as_string.calls == [ToolCall("f", {"x": [1, 2]})] and as_string.errors == []
    missing = parse_tool_calls(f'{TOOL_CALL_OPEN}{{"name": " f "}}{TOOL_CALL_CLOSE}')
    assert missing.calls == [ToolCall("f", {})]


@pytest.mark.parametrize(("body", "message"), [
    ('{"name": "f", "arguments": {', "invalid JSON"),
    ("[1, 2]", "expected a JSON object"),
    ('{"arguments": {}}', "missing 'name'"),
    ('{"name": 3, "arguments": {}}', "'name' must be a non-empty string"),
    ('{"name": "  ", "arguments": {}}', "'name' must be a non-empty string"),
    ('{"name": "f", "arguments": [1]}', "'arguments' must be a JSON object"),
    ('{"name": "f", "arguments": "[1]"}', "string that is not a JSON object"),
    ('{"name": "f", "arguments": "nope"}', "string that is not a JSON object"),
    ("", "invalid JSON"),
    ("[" * 100_000, "invalid JSON"),
])
def test_malformed_blocks(body: str, message: str) -> None:
    text = block(body) + block('{"name": "ok", "arguments": {"a": 1}}')
    parsed = parse_tool_calls(text)
    assert parsed.calls == [ToolCall("ok", {"a": 1})]
    assert len(parsed.errors) == 1
    assert parsed.errors[0].startswith("tool call 1: ") and message in parsed.errors[0]


def test_unclosed_blocks() -> None:
    parsed = parse_tool_calls('Sure. <tool_call>\n{"name": "f", "arguments": {}}')
    assert parsed.calls == [] and parsed.errors == ["tool call 1: unclosed <tool_call>"]
    assert parsed.content == "Sure."
    reopened = parse_tool_calls("<tool_call>{" + block('{"name": "g", "arguments": {}}'))
    assert reopened.calls == [ToolCall("g", {})]
    assert reopened.errors == ["tool call 1: unclosed <tool_call>"]
    stray = parse_tool_calls("a </tool_call> b")
    assert stray.calls == [] and stray.errors == [] and stray.content == "a </tool_call> b"


def test_tool_call_and_response_validation() -> None:
    with pytest.raises(ValueError):
        ToolCall("", {})
    with pytest.raises(ValueError):
        ToolCall("f", [])  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        parse_tool_calls(None)  # type: ignore[arg-type]
    assert format_tool_response("f", "out") == {"role": "tool", "name": "f", "content": "out"}
    assert format_tool_response("f", {"ü": [1, None]})["content"] == '{"ü": [1, null]}'
    with pytest.raises(ValueError, match="tool name"):
        format_tool_response("", "x")
    with pytest.raises(ValueError, match="neither a string nor JSON"):
        format_tool_response("f", object())
    with pytest.raises(ValueError, match="neither a string nor JSON"):
        format_tool_response("f", float("nan"))


PIECES = st.sampled_from([TOOL_CALL_OPEN, TOOL_CALL_CLOSE, "{", "}", '"name"', ":", '"f"', ",",
                          '"arguments"', "[", "]", '"{}"', "\n", " ", "null", "<tool_", "call>"])


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.text(), st.lists(st.one_of(PIECES, st.text(max_size=5))).map("".join)))
def test_never_raises_on_model_output(text: str) -> None:
    parsed = parse_tool_calls(text)
    assert len(parsed.calls) + len(parsed.errors) == text.count(TOOL_CALL_OPEN)
    assert all(isinstance(c.arguments, dict) and c.name for c in parsed.calls)
    assert parsed.content == parsed.content.strip()


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(), inner, max_size=3),
    max_leaves=8,
)


@settings(max_examples=100, deadline=None)
@given(st.text(min_size=1).filter(lambda s: s.strip() == s and bool(s)),
       st.dictionaries(st.text(), JSON_VALUES, max_size=4), st.booleans())
def test_written_calls_parse_back(name: str, args: dict[str, Any], as_string: bool) -> None:
    payload = json.dumps({"name": name, "arguments": json.dumps(args) if as_string else args},
                         ensure_ascii=False)
    parsed = parse_tool_calls("thinking... " + block(payload))
    if TOOL_CALL_OPEN in payload or TOOL_CALL_CLOSE in payload:
        return  # a payload holding the tags themselves is ambiguous by design
    assert parsed.calls == [ToolCall(name, args)] and parsed.errors == []
    assert parsed.content == "thinking..."


@pytest.mark.parametrize("body", [
    r'{"name": "\udc80", "arguments": {}}',
    r'{"name": "calc", "arguments": {"\ud800": 1}}',
    r'{"name": "calc", "arguments": {"x": ["ok", "\udfff"]}}',
    json.dumps({"name": "calc", "arguments": r'{"x": "\udc80"}'}),
])
def test_lone_surrogate_escapes_are_errors(body: str) -> None:
    # They parse as JSON but are not text: a call holding one could not be written to a
    # trajectory file (UTF-8), so it is malformed model output, not a call.
    parsed = parse_tool_calls(block(body) + block('{"name": "ok", "arguments": {"s": "\\u00e9"}}'))
    assert parsed.calls == [ToolCall("ok", {"s": "é"})]
    assert len(parsed.errors) == 1 and "surrogate" in parsed.errors[0]
    assert parsed.errors[0].startswith("tool call 1:")
