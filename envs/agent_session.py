"""One agent session's tokens: what an OpenAI chat-completions call renders to, whether it
continues the session, and the reply a sampled turn makes (envs.openai_agent drives it).

Token in, token out, across calls:
- The first call's messages (with its `tools=`) are rendered by the chat template: the prompt.
- A later call *continues* the session when its messages are the previous call's, then the
  assistant reply exactly as it was returned (content and tool calls), then new messages, and
  the template renders that conversation append-only (the new rendering starts with the
  rendering up to the reply). Then the sampled tokens are kept as they are and only the new
  messages are rendered and appended (envs.render's delta): a model turn is never
  re-tokenized.
- Any other call starts a new *branch*: an agent that edited an earlier message, or a template
  that rewrites history (e.g. drops older <think> blocks). Its rendering is the branch's prompt;
  the earlier branch's tokens are dropped and counted (`prefix_breaks`). Only the last branch is
  trained: one trajectory stays one sample (groups of n, the batch's shape and the token budget
  unchanged), the last branch holds the answer the reward scores, and its prompt is the history
  as the template shows it to the model at that call.
"""
from __future__ import annotations

import json
import time

from envs.render import closing_text
from envs.tool_calls import ToolCall, parse_hermes

UNSUPPORTED = {  # request key -> why it is refused (a value other than its default)
    "stream": "streaming is not supported; call without stream=True",
    "n": "one choice per call (n=1): each session is one trajectory",
    "stop": "stop sequences are not supported (the turn ends at the model's end of turn or "
            "max_tokens)",
    "top_logprobs": "top_logprobs is not supported (logprobs=True gives each sampled token's)",
    "tool_choice": "tool_choice other than 'auto' is not supported",
    "response_format": "response_format is not supported",
}
_DEFAULTS = {"stream": (None, False), "n": (None, 1), "stop": (None, [], ""),
             "top_logprobs": (None, 0), "tool_choice": (None, "auto"),
             "response_format": (None, {"type": "text"})}


def error_body(message: str, param: str | None = None,
               kind: str = "invalid_request_error", code: str | None = None) -> dict:
    """An OpenAI-style error object."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def request_problem(body: dict, sampling: dict | None) -> tuple[str, str] | None:
    """(param, why) when the call cannot be served, else None. sampling: the run's
    {"temperature", "top_p"} the loss assumes (a call may omit them or ask for the same
    values), or None (evaluation: greedy whatever the call asks)."""
    if not isinstance(body, dict):
        return "body", "the request body is not a JSON object"
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
        return "messages", "messages must be a non-empty list of {role, content} objects"
    for key, why in UNSUPPORTED.items():
        if key in body and body[key] not in _DEFAULTS[key]:
            return key, why
    for key in ("temperature", "top_p"):
        value = body.get(key)
        if sampling is not None and value is not None and value != sampling[key]:
            return key, (f"{key}={value} differs from the run's rollout.{key}={sampling[key]}, "
                         f"under which the loss takes the samples; omit it or set "
                         f"rollout.{key}")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None and (type(max_tokens) is not int or max_tokens < 1):
        return "max_tokens", f"max_tokens must be a positive integer, got {max_tokens!r}"
    tools = body.get("tools")
    if tools is not None and not (isinstance(tools, list) and all(
            isinstance(t, dict) and isinstance(t.get("function"), dict) for t in tools)):
        return "tools", "tools must be a list of {type: function, function: {...}} objects"
    return None


def _content(value) -> str:
    """A message's content as text (a list of parts: their texts joined; None: "")."""
    if isinstance(value, list):
        return "".join(p.get("text", "") for p in value if isinstance(p, dict))
    return "" if value is None else str(value)


def _arguments(value):
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value


def normalize(message: dict) -> dict:
    """The parts of a message that its rendering depends on, in the chat template's form
    (tool-call arguments as objects; fields the SDK sends as None dropped), so that a message
    sent back as the SDK returned it compares equal to the reply it came from."""
    out = {"role": message["role"], "content": _content(message.get("content"))}
    calls = [{**({"id": c["id"]} if c.get("id") is not None else {}), "type": "function",
              "function": {"name": (c.get("function") or {}).get("name"),
                           "arguments": _arguments((c.get("function") or {}).get("arguments"))}}
             for c in message.get("tool_calls") or [] if isinstance(c, dict)]
    if calls:
        out["tool_calls"] = calls
    for key in ("name", "tool_call_id"):
        if message.get(key) is not None:
            out[key] = message[key]
    return out


