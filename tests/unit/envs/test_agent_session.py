"""envs.agent_session on the tiny model's real tokenizer: a call that continues the session
keeps the sampled tokens as they are (never re-tokenized) and appends only the new messages'
rendering, equal to the template's rendering of the whole conversation where the template
renders tool calls as sampled; an edited history or a template that drops earlier <think>
blocks starts a counted branch; the calls the endpoint refuses."""
import json

import pytest

from envs.agent_session import Session, normalize, request_problem

# a Qwen-2.5-like template: tool calls rendered in the Hermes format the model samples
HERMES = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.content %}{{ m.content }}{% endif %}"
    "{% for c in m.tool_calls or [] %}<tool_call>\n{\"name\": \"{{ c.function.name }}\", "
    "\"arguments\": {{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# a template that rewrites history: an assistant message that is not the last loses its <think>
DROPS_THINK = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.role == 'assistant' and not "
    "loop.last %}{{ m.content.split('</think>')[-1] }}{% else %}{{ m.content }}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "37 * 482"}}\n</tool_call>'
TOOLS = [{"type": "function", "function": {"name": "calculator", "parameters": {
    "type": "object", "properties": {"expression": {"type": "string"}}}}}]


@pytest.fixture(scope="module")
def base_tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    from rl.data.models import build_tiny_model

    return AutoTokenizer.from_pretrained(build_tiny_model(
        "tiny-qwen2", out_dir=tmp_path_factory.mktemp("m") / "q"))


def with_template(tokenizer, template):
    import copy

    out = copy.copy(tokenizer)
    out.chat_template = template
    return out


def split_ids(tokenizer, text: str) -> list[int]:
    """`text` as the model may sample it: one token per character (decodes to the same text,
    but is not the tokenizer's own encoding of it)."""
    ids = [tokenizer.convert_tokens_to_ids(tokenizer.tokenize(ch)[0]) for ch in text]
    assert tokenizer.decode(ids) == text and ids != tokenizer.encode(text)
    return ids


def test_a_continued_session_keeps_the_sampled_tokens_and_renders_only_the_new_messages(
        base_tokenizer):
    tok = with_template(base_tokenizer, HERMES)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    session = Session(tok, "s", "policy")
    messages = [{"role": "user", "content": "What is 37 * 482?"}]
    how, prompt = session.call({"messages": messages, "tools": TOOLS})
    assert how == "prompt" and prompt == tok.encode(session.render(messages))
    sampled = tok.encode(CALL) + [end]  # the model wrote the call as the template renders it
    reply = session.answer(sampled, [-0.5] * len(sampled), "stop", parse_tools=True)
    message = reply["choices"][0]["message"]
    assert reply["choices"][0]["finish_reason"] == "tool_calls" and message["content"] is None
    call = message["tool_calls"][0]
    assert json.loads(call["function"]["arguments"]) == {"expression": "37 * 482"}
    # the SDK sends the message back with its None fields and the arguments as a string
    sdk = {**message, "refusal": None, "function_call": None, "audio": None}
    messages += [sdk, {"role": "tool", "tool_call_id": call["id"], "content": "17834"}]
    how, observation = session.call({"messages": messages, "tools": TOOLS})
    assert how == "continue" and session.branches == 0
    tokens = prompt + sampled + observation
    # where the template renders the turn as sampled: the template's tokens of the conversation
    assert tokens == tok.encode(session.render([normalize(m) for m in messages]))
    assert session.call({"messages": messages[:1], "tools": TOOLS})[0] == "prompt"  # edited


def test_tokens_sampled_in_another_split_are_kept_and_never_re_tokenized(base_tokenizer):
    tok = base_tokenizer  # plain ChatML
    session = Session(tok, "s", "policy")
    messages = [{"role": "user", "content": "Say it."}]
    _, prompt = session.call({"messages": messages})
    sampled = split_ids(tok, "What answer") + [tok.convert_tokens_to_ids("<|im_end|>")]
    reply = session.answer(sampled, None, "stop", parse_tools=False)
    messages += [reply["choices"][0]["message"], {"role": "user", "content": "again"}]
    how, observation = session.call({"messages": messages})
    assert how == "continue"
    full = prompt + sampled + observation  # what the generation loop holds: sampled as is
    assert tok.decode(full) == session.render(messages)  # the same text ...
    assert full != tok.encode(session.render(messages))  # ... not the re-tokenized ids


def test_a_template_that_drops_earlier_think_blocks_starts_a_counted_branch(base_tokenizer):
    tok = with_template(base_tokenizer, DROPS_THINK)
    session = Session(tok, "s", "policy")
    messages = [{"role": "user", "content": "Think, then answer."}]
    session.call({"messages": messages})
    sampled = tok.encode("<think>hmm</think>4") + [tok.convert_tokens_to_ids("<|im_end|>")]
    reply = session.answer(sampled, None, "stop", parse_tools=False)
    messages += [reply["choices"][0]["message"], {"role": "user", "content": "And 2 + 3?"}]
    how, prompt = session.call({"messages": messages})
    # the history as the template now shows it: the earlier turn without its <think>, as a
    # prompt (nothing of the earlier branch is attributed to the model's new turn)
    assert how == "prompt" and session.branches == 1 and session.length == 0
    assert "<think>" not in tok.decode(prompt) and prompt == tok.encode(session.render(messages))


def test_an_edited_history_or_other_tools_start_a_branch(base_tokenizer):
    session = Session(base_tokenizer, "s", "policy")
    messages = [{"role": "user", "content": "Hi"}]
    session.call({"messages": messages})
    reply = session.answer(base_tokenizer.encode("Hello"), None, "length", parse_tools=False)
    assert reply["choices"][0]["finish_reason"] == "length"
    said = reply["choices"][0]["message"]
    edited = [{"role": "user", "content": "Hi"}, {**said, "content": "Hello there"},
              {"role": "user", "content": "?"}]
    assert session.call({"messages": edited})[0] == "prompt" and session.branches == 1
    session.answer(base_tokenizer.encode("Yes"), None, "stop", parse_tools=False)
    later = edited + [session.reply, {"role": "user", "content": "!"}]
    assert session.call({"messages": later, "tools": TOOLS})[0] == "prompt"  # tools changed
    assert session.branches == 2


@pytest.mark.parametrize("body, param", [
    ({"messages": [{"role": "user", "content": "x"}], "stream": True}, "stream"),
    ({"messages": [{"role": "user", "content": "x"}], "n": 2}, "n"),
    ({"messages": [{"role": "user", "content": "x"}], "stop": ["\n"]}, "stop"),
    ({"messages": [{"role": "user", "content": "x"}], "temperature": 0.7}, "temperature"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "max_tokens"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"x": 1}]}, "tools"),
])
def test_calls_the_endpoint_cannot_serve_are_refused_naming_the_parameter(body, param):
    assert request_problem(body, {"temperature": 1.0, "top_p": 1.0})[0] == param


def test_the_runs_own_sampling_and_any_sampling_in_an_evaluation_are_served():
    messages = [{"role": "user", "content": "x"}]
    run = {"temperature": 1.0, "top_p": 1.0}
    assert request_problem({"messages": messages, "temperature": 1.0, "n": 1, "stream": False,
                            "max_tokens": 8, "logprobs": True}, run) is None
    assert request_problem({"messages": messages, "temperature": 0.2}, None) is None
