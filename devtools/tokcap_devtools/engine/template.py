"""The ChatML chat template (Jinja2), with Hermes-style tool calls and ``<think>`` blocks.

Designed so that, with the knobs off, re-rendering a conversation reproduces the sampled
ids: an assistant turn renders as exactly the text the engine generated (think block,
content, tool calls) followed by ``<|im_end|>``, which the engine generates as its last
token. Two knobs make the template lossy the way real templates are: ``think_strip``
drops past ``<think>`` blocks, ``json_reserialize`` is on the generation side (the engine
writes compact JSON that this template re-serializes with spaces).

It is the template of a ``tokenizer.json`` engine; ``--tokenizer qwen3`` renders with
Qwen3's own (``tokcap_devtools.engine.chat_template``). :func:`messages_from_prompt` reads prompts of both.
"""

from __future__ import annotations

import json
import re
from typing import Any

import jinja2

# How the template (and, with json_reserialize off, the engine) writes tool-call JSON.
TEMPLATE_SEPARATORS = (", ", ": ")
# How the engine writes tool-call JSON when json_reserialize is on.
COMPACT_SEPARATORS = (",", ":")

TOOLS_PREAMBLE = (
    "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
)
TOOLS_POSTAMBLE = (
    "\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)

CHATML = (
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if m.reasoning and not think_strip -%}"
    "{{- '<think>\\n' + m.reasoning + '\\n</think>\\n\\n' -}}"
    "{%- endif -%}"
    "{{- m.content -}}"
    "{%- for call in m.tool_calls -%}"
    "{%- if not loop.first or m.content -%}{{- '\\n' -}}{%- endif -%}"
    "{{- '<tool_call>\\n' + call.json + '\\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- elif m.role == 'tool' -%}"
    "{{- '<|im_start|>tool\\n<tool_response>\\n' + m.content + '\\n</tool_response><|im_end|>\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' + m.role + '\\n' + m.content -}}"
    "{%- if loop.first and m.role == 'system' and tools_block -%}{{- tools_block -}}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

_THINK_IN_CONTENT = re.compile(r"<think>.*?</think>\s*", re.DOTALL)
_TEMPLATE = jinja2.Environment(autoescape=False, keep_trailing_newline=True).from_string(CHATML)


def rendered_text(content: Any) -> str:
    """What the template renders of a content: a string, or every part's text, joined.

    Unlike ``capture.build.projection.content_text`` it keeps parts of any type (the
    engine renders what it is sent) and turns other values into strings.
    """
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if isinstance(part, dict):
                texts.append(str(part.get("text") or ""))
            elif isinstance(part, str):
                texts.append(part)
        return "".join(texts)
    return str(content)


def tool_call_json(name: str, arguments: Any, separators: tuple[str, str]) -> str:
    """The Hermes tool-call object; unparsable argument strings are embedded as they are."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            head = json.dumps({"name": name}, ensure_ascii=False, separators=separators)
            return f'{head[:-1]}{separators[0]}"arguments"{separators[1]}{arguments}}}'
    return json.dumps(
        {"name": name, "arguments": arguments}, ensure_ascii=False, separators=separators
    )


def tools_block(tools: list[dict] | None) -> str:
    if not tools:
        return ""
    lines = [json.dumps(tool, ensure_ascii=False) for tool in tools]
    return TOOLS_PREAMBLE + "\n".join(lines) + TOOLS_POSTAMBLE


def normalize_message(message: dict, *, think_strip: bool) -> dict:
    role = str(message.get("role") or "user")
    content = rendered_text(message.get("content"))
    reasoning = rendered_text(message.get("reasoning_content") or message.get("reasoning"))
    calls = []
    if role == "assistant":
        if think_strip:
            content = _THINK_IN_CONTENT.sub("", content)
        for call in message.get("tool_calls") or []:
            function = call.get("function") or {}
            calls.append(
                {
                    "name": function.get("name", ""),
                    "json": tool_call_json(
                        function.get("name", ""),
                        function.get("arguments", "{}"),
                        TEMPLATE_SEPARATORS,
                    ),
                }
            )
    return {"role": role, "content": content, "reasoning": reasoning, "tool_calls": calls}


def render(
    messages: list[dict],
    *,
    tools: list[dict] | None = None,
    add_generation_prompt: bool = True,
    think_strip: bool = False,
) -> str:
    """The prompt text of a conversation (special tokens written as text)."""
    normalized = [normalize_message(m, think_strip=think_strip) for m in messages]
    block = tools_block(tools)
    if block and (not normalized or normalized[0]["role"] != "system"):
        normalized.insert(0, {"role": "system", "content": "", "reasoning": "", "tool_calls": []})
    return _TEMPLATE.render(
        messages=normalized,
        tools_block=block,
        add_generation_prompt=add_generation_prompt,
        think_strip=think_strip,
    )


_TURN = re.compile(r"<\|im_start\|>(\w+)\n(.*?)(?:<\|im_end\|>|\Z)", re.DOTALL)
_TOOL_RESPONSE = re.compile(r"<tool_response>\n(.*?)\n</tool_response>", re.DOTALL)
_TOOL_RESPONSES = re.compile(r"(?:<tool_response>\n.*?\n</tool_response>\n?)+", re.DOTALL)


def _turn_messages(role: str, body: str) -> list[dict]:
    """One rendered turn as messages: a turn that is only ``<tool_response>`` blocks is the
    tool results it holds (ChatML's ``tool`` turn holds one, Qwen3's ``user`` turn all of a
    row), so the policy reads them as it reads them in a chat request."""
    if role in ("tool", "user") and _TOOL_RESPONSES.fullmatch(body):
        return [{"role": "tool", "content": text} for text in _TOOL_RESPONSE.findall(body)]
    return [{"role": role, "content": body}]


def messages_from_prompt(prompt: str) -> list[dict]:
    """Best-effort inverse of :func:`render` (or of Qwen3's template), for prompts given as
    text or token ids.

    Used only to pick a policy reply for a token-in call; a trailing empty assistant turn
    (the generation prompt) is dropped.
    """
    messages = [m for role, body in _TURN.findall(prompt) for m in _turn_messages(role, body)]
    if messages and messages[-1]["role"] == "assistant" and not messages[-1]["content"]:
        messages.pop()
    return messages


_TOOLS = re.compile(r"<tools>\n(.*?)\n</tools>", re.DOTALL)


def tools_from_prompt(prompt: str) -> list[dict]:
    """The tools a rendered prompt lists in its system turn (empty if none)."""
    match = _TOOLS.search(prompt)
    if not match:
        return []
    tools = []
    for line in match.group(1).splitlines():
        try:
            tool = json.loads(line)
        except ValueError:
            continue
        if isinstance(tool, dict):
            tools.append(tool)
    return tools