class Session:
    """One trajectory's calls: the current branch's prompt and tokens, and what was returned."""

    def __init__(self, tokenizer, session_id: str, model_name: str):
        self.tokenizer, self.id, self.model_name = tokenizer, session_id, model_name
        self.messages: list[dict] | None = None  # the last call's, normalized
        self.tools: list | None = None
        self.reply: dict | None = None  # the last reply, normalized
        self.prompt: list[int] = []  # the current branch's prompt
        self.length = 0  # tokens of the branch after its prompt (sampled and observations)
        self.last_token: int | None = None
        self.calls = 0
        self.branches = 0  # prefix breaks

    def render(self, messages: list[dict], generation: bool = True) -> str:
        kwargs = {"tools": self.tools} if self.tools else {}
        return self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                  add_generation_prompt=generation, **kwargs)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def call(self, body: dict) -> tuple[str, list[int]]:
        """A call's messages: ("prompt", ids) for the first call or a new branch (the
        branch's whole prompt), ("continue", ids) for the tokens to append after the
        session's (the new messages, rendered as the template's delta)."""
        messages = [normalize(m) for m in body["messages"]]
        tools = body.get("tools") or None
        first = self.messages is None
        delta = None if first else self._delta(messages, tools)
        self.calls += 1
        self.messages, self.tools = messages, tools
        if delta is None:
            self.branches += not first
            self.prompt, self.length = self.encode(self.render(messages)), 0
            return "prompt", self.prompt
        ids = self.encode(delta)
        self.length += len(ids)
        return "continue", ids

    def _delta(self, messages: list[dict], tools) -> str | None:
        """The text to append when `messages` continue the session (module docstring), else
        None (a new branch)."""
        prev, n = self.messages, len(self.messages)
        if (tools != self.tools or len(messages) < n + 2 or messages[:n] != prev
                or messages[n] != self.reply):
            return None
        before = self.render(prev + [self.reply], generation=False)
        after = self.render(messages)
        closed = closing_text(self.tokenizer, self.tools, None)
        if not before.endswith(closed) or not after.startswith(before):
            return None  # the template rewrites what came before
        # the closing of the reply (its end-of-turn unless sampled) and the new messages
        return closing_text(self.tokenizer, self.tools, self.last_token) + after[len(before):]

    def answer(self, turn_ids: list[int], logprobs: list[float], finish_reason: str,
               parse_tools: bool) -> dict:
        """The chat.completion for a sampled turn; records it as the session's reply."""
        text = self.tokenizer.decode(turn_ids, skip_special_tokens=True)
        parsed = parse_hermes(text) if parse_tools else None
        calls = [c for c in parsed.calls if isinstance(c, ToolCall)] if parsed else []
        content = parsed.content if calls else text
        tool_calls = [{"id": f"call_{self.id}_{self.calls}_{k}", "type": "function",
                       "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
                      for k, c in enumerate(calls)]
        message = {"role": "assistant", "content": content or None,
                   **({"tool_calls": tool_calls} if tool_calls else {})}
        self.reply = normalize(message)
        self.last_token = turn_ids[-1] if turn_ids else None
        done_before = self.length
        self.length += len(turn_ids)
        reason = "tool_calls" if calls else ("length" if finish_reason == "length" else "stop")
        choice = {"index": 0, "message": message, "finish_reason": reason, "logprobs": None}
        if logprobs is not None:
            pieces = [self.tokenizer.decode([t]) for t in turn_ids]
            choice["logprobs"] = {"content": [
                {"token": p, "logprob": lp, "bytes": list(p.encode()), "top_logprobs": []}
                for p, lp in zip(pieces, logprobs)]}
        return {"id": f"chatcmpl-{self.id}-{self.calls}", "object": "chat.completion",
                "created": int(time.time()), "model": self.model_name, "choices": [choice],
                "usage": {"prompt_tokens": len(self.prompt) + done_before,
                          "completion_tokens": len(turn_ids),
                          "total_tokens": len(self.prompt) + self.length}}
