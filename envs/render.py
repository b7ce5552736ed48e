"""The tokens of an environment's observation, as the model's chat template renders them after
a model turn: the template's delta for the new messages, rendered once.

The model's own turn is never re-rendered or re-tokenized (token in, token out): what is
appended after its sampled tokens is the text the template puts between the end of an
assistant message and the next assistant turn's opening, with the observation messages in
between. A turn that ended without the template's end-of-turn token (a length cut) gets the
whole closing text, so that the conversation stays well-formed.
"""
from __future__ import annotations

_USER, _ASSISTANT = "rlstack-user-text", "rlstack-assistant-text"


def observation_text(tokenizer, messages: list[dict], tools: list[dict] | None,
                     last_token_id: int | None) -> str:
    """The text to append after a model turn whose last sampled token is `last_token_id`, for
    the observation `messages`, ending in the next assistant opening. Only the template's very
    end-of-turn token ends the turn: one cut on a token that merely begins the closing text
    (such as "<") gets the whole closing text."""
    base = [{"role": "user", "content": _USER}, {"role": "assistant", "content": _ASSISTANT}]
    kwargs = {"tools": tools} if tools else {}
    before = tokenizer.apply_chat_template(base, tokenize=False, **kwargs)
    after = tokenizer.apply_chat_template(base + list(messages), tokenize=False,
                                          add_generation_prompt=True, **kwargs)
    if not after.startswith(before) or _ASSISTANT not in before:
        raise ValueError("the chat template renders a conversation differently once messages "
                         "follow (it is not append-only), so observations cannot be appended "
                         "as tokens; use a template that renders each message alone")
    return _closing(tokenizer, before, last_token_id) + after[len(before):]


def _closing(tokenizer, before: str, last_token_id: int | None) -> str:
    """What closes the assistant message rendered last in `before` (e.g. "<|im_end|>\\n"),
    less its end-of-turn token when the model sampled that token itself."""
    closing = before[before.rindex(_ASSISTANT) + len(_ASSISTANT):]
    end = tokenizer(closing, add_special_tokens=False)["input_ids"][0]  # the end-of-turn token
    if last_token_id == end:
        closing = closing[len(tokenizer.decode([end])):]
    return closing


def closing_text(tokenizer, tools: list[dict] | None, last_token_id: int | None) -> str:
    """The text that closes a model turn whose last sampled token is `last_token_id` (the
    template's end of an assistant message, less what the model sampled of it)."""
    base = [{"role": "user", "content": _USER}, {"role": "assistant", "content": _ASSISTANT}]
    before = tokenizer.apply_chat_template(base, tokenize=False,
                                           **({"tools": tools} if tools else {}))
    return _closing(tokenizer, before, last_token_id)


def observation_ids(tokenizer, messages: list[dict], tools: list[dict] | None,
                    last_token_id: int | None) -> list[int]:
    """observation_text as token ids (no special tokens added: the template has them)."""
    text = observation_text(tokenizer, messages, tools, last_token_id)
    return tokenizer(text, add_special_tokens=False)["input_ids"]
