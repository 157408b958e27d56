"""Chat templates: rendering conversations into model text, one appended segment at a time.

Knows: the message format the agent loop uses (``{"role", "content"}`` dicts, roles
``system``/``user``/``assistant``/``tool``), the built-in Hermes-style ChatML template
(Qwen2.5 tool format), how to render a Hugging Face Jinja chat template in a sandbox,
where a tokenizer folder keeps its template, and how the text to append after a
generated assistant turn is derived so that a trajectory's token ids are the
concatenation of separately tokenized segments. Does not know how messages are produced
(the agent loop), what the tools do, or anything about sampling; it never re-tokenizes a
whole conversation.

The alignment contract (it holds exactly for ``HermesTemplate`` and is checked for
``JinjaTemplate``)::

    render(conversation, tools, add_generation_prompt=False)
        == render_prompt(first_messages, tools)
           + generated_1 + render_continuation(..., new_messages_1, tools)
           + generated_2 + ...
           + generated_n + closing_after_end_of_turn

where ``generated_i`` is the assistant's sampled text *including* the end-of-turn token
(``<|im_end|>`` for ChatML) and the conversation's assistant message ``i`` holds that
text *without* the end-of-turn token as its ``content``. The template's closing of an
assistant turn (``<|im_end|>\\n`` for ChatML) therefore splits: the end-of-turn token is
sampled (loss mask 1), the rest (``\\n``) opens the continuation (loss mask 0). A
generation cut off before its end-of-turn token must get that token appended as a
template segment (loss mask 0) before a continuation, or end the episode.
"""

from __future__ import annotations

import abc
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, NoReturn

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

__all__ = [
    "IM_END",
    "IM_START",
    "ROLES",
    "ChatTemplate",
    "HermesTemplate",
    "JinjaTemplate",
    "Message",
    "Tool",
    "encode_segment",
    "end_of_turn_ids",
    "load_chat_template",
]

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
ROLES = ("system", "user", "assistant", "tool")

# End-of-turn markers of common template families, in the order they are looked for
# in a Jinja template's source when the caller does not name one.
_KNOWN_END_OF_TURN = (IM_END, "<|eot_id|>", "<end_of_turn>", "<|end|>")

Message = Mapping[str, Any]
Tool = Mapping[str, Any]


def _check_messages(messages: Sequence[Message], what: str) -> None:
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ValueError(f"{what} must be a sequence of message dicts, got {type(messages)}")
    for i, msg in enumerate(messages):
        if not isinstance(msg, Mapping):
            raise ValueError(f"{what}[{i}] must be a mapping, got {type(msg).__name__}")
        role = msg.get("role")
        if role not in ROLES:
            raise ValueError(f"{what}[{i}] has role {role!r}; expected one of {ROLES}")
        if not isinstance(msg.get("content"), str):
            raise ValueError(f"{what}[{i}] ({role}) must have a string 'content'")


