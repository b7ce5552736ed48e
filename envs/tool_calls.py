"""Tool calls in a model's turn, in the format of its chat template, and their parse errors.

Hermes / Qwen 2.5 (the builtins and SmolLM2 use Qwen-style templates): each call is
    <tool_call>
    {"name": "calculator", "arguments": {"expression": "37 * 482"}}
    </tool_call>
A call that does not parse is kept as an error, which the environment answers to the model
as a tool message (the run goes on).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

OPEN, CLOSE = "<tool_call>", "</tool_call>"
FORMAT = f'{OPEN}{{"name": "<tool>", "arguments": {{...}}}}{CLOSE}'
_CALL = re.compile(re.escape(OPEN) + r"(.*?)(?:" + re.escape(CLOSE) + r"|$)", re.DOTALL)


@dataclass
class ToolCall:
    name: str
    arguments: dict = field(default_factory=dict)


@dataclass
class ParsedTurn:
    """A model turn's calls, in order: a ToolCall, or the error text of one that did not
    parse."""

    calls: list[ToolCall | str]
    content: str  # the turn's text outside the calls

    @property
    def num_errors(self) -> int:
        return sum(isinstance(c, str) for c in self.calls)


def _short(text: str, n: int = 80) -> str:
    text = text.strip()
    return text if len(text) <= n else text[:n - 3] + "..."


def parse_call(body: str) -> ToolCall | str:
    """One call's JSON, or why it is not a call."""
    try:
        raw = json.loads(body)
    except (ValueError, RecursionError):  # (nested thousands deep: RecursionError)
        return f"the tool call {_short(body)!r} is not JSON; write {FORMAT}"
    if not isinstance(raw, dict) or not isinstance(raw.get("name"), str):
        return f"the tool call {_short(body)!r} has no \"name\"; write {FORMAT}"
    arguments = raw.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except ValueError:
            pass
    if not isinstance(arguments, dict) or set(raw) - {"name", "arguments"}:
        return (f"the tool call {_short(body)!r} needs \"arguments\" as an object and no other "
                f"keys; write {FORMAT}")
    return ToolCall(raw["name"], arguments)


def parse_hermes(text: str) -> ParsedTurn:
    """Every <tool_call> block of `text` (an unclosed last one too: generation may stop at the
    closing tag, or run out of tokens in the call)."""
    calls = [parse_call(m.group(1)) for m in _CALL.finditer(text)]
    return ParsedTurn(calls, _CALL.sub("", text).strip())


PARSERS = {"hermes": parse_hermes}


def get_parser(name: str):
    if name not in PARSERS:
        raise ValueError(f"tool-call format {name!r} is not known; known: {', '.join(PARSERS)}")
    return PARSERS[name]
