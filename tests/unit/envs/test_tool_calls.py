"""Hermes tool calls parsed from a model turn: well-formed calls in order, every malformed one
kept as an error text (answered to the model), the turn's other text kept."""
import pytest

from envs.tool_calls import ToolCall, get_parser, parse_hermes


def call(body: str) -> str:
    return f"<tool_call>\n{body}\n</tool_call>"


def test_calls_in_order_and_the_text_around_them():
    turn = ("Let me compute. " + call('{"name": "calculator", "arguments": {"expression": "3*4"}}')
            + call('{"name": "python", "arguments": {"code": "print(1)"}}') + " Done.")
    parsed = parse_hermes(turn)
    assert parsed.calls == [ToolCall("calculator", {"expression": "3*4"}),
                            ToolCall("python", {"code": "print(1)"})]
    assert parsed.content == "Let me compute.  Done." and parsed.num_errors == 0


def test_no_call_is_an_answer():
    parsed = parse_hermes("The answer is 12.")
    assert parsed.calls == [] and parsed.content == "The answer is 12."


def test_an_unclosed_last_call_still_counts():  # generation stopped at or before the tag
    assert parse_hermes('<tool_call>{"name": "c", "arguments": {}}').calls == [ToolCall("c")]


def test_arguments_given_as_a_json_string_are_read():
    parsed = parse_hermes(call('{"name": "c", "arguments": "{\\"a\\": 1}"}'))
    assert parsed.calls == [ToolCall("c", {"a": 1})]


@pytest.mark.parametrize("body,why", [
    ("not json", "is not JSON"),
    ("[" * 5000, "is not JSON"),  # nested too deep for the parser
    ('["calculator"]', 'has no "name"'),
    ('{"arguments": {}}', 'has no "name"'),
    ('{"name": "c", "arguments": [1]}', 'needs "arguments" as an object'),
    ('{"name": "c", "arguments": {}, "extra": 1}', "no other keys"),
])
def test_malformed_calls_are_errors_that_show_the_format(body, why):
    parsed = parse_hermes("x " + call(body) + call('{"name": "ok", "arguments": {}}'))
    error, good = parsed.calls
    assert isinstance(error, str) and why in error and '<tool_call>{"name"' in error
    assert good == ToolCall("ok") and parsed.num_errors == 1


def test_unknown_formats_are_refused_with_the_known_ones():
    with pytest.raises(ValueError, match="known: hermes"):
        get_parser("mistral")
