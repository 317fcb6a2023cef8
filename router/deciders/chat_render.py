"""A chat request's prompt text in the router, rendered as vLLM 0.32 renders it for a HuggingFace tokenizer.

vLLM turns the request's messages into its conversation (text parts joined with a newline, an assistant's tool
call arguments parsed into objects, a tool message's parts joined, `name` kept), then renders the model's Jinja
chat template the way transformers' `apply_chat_template` does (a sandboxed environment with `trim_blocks` and
`lstrip_blocks`, the `tojson` filter without HTML escaping, `raise_exception`, `strftime_now`, the tokenizer's
special tokens as variables), with the request's `tools` as vLLM dumps them, `add_generation_prompt`,
`reasoning_effort` and `chat_template_kwargs`. The text is then tokenized without special tokens (unless the
request asks for them): router/deciders/prompt_tokens.py.

Only shapes whose rendering is certain are rendered; `render` answers None for the rest, and the decider keeps
its estimate for them: a template that iterates over content parts (vLLM's "openai" content format), content
other than text (images, audio, files), a `developer` message, `continue_final_message`, `documents`, a request
`chat_template`, truncation, tools vLLM would reshape (`defer_loading`), Claude Code's billing header in a
system message (vLLM drops that line). The engine's own `--chat-template` and `--default-chat-template-kwargs`
must match what the router reads (the tokenizer folder's template): the integration test checks the router's
ids against the engine's `/tokenize`.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from router.errors import ConfigError

logger = logging.getLogger("kvpush.decider")
_BILLING_HEADER = "x-anthropic-billing-header"
_ITERATES_CONTENT = re.compile(r"\{%-?\s*for\s+\w+\s+in\s+[^%]*content")
_REFUSED_FIELDS = ("documents", "chat_template", "truncate_prompt_tokens", "mm_processor_kwargs")
_RESERVED_KWARGS = frozenset({"chat_template", "tokenize", "tools", "messages"})
_UNSET = (None, "auto")  # vLLM's merge: a request field with one of these values does not override


class ChatTemplate:
    """A compiled chat template and the tokenizer's special tokens it may read."""

    def __init__(self, source: str, special_tokens: Mapping[str, str]) -> None:
        try:
            from jinja2 import TemplateError
            from jinja2.ext import loopcontrols
            from jinja2.sandbox import ImmutableSandboxedEnvironment
        except ImportError as error:
            raise ConfigError(f"decider option tokenizer: a chat template needs jinja2 ({error})") from None

        def raise_exception(message: str) -> None:
            raise TemplateError(message)

        def tojson(
            x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False
        ) -> str:
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

        def strftime_now(form: str) -> str:
            return datetime.now().strftime(form)

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, _generation_tag()]
        )
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = strftime_now
        try:
            self._template = env.from_string(source)
        except TemplateError as error:
            raise ConfigError(f"decider option tokenizer: the chat template does not compile: {error}") from None
        self.special_tokens = dict(special_tokens)
        self.parts_format = _ITERATES_CONTENT.search(source) is not None  # vLLM's "openai" content format

    def render(self, body: Mapping[str, Any]) -> str | None:
        """The prompt text vLLM renders for this chat request's body; None when the router cannot be sure."""
        if self.parts_format or any(body.get(name) is not None for name in _REFUSED_FIELDS):
            return None
        if body.get("continue_final_message"):
            return None
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return None
        conversation = conversation_of(messages)
        tools = tool_dicts(body.get("tools"))
        variables = template_variables(body)
        if conversation is None or tools is False or variables is None:
            return None
        try:
            return self._template.render(
                {**self.special_tokens, **variables, "messages": conversation, "tools": tools, "documents": None}
            )
        except Exception as error:  # noqa: BLE001 - a model's template is a program of its own: any failure
            logger.debug("chat template failed on a request (%s): deciding on the estimate", error)
            return None  # the engine answers it with a 400, or renders what the router cannot: no exact ids


def _generation_tag() -> type[Any]:
    """`{% generation %}...{% endgeneration %}` (transformers' assistant-mask markers) renders its body."""
    from jinja2.ext import Extension

    class Generation(Extension):
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    return Generation


