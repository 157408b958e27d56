"""Tool calls in model output: ``<tool_call>{json}</tool_call>`` blocks (Hermes/Qwen format).

Knows: how to find the blocks in an assistant's generated text, which JSON they must hold
(``{"name": str, "arguments": object}``; arguments given as a JSON string of an object
are accepted, as some models write them so), what counts as malformed, and the shape of a
tool-response message. Does not know which tools exist, how they run, or how a template
renders the response; parsing never raises on model output, it reports errors instead.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "TOOL_CALL_CLOSE",
    "TOOL_CALL_OPEN",
    "ParsedToolCalls",
    "ToolCall",
    "format_tool_response",
    "parse_tool_calls",
]

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"


@dataclass(frozen=True)
class ToolCall:
    """One well-formed call: the function's ``name`` and its ``arguments`` object."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"tool call name must be a non-empty string, got {self.name!r}")
        if not isinstance(self.arguments, dict):
            raise ValueError(f"tool call arguments must be a dict, "
                             f"got {type(self.arguments).__name__}")


@dataclass(frozen=True)
class ParsedToolCalls:
    """What ``parse_tool_calls`` found.

    * ``calls``: the well-formed calls, in order.
    * ``errors``: one message per malformed block (``"tool call 2: ..."``, numbered from 1
      over all blocks, well-formed or not).
    * ``content``: the text outside the blocks, whitespace-stripped (the final answer when
      there are no blocks). An unclosed block reaches to the end of the text.
    """

    calls: list[ToolCall]
    errors: list[str]
    content: str

    @property
    def has_calls(self) -> bool:
        """True when there is at least one well-formed call."""
        return bool(self.calls)


def _parse_block(body: str) -> ToolCall | str:
    """The call in one block's body, or an error message."""
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError) as exc:
        return f"invalid JSON ({exc})"
    if not isinstance(obj, dict):
        return f"expected a JSON object, got {type(obj).__name__}"
    name = obj.get("name")
    if name is None:
        return "missing 'name'"
    if not isinstance(name, str) or not name.strip():
        return f"'name' must be a non-empty string, got {json.dumps(name)[:80]}"
    args = obj.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except (ValueError, RecursionError):
            return "'arguments' is a string that is not a JSON object"
        if not isinstance(args, dict):
            return "'arguments' is a string that is not a JSON object"
    if not isinstance(args, dict):
        return f"'arguments' must be a JSON object, got {type(args).__name__}"
    try:  # a \u escape of a lone surrogate parses but is not text: nothing can store it
        json.dumps([name, args], ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return "invalid JSON (a \\u escape is a lone surrogate, not a character)"
    except RecursionError:
        return "invalid JSON (nested too deeply)"
    return ToolCall(name.strip(), args)


def parse_tool_calls(text: str) -> ParsedToolCalls:
    """The tool-call blocks of an assistant's generated text (without the end-of-turn
    token). A missing ``arguments`` key means ``{}``; the name is whitespace-stripped.
    A ``<tool_call>`` followed by another ``<tool_call>`` before its ``</tool_call>`` is
    reported unclosed and parsing resumes at the second one. Raises ValueError only when
    ``text`` is not a string."""
    if not isinstance(text, str):
        raise ValueError(f"text must be a string, got {type(text).__name__}")
    calls: list[ToolCall] = []
    errors: list[str] = []
    outside: list[str] = []
    pos, index = 0, 0
    while True:
        start = text.find(TOOL_CALL_OPEN, pos)
        if start < 0:
            outside.append(text[pos:])
            break
        outside.append(text[pos:start])
        index += 1
        body_start = start + len(TOOL_CALL_OPEN)
        end = text.find(TOOL_CALL_CLOSE, body_start)
        reopen = text.find(TOOL_CALL_OPEN, body_start)
        if end < 0 or 0 <= reopen < end:
            errors.append(f"tool call {index}: unclosed {TOOL_CALL_OPEN}")
            if reopen < 0:
                break
            pos = reopen
            continue
        parsed = _parse_block(text[body_start:end].strip())
        if isinstance(parsed, ToolCall):
            calls.append(parsed)
        else:
            errors.append(f"tool call {index}: {parsed}")
        pos = end + len(TOOL_CALL_CLOSE)
    return ParsedToolCalls(calls, errors, "".join(outside).strip())


def format_tool_response(name: str, output: Any) -> dict[str, Any]:
    """A ``tool`` message carrying ``output`` of the tool ``name``.

    A string output is used as is; anything else is written as JSON (UTF-8 kept).
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"tool name must be a non-empty string, got {name!r}")
    if isinstance(output, str):
        content = output
    else:
        try:
            content = json.dumps(output, ensure_ascii=False, allow_nan=False)
        except (TypeError, ValueError, RecursionError) as exc:
            raise ValueError(f"tool output of {name!r} is neither a string nor JSON: "
                             f"{exc}") from exc
    return {"role": "tool", "name": name, "content": content}