def _check_tools(tools: Sequence[Tool] | None) -> list[dict[str, Any]]:
    if tools is None:
        return []
    if isinstance(tools, (str, bytes)) or not isinstance(tools, Sequence):
        raise ValueError(f"tools must be a sequence of JSON-schema dicts, got {type(tools)}")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, Mapping):
            raise ValueError(f"tools[{i}] must be a mapping, got {type(tool).__name__}")
        out.append(dict(tool))
    return out


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    """JSON the way Hugging Face chat templates expect it: no HTML escaping, UTF-8 kept."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                      separators=separators, sort_keys=sort_keys)


class ChatTemplate(abc.ABC):
    """Renders conversations to text; subclasses supply ``render`` and ``end_of_turn``.

    ``render_prompt`` and ``render_continuation`` are the incremental API of the agent
    loop. The generic ``render_continuation`` renders the conversation before and after
    the new messages and takes the difference, which needs an append-only template.
    """

    @property
    @abc.abstractmethod
    def end_of_turn(self) -> str:
        """The token that ends an assistant turn; generation stops after sampling it."""

    @property
    def special_tokens(self) -> tuple[str, ...]:
        """Strings of the template that must each encode as one token id."""
        return (self.end_of_turn,)

    @abc.abstractmethod
    def render(self, messages: Sequence[Message], tools: Sequence[Tool] | None = None, *,
               add_generation_prompt: bool = False) -> str:
        """The text of ``messages`` (with ``tools`` advertised), optionally followed by
        the prompt that opens the next assistant turn."""

    def render_prompt(self, messages: Sequence[Message],
                      tools: Sequence[Tool] | None = None) -> str:
        """The whole first prompt: ``messages`` and the generation prompt."""
        return self.render(messages, tools, add_generation_prompt=True)

    def render_continuation(self, messages_so_far: Sequence[Message],
                            new_messages: Sequence[Message],
                            tools: Sequence[Tool] | None = None) -> str:
        """The text to append after the last assistant turn's generated text (which
        ends with ``end_of_turn``) to add ``new_messages`` and the next generation prompt.

        ``messages_so_far`` must end with that assistant message, whose ``content`` is
        the generated text without the end-of-turn token. Raises ValueError when the
        template is not append-only (rendering more messages changes the text of the
        earlier ones, so the tokens already in the trajectory would not be a prefix of
        the new context) or does not close assistant turns with ``end_of_turn``.
        """
        self._check_continuation_args(messages_so_far, new_messages)
        before = self.render(messages_so_far, tools, add_generation_prompt=False)
        after = self.render([*messages_so_far, *new_messages], tools,
                            add_generation_prompt=True)
        if not after.startswith(before):
            at = next((i for i, (a, b) in enumerate(zip(before, after, strict=False)) if a != b),
                      min(len(before), len(after)))
            raise ValueError(
                "chat template is not append-only: rendering the conversation with the new "
                f"messages changes earlier text (first difference at character {at}: "
                f"{before[at:at + 40]!r} became {after[at:at + 40]!r}); the trajectory's "
                "tokens would no longer be a prefix of the model's context"
            )
        last = str(messages_so_far[-1]["content"]) + self.end_of_turn
        pos = before.rfind(last)
        if pos < 0:
            raise ValueError(
                "chat template does not render the last assistant message as its content "
                f"followed by the end-of-turn token {self.end_of_turn!r}; the generated text "
                "cannot be aligned with the rendered conversation"
            )
        closing = before[pos + len(last):]
        return closing + after[len(before):]

    @staticmethod
    def _check_continuation_args(messages_so_far: Sequence[Message],
                                 new_messages: Sequence[Message]) -> None:
        _check_messages(messages_so_far, "messages_so_far")
        _check_messages(new_messages, "new_messages")
        if not messages_so_far or messages_so_far[-1]["role"] != "assistant":
            raise ValueError("messages_so_far must end with the assistant message just generated")
        if not new_messages:
            raise ValueError("new_messages is empty: there is nothing to continue with")


@dataclass(frozen=True)
class HermesTemplate(ChatTemplate):
    """The built-in ChatML template with Hermes/Qwen2.5-style tool calling.

    * Turns are ``<|im_start|>{role}\\n{content}<|im_end|>\\n``.
    * With tools, the first turn is a system turn: the conversation's leading system
      message (or ``default_system``), a blank line, then a ``# Tools`` section listing
      each tool's JSON schema on its own line inside ``<tools></tools>`` and asking for
      calls as ``<tool_call>\\n{"name": <function-name>, "arguments":
      <args-json-object>}\\n</tool_call>``.
    * Without tools, a leading system message is an ordinary turn; ``default_system``
      (``None``: none) is added when the conversation has no system message first.
    * Tool messages become a user turn of ``\\n<tool_response>\\n{content}\\n</tool_response>``
      blocks; consecutive tool messages share one user turn.
    * Assistant messages render their ``content`` verbatim (tool-call blocks included);
      a structured ``tool_calls`` field is refused, as it would not match the tokens the
      model sampled.
    * The generation prompt is ``<|im_start|>assistant\\n``; ``<|im_end|>`` ends a turn.
    """

    default_system: str | None = None

    def __post_init__(self) -> None:
        if self.default_system is not None and not isinstance(self.default_system, str):
            raise ValueError(f"default_system must be a string or None, "
                             f"got {type(self.default_system).__name__}")

    @property
    def end_of_turn(self) -> str:
        return IM_END

    @property
    def special_tokens(self) -> tuple[str, ...]:
        return (IM_START, IM_END)

    def render(self, messages: Sequence[Message], tools: Sequence[Tool] | None = None, *,
               add_generation_prompt: bool = False) -> str:
        _check_messages(messages, "messages")
        tool_list = _check_tools(tools)
        parts: list[str] = []
        rest: Sequence[Message] = messages
        leading_system = bool(messages) and messages[0]["role"] == "system"
        if tool_list:
            system = str(messages[0]["content"]) if leading_system else self.default_system
            if leading_system:
                rest = messages[1:]
            parts.append(f"{IM_START}system\n{self._tools_section(system, tool_list)}{IM_END}\n")
        elif not leading_system and self.default_system is not None:
            parts.append(f"{IM_START}system\n{self.default_system}{IM_END}\n")
        parts.append(self._turns(rest))
        if add_generation_prompt:
            parts.append(f"{IM_START}assistant\n")
        return "".join(parts)

    def render_continuation(self, messages_so_far: Sequence[Message],
                            new_messages: Sequence[Message],
                            tools: Sequence[Tool] | None = None) -> str:
        """``"\\n"`` (the rest of the closing of the assistant turn), the new messages'
        turns and the generation prompt; computed directly, without re-rendering."""
        self._check_continuation_args(messages_so_far, new_messages)
        _check_tools(tools)
        return f"\n{self._turns(new_messages)}{IM_START}assistant\n"

    @staticmethod
    def _tools_section(system: str | None, tools: list[dict[str, Any]]) -> str:
        schemas = "".join(f"\n{_tojson(tool)}" for tool in tools)
        head = f"{system}\n\n" if system else ""
        return (
            f"{head}# Tools\n\nYou may call one or more functions to help with the request. "
            "The functions you can call are listed as JSON schemas within <tools></tools> "
            f"XML tags:\n<tools>{schemas}\n</tools>\n\nTo call a function, write one block "
            "per call holding a JSON object with the function's name and arguments:\n"
            '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
            "</tool_call>"
        )

    @staticmethod
    def _turns(messages: Sequence[Message]) -> str:
        parts: list[str] = []
        in_tool_turn = False
        for i, msg in enumerate(messages):
            role, content = msg["role"], str(msg["content"])
            if role == "tool":
                if not in_tool_turn:
                    parts.append(f"{IM_START}user")
                    in_tool_turn = True
                parts.append(f"\n<tool_response>\n{content}\n</tool_response>")
                continue
            if in_tool_turn:
                parts.append(f"{IM_END}\n")
                in_tool_turn = False
            if role == "assistant" and msg.get("tool_calls"):
                raise ValueError(
                    f"message {i}: assistant messages must keep their tool calls as text in "
                    "'content' (the generated text), not in a structured 'tool_calls' field"
                )
            parts.append(f"{IM_START}{role}\n{content}{IM_END}\n")
        if in_tool_turn:
            parts.append(f"{IM_END}\n")
        return "".join(parts)


def _raise_exception(message: str) -> NoReturn:
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@dataclass(frozen=True)
class JinjaTemplate(ChatTemplate):
    """A Hugging Face chat template (Jinja source), rendered in a sandbox.

    The template sees ``messages``, ``tools`` (``None`` when there are none),
    ``add_generation_prompt``, ``bos_token``, ``eos_token``, the ``tojson`` filter (no
    HTML escaping), ``raise_exception`` and ``strftime_now``, plus ``extra_context``
    (e.g. ``{"enable_thinking": False}``). The environment trims blocks like
    ``transformers`` does, so templates render the same text. ``end_of_turn`` is the
    token that closes assistant turns (``<|im_end|>`` for ChatML). Only append-only
    templates support ``render_continuation``.
    """

    source: str
    end_of_turn_token: str
    bos_token: str = ""
    eos_token: str = ""
    extra_context: Mapping[str, Any] = field(default_factory=dict)
    _compiled: jinja2.Template = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.source, str) or not self.source.strip():
            raise ValueError("chat template source must be a non-empty string")
        if not isinstance(self.end_of_turn_token, str) or not self.end_of_turn_token:
            raise ValueError("end_of_turn_token must be a non-empty string")
        for name in ("bos_token", "eos_token"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"{name} must be a string")
        if not isinstance(self.extra_context, Mapping):
            raise ValueError("extra_context must be a mapping")
        reserved = {"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"}
        clash = reserved & set(self.extra_context)
        if clash:
            raise ValueError(f"extra_context may not set {sorted(clash)}")
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            compiled = env.from_string(self.source)
        except jinja2.exceptions.TemplateSyntaxError as exc:
            raise ValueError(f"chat template does not compile: {exc}") from exc
        object.__setattr__(self, "_compiled", compiled)

    @property
    def end_of_turn(self) -> str:
        return self.end_of_turn_token

    def render(self, messages: Sequence[Message], tools: Sequence[Tool] | None = None, *,
               add_generation_prompt: bool = False) -> str:
        _check_messages(messages, "messages")
        tool_list = _check_tools(tools)
        try:
            return self._compiled.render(
                **self.extra_context,
                messages=[dict(m) for m in messages],
                tools=tool_list or None,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        except jinja2.exceptions.TemplateError as exc:
            raise ValueError(f"chat template failed to render: {exc}") from exc


def _token_content(value: Any) -> str:
    """A special token as ``tokenizer_config.json`` stores it: a string or an
    AddedToken dict with ``content``; ``""`` when absent."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return str(value["content"])
    return ""


