"""Tools an environment offers, and the policy's action read as a call of one of them.

An environment that declares :attr:`~orbitctl.rl.envs.base.Environment.tools` is played by tool calls: each
action must be one call in the Hermes format that chat templates with a tool specification use (Qwen2.5,
Qwen3, SmolLM3, Hermes)::

    <tool_call>
    {"name": "take", "arguments": {"object": "mug"}}
    </tool_call>

The tags may be left out (a bare JSON object is one call too). :func:`parse_tool_call` returns the call, or a
:class:`ToolCallError` whose message is what the environment answers instead of playing anything: bad JSON, an
unknown tool, a missing argument, an argument of the wrong type, or text outside the call (arguments the tool
does not declare are dropped). A malformed call never ends an episode and never raises.

    tools = (Tool("go", "Walk to a room.", {"room": "string"}),)
    parse_tool_call('{"name": "go", "arguments": {"room": "kitchen"}}', tools)   # ToolCall('go', {...})
    parse_tool_call('go to the kitchen', tools).message                          # 'bad JSON: ...'
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

OPEN, CLOSE = "<tool_call>", "</tool_call>"
JSON_TYPES = {"string": str, "integer": int}
"""The argument types a tool may declare, and the Python type each must parse to."""


@dataclass(frozen=True)
class Tool:
    """One function the policy may call: its name, what it does, and its arguments (all required)."""

    name: str
    description: str
    arguments: dict[str, str] = field(default_factory=dict)
    """Argument name -> JSON type (``string`` or ``integer``)."""

    def spec(self) -> dict:
        """The tool as a JSON schema in OpenAI's function format, what ``apply_chat_template(tools=...)`` takes."""
        properties = {name: {"type": kind, "description": f"the {name}"} for name, kind in self.arguments.items()}
        return {"type": "function", "function": {
            "name": self.name, "description": self.description,
            "parameters": {"type": "object", "properties": properties, "required": list(self.arguments)}}}


@dataclass(frozen=True)
class ToolCall:
    """A well-formed call: a declared tool with exactly its arguments."""

    name: str
    arguments: dict


@dataclass(frozen=True)
class ToolCallError:
    """Why an action is not a well-formed call; :attr:`message` is the environment's answer."""

    kind: str
    """``bad_json``, ``unknown_tool``, ``missing_argument``, ``bad_argument`` or ``extra_text``."""
    message: str


def _json_object(text: str) -> tuple[dict | None, str]:
    """The JSON object that ``text`` starts with and the text after it; None when it does not start with one."""
    try:
        value, end = json.JSONDecoder().raw_decode(text)
    except json.JSONDecodeError as err:
        return None, err.msg
    if not isinstance(value, dict):
        return None, "the call is not a JSON object"
    return value, text[end:]


def parse_tool_call(action: str, tools: tuple[Tool, ...]) -> ToolCall | ToolCallError:
    """``action`` (the policy's text, special tokens removed) as a call of one of ``tools``."""
    text = action.strip()
    tagged = text.startswith(OPEN)
    if tagged:
        text = text[len(OPEN):].lstrip()
    elif not text.startswith("{"):
        return ToolCallError("extra_text" if "{" in text else "bad_json",
                             f"Error: text before the tool call. Answer with one {OPEN} call and nothing else."
                             if "{" in text else "Error: bad JSON: no tool call found. Answer with one "
                                                 f"{OPEN} call.")
    value, rest = _json_object(text)
    if value is None:
        return ToolCallError("bad_json", f"Error: bad JSON in the tool call ({rest}).")
    rest = rest.strip()
    if tagged:
        if not rest.startswith(CLOSE):
            return ToolCallError("extra_text" if rest else "bad_json",
                                 f"Error: text after the tool call. End the call with {CLOSE}." if rest
                                 else f"Error: the tool call has no closing {CLOSE}.")
        rest = rest[len(CLOSE):].strip()
    if rest:
        return ToolCallError("extra_text", "Error: text after the tool call. Answer with one call and nothing else.")
    return check_call(value, tools)


def check_call(value: dict, tools: tuple[Tool, ...]) -> ToolCall | ToolCallError:
    """A decoded ``{"name": ..., "arguments": {...}}`` checked against the tools' declarations."""
    names = ", ".join(t.name for t in tools)
    by_name = {t.name: t for t in tools}
    tool = by_name.get(value.get("name")) if isinstance(value.get("name"), str) else None
    if tool is None:
        return ToolCallError("unknown_tool", f"Error: unknown tool {json.dumps(value.get('name'))}. Tools: {names}.")
    arguments = value.get("arguments", {})
    if isinstance(arguments, str):  # some templates write the arguments as a JSON string
        arguments, _ = _json_object(arguments)
    if not isinstance(arguments, dict) or set(value) - {"name", "arguments"}:
        return ToolCallError("bad_argument", f'Error: a call is {{"name": "{tool.name}", "arguments": {{...}}}}.')
    missing = [a for a in tool.arguments if a not in arguments]
    if missing:
        return ToolCallError("missing_argument", f"Error: {tool.name} needs the argument '{missing[0]}'.")
    wrong = [a for a, kind in tool.arguments.items() if not isinstance(arguments[a], JSON_TYPES[kind])]
    if wrong:
        return ToolCallError("bad_argument", f"Error: {tool.name}'s argument '{wrong[0]}' must be a "
                                             f"{tool.arguments[wrong[0]]}.")
    # arguments the tool does not declare are left out, as OpenAI-style servers drop unknown fields
    return ToolCall(tool.name, {a: arguments[a] for a in tool.arguments})


def format_call(name: str, arguments: dict) -> str:
    """A call written the way :func:`parse_tool_call` reads it (walkthroughs, examples in the system turn)."""
    return f'{OPEN}\n{json.dumps({"name": name, "arguments": arguments})}\n{CLOSE}'


def tools_system_text(tools: tuple[Tool, ...], example: str) -> str:
    """The tools and the call format in words, for a chat template that has no tool specification of its own."""
    lines = [f"- {t.name}({', '.join(t.arguments)}): {t.description}" for t in tools]
    return ("You act by calling one tool per turn. Tools:\n" + "\n".join(lines) +
            f"\nAnswer with one call and nothing else, for example:\n{example}")
