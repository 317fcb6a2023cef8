"""A chat request rendered as vLLM 0.32 renders it: the conversation it builds, the tools it dumps, the template's
variables; shapes the router cannot be sure of render to None."""

from __future__ import annotations

import json
from typing import Any

import pytest

from router.deciders.chat_render import ChatTemplate, conversation_of, template_variables, tool_dicts
from router.errors import ConfigError

SIMPLE = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TOOLS = (
    "{% if tools %}{% for t in tools %}{{ t | tojson }}\n{% endfor %}{% endif %}"
    "{% for m in messages %}{{ m.role }}: {{ m.content }}"
    "{% if m.tool_calls %}{% for c in m.tool_calls %} call {{ c.function.name }}"
    "({{ c.function.arguments | tojson }}){% endfor %}{% endif %}\n{% endfor %}"
    "{% generation %}{% if add_generation_prompt %}assistant:{% endif %}{% endgeneration %}"
    "{% if enable_thinking is defined %} think={{ enable_thinking }}{% endif %}{{ extra | default('') }}"
)


def render(template: str, body: dict[str, Any]) -> str | None:
    return ChatTemplate(template, {"bos_token": "<B>"}).render(body)


def test_text_parts_are_joined_with_a_newline_and_absent_content_is_empty() -> None:
    body = {
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": None},
        ]
    }
    text = render(SIMPLE, body)
    assert text == (
        "<B><|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\na\nb<|im_end|>\n"
        "<|im_start|>assistant\n<|im_end|>\n<|im_start|>assistant\n"
    )


def test_add_generation_prompt_false_and_kwargs_under_the_request_fields() -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": False}
    assert render(SIMPLE, body) == "<B><|im_start|>user\nhi<|im_end|>\n"
    merged = template_variables({"chat_template_kwargs": {"add_generation_prompt": False, "extra": 1}})
    assert merged == {"add_generation_prompt": True, "continue_final_message": False, "extra": 1}
    thinking = template_variables({"reasoning_effort": "none"})
    assert thinking is not None and thinking["enable_thinking"] is False


def test_tools_and_tool_calls_as_vllm_hands_them_to_the_template() -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}, "x": 1}
    assert tool_dicts([tool]) == [
        {"type": "function", "function": {"name": "f", "description": None, "parameters": {"type": "object"}}}
    ]
    call = {"id": "1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    bad = {"id": "2", "type": "function", "function": {"name": "g", "arguments": "not json"}}
    body: dict[str, Any] = {
        "tools": [tool],
        "reasoning_effort": "low",
        "chat_template_kwargs": {"extra": "!"},
        "messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "", "tool_calls": [call, bad]}],
    }
    dumped = json.dumps(tool_dicts([tool])[0])  # type: ignore[index]
    # trim_blocks: the newline after a block tag goes, as in transformers
    assert render(TOOLS, body) == f'{dumped}\nuser: xassistant:  call f({{"a": 1}}) call g({{}})assistant: think=True!'

    assert body["messages"][1]["tool_calls"][0]["function"]["arguments"] == '{"a": 1}'  # the body is not changed


def test_the_same_text_as_transformers_renders() -> None:
    """The environment is transformers' (vLLM calls its apply_chat_template): checked where it is installed."""
    utils = pytest.importorskip("transformers.utils.chat_template_utils")
    tool = {"type": "function", "function": {"name": "f", "description": "d", "parameters": {"type": "object"}}}
    body: dict[str, Any] = {
        "tools": [tool],
        "messages": [
            {"role": "system", "content": "s"},
            {"role": "user", "content": "u <x> é"},
            {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "f"}}]},
        ],
    }
    conversation = conversation_of(body["messages"])
    for template in (SIMPLE, TOOLS):
        expected, _ = utils.render_jinja_template(
            [conversation],
            tools=tool_dicts(body["tools"]),
            chat_template=template,
            add_generation_prompt=True,
            bos_token="<B>",
            continue_final_message=False,
            reasoning_effort=None,
        )
        assert render(template, body) == expected[0]


def test_an_empty_tool_call_list_is_dropped_and_tool_messages_keep_their_id() -> None:
    conversation = conversation_of(
        [
            {"role": "assistant", "content": "a", "tool_calls": [], "name": "bot"},
            {"role": "tool", "content": [{"type": "text", "text": "r"}], "tool_call_id": "7"},
        ]
    )
    assert conversation == [
        {"role": "assistant", "content": "a", "name": "bot"},
        {"role": "tool", "content": "r", "tool_call_id": "7"},
    ]


@pytest.mark.parametrize(
    "body",
    [
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        {"messages": [{"role": "developer", "content": "x"}]},
        {"messages": [{"role": "system", "content": "x-anthropic-billing-header: cch=1\nhi"}]},
        {"messages": [{"role": "user", "content": "x"}], "continue_final_message": True},
        {"messages": [{"role": "user", "content": "x"}], "documents": [{"title": "t", "text": "x"}]},
        {"messages": [{"role": "user", "content": "x"}], "chat_template": "{{ 1 }}"},
        {"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"tools": []}},
        {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {}}]},
        {"messages": []},
    ],
)
def test_shapes_the_router_cannot_be_sure_of_render_to_none(body: dict[str, Any]) -> None:
    assert render(SIMPLE, body) is None


def test_a_template_over_content_parts_or_one_that_raises_renders_to_none() -> None:
    parts = "{% for m in messages %}{% for p in m['content'] %}{{ p.text }}{% endfor %}{% endfor %}"
    assert render(parts, {"messages": [{"role": "user", "content": "x"}]}) is None
    for raising in ("{{ raise_exception('no') }}", "{{ 1 // 0 }}", "{{ messages[5]['content'] }}"):
        assert render(raising, {"messages": [{"role": "user", "content": "x"}]}) is None


def test_a_template_that_does_not_compile_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="chat template"):
        ChatTemplate("{% for %}", {})