def load_chat_template(tokenizer_folder: str | os.PathLike[str], *,
                       end_of_turn: str | None = None,
                       template_name: str = "default") -> ChatTemplate:
    """The chat template of a Hugging Face tokenizer folder.

    Looks for ``chat_template.jinja``, then ``chat_template`` in ``tokenizer_config.json``
    (a string, or a list of ``{"name", "template"}`` from which ``template_name`` is
    taken). Without either it returns ``HermesTemplate()``. The end-of-turn token is
    ``end_of_turn`` when given, else the first of ``<|im_end|>``, ``<|eot_id|>``,
    ``<end_of_turn>``, ``<|end|>`` that the template mentions, else the folder's
    ``eos_token``.
    """
    folder = Path(tokenizer_folder)
    if not folder.is_dir():
        raise ValueError(f"tokenizer folder {folder} does not exist or is not a directory")
    config: dict[str, Any] = {}
    config_path = folder / "tokenizer_config.json"
    if config_path.is_file():
        try:
            loaded = json.loads(config_path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"{config_path} is not valid JSON: {exc}") from exc
        if not isinstance(loaded, dict):
            raise ValueError(f"{config_path} does not hold a JSON object")
        config = loaded
    source: str | None = None
    jinja_path = folder / "chat_template.jinja"
    if jinja_path.is_file():
        source = jinja_path.read_text(encoding="utf-8")
    else:
        raw = config.get("chat_template")
        if isinstance(raw, str):
            source = raw
        elif isinstance(raw, list):
            named = {t.get("name"): t.get("template") for t in raw if isinstance(t, dict)}
            chosen = named.get(template_name)
            if not isinstance(chosen, str):
                raise ValueError(f"{config_path} has no chat template named {template_name!r} "
                                 f"(it has {sorted(str(n) for n in named)})")
            source = chosen
        elif raw is not None:
            raise ValueError(f"{config_path}: chat_template must be a string or a list")
    if source is None:
        return HermesTemplate()
    bos, eos = _token_content(config.get("bos_token")), _token_content(config.get("eos_token"))
    if end_of_turn is None:
        end_of_turn = next((t for t in _KNOWN_END_OF_TURN if t in source), eos or None)
    if not end_of_turn:
        raise ValueError(f"cannot tell the end-of-turn token of the template in {folder}; "
                         "pass end_of_turn")
    return JinjaTemplate(source, end_of_turn, bos_token=bos, eos_token=eos)


