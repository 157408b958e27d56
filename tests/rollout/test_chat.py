"""Chat templates: Hermes rendering, incremental continuations and token-exact segments."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer

from war.data import gpt2_tokenizer_json
from war.rollout.chat import (
    IM_END,
    IM_START,
    ChatTemplate,
    HermesTemplate,
    JinjaTemplate,
    encode_segment,
    end_of_turn_ids,
    load_chat_template,
)

TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {
        "name": "search_flights", "description": "Find flights <b>between</b> 'two' cities & days",
        "parameters": {"type": "object", "properties": {
            "origin": {"type": "string"}, "destination": {"type": "string"}},
            "required": ["origin", "destination"]}}},
    {"type": "function", "function": {
        "name": "book", "description": "Book a flight — ünïcödé ✓",
        "parameters": {"type": "object", "properties": {"flight": {"type": "string"}}}}},
]

FIRST = [
    {"role": "system", "content": "You are a travel agent."},
    {"role": "user", "content": "Fly me from SFO to JFK tomorrow 🚀"},
]
# (generated assistant content without <|im_end|>, the messages that follow it)
TURNS: list[tuple[str, list[dict[str, Any]]]] = [
    ('Let me look.\n<tool_call>\n{"name": "search_flights", "arguments": {"origin": "SFO", '
     '"destination": "JFK"}}\n</tool_call>\n<tool_call>\n{"name": "search_flights", '
     '"arguments": {"origin": "OAK", "destination": "JFK"}}\n</tool_call>',
     [{"role": "tool", "name": "search_flights", "content": '[{"flight": "UA1"}]'},
      {"role": "tool", "name": "search_flights", "content": "[]"}]),
    ('<tool_call>\n{"name": "book", "arguments": {"flight": "UA1"}}\n</tool_call>',
     [{"role": "tool", "name": "book", "content": "error: card declined"},
      {"role": "user", "content": "Use my other card."}]),
    ("Booked UA1 — have a nice trip!", []),
]

# A ChatML template with Hermes tool calling, written as a Hugging Face Jinja template.
CHATML_TOOLS_JINJA = r"""
{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages and messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- '# Tools\n\nYou may call one or more functions to help with the request. ' }}
    {{- 'The functions you can call are listed as JSON schemas within <tools></tools> ' }}
    {{- 'XML tags:\n<tools>' }}
    {%- for tool in tools %}
        {{- '\n' + (tool | tojson) }}
    {%- endfor %}
    {{- '\n</tools>\n\nTo call a function, write one block per call holding a JSON object ' }}
    {{- 'with the function\'s name and arguments:\n<tool_call>\n' }}
    {{- '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'system' and loop.first and tools %}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' + message.content + '\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- else %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    tok = Tokenizer.from_str(gpt2_tokenizer_json())
    tok.add_special_tokens([IM_START, IM_END])
    return tok


def episode(template: ChatTemplate) -> tuple[list[tuple[str, str]], list[dict[str, Any]]]:
    """The segments of the episode as (kind, text) and the whole conversation."""
    segments = [("prompt", template.render_prompt(FIRST, TOOLS))]
    conversation: list[dict[str, Any]] = list(FIRST)
    for content, new in TURNS:
        segments.append(("sampled", content + template.end_of_turn))
        conversation.append({"role": "assistant", "content": content})
        if new:
            segments.append(("observation", template.render_continuation(conversation, new,
                                                                        TOOLS)))
            conversation.extend(new)
    return segments, conversation


@pytest.mark.parametrize("template", [HermesTemplate(), JinjaTemplate(CHATML_TOOLS_JINJA, IM_END)])
def test_segments_concatenate_to_the_full_render(template: ChatTemplate) -> None:
    segments, conversation = episode(template)
    text = "".join(t for _, t in segments)
    # The template closes the last assistant turn with "<|im_end|>\n"; the "\n" is not sampled.
    assert text + "\n" == template.render(conversation, TOOLS)
    # Every generation prompt is the render of the conversation up to that point.
    turn, num_messages = 0, len(FIRST)
    for i, (kind, _) in enumerate(segments):
        if kind == "sampled":
            prefix = "".join(t for _, t in segments[:i])
            assert prefix == template.render_prompt(conversation[:num_messages], TOOLS)
            num_messages += 1 + len(TURNS[turn][1])
            turn += 1
    assert turn == len(TURNS) == 3
    # The continuations open with the rest of the closing of the assistant turn.
    assert all(t.startswith("\n" + IM_START) for k, t in segments if k == "observation")
    assert all(t.endswith(IM_START + "assistant\n") for k, t in segments if k == "observation")


def test_hermes_text_is_exact() -> None:
    t = HermesTemplate()
    segments, conversation = episode(t)
    prompt = segments[0][1]
    assert prompt.startswith(
        "<|im_start|>system\nYou are a travel agent.\n\n# Tools\n\nYou may call one or more")
    assert "\n<tools>\n" + json.dumps(TOOLS[0], ensure_ascii=False) + "\n" in prompt
    assert "<b>between</b> 'two' cities & days" in prompt  # no HTML escaping
    assert ('<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
            "</tool_call><|im_end|>\n<|im_start|>user\nFly me") in prompt
    assert prompt.endswith("🚀<|im_end|>\n<|im_start|>assistant\n")
    assert segments[2][1] == (
        '\n<|im_start|>user\n<tool_response>\n[{"flight": "UA1"}]\n</tool_response>\n'
        "<tool_response>\n[]\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    assert segments[4][1] == (
        "\n<|im_start|>user\n<tool_response>\nerror: card declined\n</tool_response>"
        "<|im_end|>\n<|im_start|>user\nUse my other card.<|im_end|>\n<|im_start|>assistant\n")
    # The direct continuation equals the generic one (render both, take the suffix).
    for i in (1, 2):
        so_far = conversation[:2 + sum(1 + len(n) for _, n in TURNS[:i - 1]) + 1]
        new = TURNS[i - 1][1]
        assert t.render_continuation(so_far, new, TOOLS) == \
            ChatTemplate.render_continuation(t, so_far, new, TOOLS)


def test_hermes_system_handling() -> None:
    user = [{"role": "user", "content": "hi"}]
    assert HermesTemplate().render_prompt(user) == "<|im_start|>user\nhi<|im_end|>\n" \
        "<|im_start|>assistant\n"
    assert HermesTemplate("Be brief.").render(user).startswith(
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user")
    assert HermesTemplate().render(user, TOOLS).startswith("<|im_start|>system\n# Tools\n\n")
    assert HermesTemplate("Be brief.").render(user, TOOLS).startswith(
        "<|im_start|>system\nBe brief.\n\n# Tools\n\n")
    assert HermesTemplate().render(user, []) == HermesTemplate().render(user)


def test_token_segments_decode_to_the_full_text(tokenizer: Tokenizer) -> None:
    t = HermesTemplate()
    segments, conversation = episode(t)
    (eot,) = end_of_turn_ids(tokenizer, t)
    assert eot == tokenizer.token_to_id(IM_END)
    ids: list[int] = []
    for kind, text in segments:
        seg = encode_segment(tokenizer, text)
        if kind == "sampled":
            assert seg[-1] == eot and seg.count(eot) == 1
        else:
            assert tokenizer.token_to_id(IM_START) in seg
        ids.extend(seg)
    full = t.render(conversation, TOOLS)
    assert tokenizer.decode(ids, skip_special_tokens=False) + "\n" == full
    assert encode_segment(tokenizer, "") == []


def test_end_of_turn_ids_needs_single_special_tokens() -> None:
    plain = Tokenizer.from_str(gpt2_tokenizer_json())
    with pytest.raises(ValueError, match="add_special_tokens"):
        end_of_turn_ids(plain, HermesTemplate())
    plain.add_special_tokens([IM_END])
    with pytest.raises(ValueError, match="im_start"):
        end_of_turn_ids(plain, HermesTemplate())
    assert end_of_turn_ids(plain, JinjaTemplate(CHATML_TOOLS_JINJA, IM_END)) == (50257,)


def test_non_append_only_template_raises() -> None:
    counting = JinjaTemplate(
        "{{ '<|im_start|>system\\n' + (messages | length | string) + ' messages<|im_end|>\\n' }}"
        "{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}",
        IM_END)
    so_far = [*FIRST, {"role": "assistant", "content": "x"}]
    with pytest.raises(ValueError, match="not append-only"):
        counting.render_continuation(so_far, [{"role": "user", "content": "more"}])
    wrong_eot = JinjaTemplate(CHATML_TOOLS_JINJA, "</s>")
    with pytest.raises(ValueError, match="end-of-turn"):
        wrong_eot.render_continuation(so_far, [{"role": "user", "content": "more"}])


def test_jinja_environment() -> None:
    with pytest.raises(ValueError, match="boom"):
        JinjaTemplate("{{ raise_exception('boom') }}", IM_END).render([])
    with pytest.raises(ValueError, match="does not compile"):
        JinjaTemplate("{% for %}", IM_END)
    with pytest.raises(ValueError):  # the sandbox refuses attribute escapes
        JinjaTemplate("{{ ''.__class__.__mro__ }}", IM_END).render([])
    t = JinjaTemplate("{{ bos_token }}{{ messages[0].content | tojson }}{{ eos_token }}"
                      "{% if flag %}!{% endif %}", IM_END, bos_token="<s>", eos_token="</s>",
                      extra_context={"flag": True})
    assert t.render([{"role": "user", "content": "<ü>"}]) == '<s>"<ü>"</s>!'
    with pytest.raises(ValueError, match="may not set"):
        JinjaTemplate("x", IM_END, extra_context={"messages": []})


def test_message_validation() -> None:
    t = HermesTemplate()
    with pytest.raises(ValueError, match="role"):
        t.render([{"role": "robot", "content": "x"}])
    with pytest.raises(ValueError, match="content"):
        t.render([{"role": "user", "content": None}])
    with pytest.raises(ValueError, match="tool_calls"):
        t.render([{"role": "assistant", "content": "",
                   "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]}])
    with pytest.raises(ValueError, match="must end with the assistant"):
        t.render_continuation(FIRST, [{"role": "user", "content": "x"}])
    with pytest.raises(ValueError, match="empty"):
        t.render_continuation([*FIRST, {"role": "assistant", "content": "x"}], [])
    with pytest.raises(ValueError, match="tools"):
        t.render(FIRST, "not tools")  # type: ignore[arg-type]


def test_load_chat_template(tmp_path: Path) -> None:
    assert isinstance(load_chat_template(tmp_path), HermesTemplate)
    with pytest.raises(ValueError, match="not a directory"):
        load_chat_template(tmp_path / "missing")
    config: dict[str, Any] = {"eos_token": {"content": "<|endoftext|>"}, "bos_token": None,
              "chat_template": CHATML_TOOLS_JINJA}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    t = load_chat_template(tmp_path)
    assert isinstance(t, JinjaTemplate)
    assert t.end_of_turn == IM_END and t.eos_token == "<|endoftext|>" and t.bos_token == ""
    conversation = episode(t)[1]
    assert t.render(conversation, TOOLS) == HermesTemplate().render(conversation, TOOLS)
    # chat_template.jinja wins over tokenizer_config.json
    (tmp_path / "chat_template.jinja").write_text("{{ eos_token }}")
    jt = load_chat_template(tmp_path)
    assert jt.render([]) == "<|endoftext|>" and jt.end_of_turn == "<|endoftext|>"
    assert load_chat_template(tmp_path, end_of_turn="<x>").end_of_turn == "<x>"
    (tmp_path / "chat_template.jinja").unlink()
    config["chat_template"] = [{"name": "default", "template": "d"},
                               {"name": "tool_use", "template": "t"}]
    config["eos_token"] = "<|im_end|>"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert load_chat_template(tmp_path).render([]) == "d"
    assert load_chat_template(tmp_path, template_name="tool_use").render([]) == "t"
    with pytest.raises(ValueError, match="no chat template named"):
        load_chat_template(tmp_path, template_name="rag")
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_chat_template(tmp_path)