def template_variables(body: Mapping[str, Any]) -> dict[str, Any] | None:
    """The template's keyword variables: the request's `chat_template_kwargs` under the request's own fields
    (vLLM's merge: a field that is None or "auto" does not override). None for a reserved name."""
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, Mapping) or _RESERVED_KWARGS & set(kwargs):
        return None
    generation = body.get("add_generation_prompt", True)
    effort = body.get("reasoning_effort")
    fields: dict[str, Any] = {
        "add_generation_prompt": generation,
        "continue_final_message": body.get("continue_final_message", False),
        "reasoning_effort": effort,
    }
    if effort is not None and "enable_thinking" not in kwargs:
        fields["enable_thinking"] = effort != "none"
    merged = dict(kwargs)
    merged.update({k: v for k, v in fields.items() if v not in _UNSET})
    return merged


def conversation_of(messages: Sequence[Any]) -> list[dict[str, Any]] | None:
    """vLLM's conversation for text-only messages under a string-content template; None for anything else."""
    out = []
    for message in messages:
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            return None
        converted = _message(message)
        if converted is None:
            return None
        out.append(converted)
    return out


def _message(message: Mapping[str, Any]) -> dict[str, Any] | None:
    role = message["role"]
    if role == "developer":
        return None
    text = _text(message.get("content"))
    if text is None or (role == "system" and _BILLING_HEADER in text):
        return None
    result: dict[str, Any] = {"role": role, "content": text}
    if role == "assistant":
        calls = message.get("tool_calls")
        if calls is not None:
            parsed = _tool_calls(calls)
            if parsed is None:
                return None
            if parsed:
                result["tool_calls"] = parsed
        if message.get("reasoning") is not None:
            result["reasoning"] = result["reasoning_content"] = message["reasoning"]
    elif role == "tool" and "tool_call_id" in message:
        result["tool_call_id"] = message["tool_call_id"]
    for name in ("name", "task"):
        if isinstance(message.get(name), str):
            result[name] = message[name]
    return result


def _text(content: Any) -> str | None:
    """A message's content as vLLM joins it: a string as is, text parts joined with a newline, none: ""."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return None
    texts = []
    for part in content:
        if isinstance(part, str):
            texts.append(part)
        elif isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
        else:
            return None  # images, audio, files, refusals: not rendered here
    return "\n".join(texts)


def _tool_calls(calls: Any) -> list[dict[str, Any]] | None:
    """An assistant's tool calls as vLLM hands them to the template: arguments parsed into an object ({} for
    none, malformed or not an object); None for a shape vLLM refuses."""
    if not isinstance(calls, list):
        return None
    out = []
    for call in calls:
        if not isinstance(call, Mapping) or call.get("type", "function") != "function":
            return None
        function = call.get("function")
        if not isinstance(function, Mapping):
            return None
        arguments = function.get("arguments")
        parsed: Any = {}
        if isinstance(arguments, Mapping):
            parsed = dict(arguments)
        elif isinstance(arguments, str) and arguments:
            try:
                parsed = json.loads(arguments)
            except json.JSONDecodeError:
                parsed = {}
        out.append({**call, "function": {**function, "arguments": parsed if isinstance(parsed, dict) else {}}})
    return out


def tool_dicts(tools: Any) -> list[dict[str, Any]] | bool | None:
    """The request's tools as vLLM dumps them for the template (type, then the function's name, description and
    parameters, `strict` when set); None without tools; False for a shape the router does not render."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        return False
    out: list[dict[str, Any]] = []
    for tool in tools:
        if not isinstance(tool, Mapping) or tool.get("type", "function") != "function":
            return False
        function = tool.get("function")
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            return False
        if tool.get("defer_loading") is not None or function.get("defer_loading") is not None:
            return False
        dumped: dict[str, Any] = {
            "name": function["name"],
            "description": function.get("description"),
            "parameters": function.get("parameters"),
        }
        if function.get("strict") is not None:
            dumped["strict"] = function["strict"]
        out.append({"type": "function", "function": dumped})
    return out