def encode_segment(tokenizer: Tokenizer, text: str) -> list[int]:
    """The token ids of one segment of a trajectory, with no BOS/EOS added; special
    tokens registered with the tokenizer (``<|im_start|>``, ``<|im_end|>``) are matched
    in ``text`` and become their single ids."""
    if not isinstance(text, str):
        raise ValueError(f"text must be a string, got {type(text).__name__}")
    if not text:
        return []
    return list(tokenizer.encode(text, add_special_tokens=False).ids)


def end_of_turn_ids(tokenizer: Tokenizer, template: ChatTemplate) -> tuple[int, ...]:
    """The stop token ids for generation with ``template`` (its end-of-turn token).

    Also checks that every special token of the template encodes as one id; raises
    ValueError otherwise (register them with ``tokenizer.add_special_tokens``), since a
    split special token would silently corrupt every segment.
    """
    ids: dict[str, int] = {}
    for tok in template.special_tokens:
        tid = tokenizer.token_to_id(tok)
        if tid is None or encode_segment(tokenizer, tok) != [tid]:
            raise ValueError(f"special token {tok!r} of the chat template is not a single "
                             "token of the tokenizer; add it with add_special_tokens")
        ids[tok] = tid
    eot = template.end_of_turn
    if eot not in ids:
        tid = tokenizer.token_to_id(eot)
        if tid is None or encode_segment(tokenizer, eot) != [tid]:
            raise ValueError(f"end-of-turn token {eot!r} is not a single token of the tokenizer")
        ids[eot] = tid
    return (ids[eot],)
