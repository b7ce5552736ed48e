"""The tools environment and the env registry: schemas for the chat template, every call
answered by one tool message (errors included, so the model can fix them), a turn without a
call ends the trajectory; bad specs are one-line errors naming the spec."""
import textwrap

import pytest

from envs.api import Env, Step
from envs.registry import known_names, resolve
from envs.tools import ToolEnv, resolve_tools

CALC = '<tool_call>{"name": "calculator", "arguments": {"expression": "%s"}}</tool_call>'


def tool_file(tmp_path, body: str) -> str:
    path = tmp_path / "my_tools.py"
    path.write_text(textwrap.dedent(body))
    return str(path)


LOOKUP = '''
    def lookup(city: str, year: int = 2020) -> str:
        """Population of a city.

        Args:
            city: The city's name.
            year: The census year.
        """
        if city == "boom":
            raise RuntimeError("no such census")
        return f"{city}:{year}"
'''


def test_registry_finds_the_builtins_and_refuses_unknown_names():
    assert {"single_turn", "tools"} <= set(known_names())
    assert resolve("tools") is ToolEnv and resolve("single_turn") is Env
    with pytest.raises(ValueError, match="env 'tool' is not registered; known: .*tools"):
        resolve("tool")


def test_an_env_from_a_file_must_have_reset_and_step(tmp_path):
    path = tmp_path / "my_env.py"
    path.write_text("class Good:\n    def reset(self, row): return []\n"
                    "    def step(self, turn): return None\n"
                    "class Bad:\n    def reset(self, row): return []\n")
    assert resolve(f"{path}:Good").__name__ == "Good"
    with pytest.raises(ValueError, match=r"class \(missing step\); subclass envs.api.Env"):
        resolve(f"{path}:Bad")
    with pytest.raises(ValueError, match="has no function or class 'Nope'"):
        resolve(f"{path}:Nope")


def test_single_turn_env_is_done_after_one_turn():
    env = Env()
    assert env.reset({"prompt": "2+2?"}) == [{"role": "user", "content": "2+2?"}]
    assert env.step("4") == Step(done=True)
    with pytest.raises(ValueError, match="no 'prompt'"):
        env.reset({"question": "2+2?"})


def test_every_call_is_answered_in_order_with_errors_for_the_model(tmp_path):
    env = ToolEnv(tools=["calculator", f"{tool_file(tmp_path, LOOKUP)}:lookup"])
    assert [t["function"]["name"] for t in env.tools] == ["calculator", "lookup"]
    assert env.tools[1]["function"]["parameters"]["required"] == ["city"]
    turn = (CALC % "37*482"
            + '<tool_call>{"name": "lookup", "arguments": {"city": "Oslo"}}</tool_call>'
            + '<tool_call>{"name": "lookup", "arguments": {"town": "Oslo"}}</tool_call>'
            + '<tool_call>{"name": "lookup", "arguments": {"city": "boom"}}</tool_call>'
            + '<tool_call>{"name": "search", "arguments": {}}</tool_call>'
            + "<tool_call>{oops</tool_call>" + CALC % "1/0")
    step = env.step(turn)
    assert not step.done and step.reward is None
    texts = [m["content"] for m in step.observation]
    assert all(m["role"] == "tool" for m in step.observation)
    assert texts[:2] == ["17834", "Oslo:2020"]
    assert texts[2] == "error: lookup takes (city, year): no argument 'town'; 'city' missing"
    assert texts[3] == "error: lookup raised RuntimeError: no such census"
    assert texts[4] == "error: there is no tool 'search'; the tools are calculator, lookup"
    assert "is not JSON" in texts[5] and texts[6] == "error: division by zero"
    assert step.info == {"tool_calls": 7, "tool_errors": 5}


def test_a_turn_without_a_call_ends_the_trajectory():
    step = ToolEnv().step("The answer is 17834.")
    assert step.done and step.observation == [] and step.info["tool_calls"] == 0


def test_long_outputs_are_cut(tmp_path):
    spec = tool_file(tmp_path, '''
        def big(n: int) -> str:
            """Many characters.

            Args:
                n: How many.
            """
            return "x" * n
    ''') + ":big"
    env = ToolEnv(tools=[spec], max_output_chars=10)
    out = env.step('<tool_call>{"name": "big", "arguments": {"n": 50}}</tool_call>')
    assert out.observation[0]["content"] == "x" * 10 + "... (50 characters, cut)"


def test_python_runs_in_the_sandbox(tmp_path):
    secret = tmp_path / "host_file"
    secret.write_text("x")
    env = ToolEnv(tools=["python"])
    code = f"import os\\nprint(sum(range(10)), os.path.exists('{secret}'))"
    out = env.step('<tool_call>{"name": "python", "arguments": {"code": "%s"}}</tool_call>' % code)
    assert out.observation[0]["content"] == "45 False\n"  # the host's files are not there
    out = env.step('<tool_call>{"name": "python", "arguments": {"code": "1/0"}}</tool_call>')
    assert out.observation[0]["content"].startswith("error: the program failed")


@pytest.mark.parametrize("specs,why", [
    ((), "give at least one tool"),
    (("calc",), "tool 'calc' is not built in (calculator, python)"),
    (("calculator", "calculator"), "two tools are named 'calculator'"),
])
def test_bad_tool_specs_are_one_line_errors(specs, why):
    with pytest.raises(ValueError, match=why.replace("(", r"\(").replace(")", r"\)")):
        resolve_tools(specs)


def test_a_tool_without_a_documented_signature_is_refused(tmp_path):
    spec = tool_file(tmp_path, "def f(x):\n    return x\n") + ":f"
    with pytest.raises(ValueError, match=r"tool '.*:f': no schema .* type hint"):
        resolve_tools((spec,))


def test_calls_past_the_limit_are_not_run_and_var_keyword_tools_take_any_argument(tmp_path):
    spec = tool_file(tmp_path, '''
        def echo(text: str, **options: bool) -> str:
            """Echo.

            Args:
                text: What to echo.
                options: Flags.
            """
            return text + str(sorted(options))
    ''') + ":echo"
    env = ToolEnv(tools=[spec], max_calls_per_turn=2)
    call = '<tool_call>{"name": "echo", "arguments": {"text": "a", "loud": true}}</tool_call>'
    out = [m["content"] for m in env.step(call * 3).observation]
    assert out[:2] == ["a['loud']"] * 2
    assert out[2] == "error: not run, at most 2 tool calls per turn"
