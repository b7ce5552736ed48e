"""The `tools` environment: the model calls tools and reads their results before it answers.

    env: {name: tools, args: {tools: [calculator, python, my_tools.py:lookup]}}

Each tool is a function `fn(**arguments) -> str`: a built-in (`calculator`, `python`), or
`module:function` / `path/to/file.py:function` with type hints and a docstring with an
`Args:` section (its schema comes from them, as transformers' `get_json_schema` makes it).
Each model turn's calls (`envs.tool_calls`, Hermes format) are answered in order, each by one
"tool" message; a call that does not parse, names no tool, has wrong arguments or raises is
answered with the error, so the model can fix it; a turn without a call ends the trajectory
(the run's rewards score its last answer).
"""
from __future__ import annotations

import functools
import inspect
from typing import Callable

from envs.api import Env, Step, register
from envs.calculator import calculator
from envs.tool_calls import ToolCall, get_parser


def python(code: str) -> str:
    """Run a Python program and return what it prints (stdout).

    Args:
        code: The program; print the values you need.
    """
    from rewards.cases import read_answers
    from rewards.sandbox import Limits, run_isolated

    limits, case = Limits(timeout_s=PYTHON_TIMEOUT_S), [{"stdin": ""}]
    run = run_isolated(code, {"timeout_s": limits.timeout_s, "cases": case}, limits)
    answer = read_answers(run.answers, case).get(0)
    if answer is None or "error" in answer:
        why = answer["error"] if answer else "no answer"
        return f"error: the program failed, or ran past {PYTHON_TIMEOUT_S:g} s ({why})"
    return answer["stdout"]


PYTHON_TIMEOUT_S = 5.0  # code_exec's default per call


BUILTIN_TOOLS: dict[str, Callable[..., str]] = {"calculator": calculator, "python": python}


def schema(fn: Callable, spec: str) -> dict:
    """The function's JSON schema for the chat template, or a one-line error naming `spec`."""
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(fn)
    except Exception as e:  # transformers raises its own TypeErrors/ValueErrors here
        raise ValueError(f"tool '{spec}': no schema from its signature and docstring ({e}); "
                         f"give every argument a type hint and the docstring an Args: section"
                         ) from None


@functools.lru_cache(maxsize=None)
def resolve_tools(specs: tuple[str, ...]) -> dict[str, tuple[Callable, dict]]:
    """name -> (function, schema) of each tool spec (once per run: cached)."""
    from rewards.registry import from_spec

    if not specs:
        raise ValueError("env tools: give at least one tool (calculator, python, "
                         "module:function or path/to/file.py:function)")
    out = {}
    for spec in specs:
        if spec in BUILTIN_TOOLS:
            fn = BUILTIN_TOOLS[spec]
            if spec == "python":  # refused now, with the fix, if programs cannot be isolated
                from rewards.sandbox import check_isolation

                check_isolation()
        elif ":" in spec:
            fn = from_spec(spec, kind="tool")
        else:
            raise ValueError(f"tool '{spec}' is not built in ({', '.join(BUILTIN_TOOLS)}); "
                             f"give module:function or path/to/file.py:function")
        entry = schema(fn, spec)
        name = entry["function"]["name"]
        if name in out:
            raise ValueError(f"two tools are named '{name}'; rename one")
        out[name] = (fn, entry)
    return out


@register("tools")
class ToolEnv(Env):
    """Tool calls answered until a turn has none (or the rollout's limits end it)."""

    def __init__(self, tools: list[str] | tuple[str, ...] = ("calculator",),
                 tool_format: str = "hermes", max_output_chars: int = 2000,
                 max_calls_per_turn: int = 8):
        self._tools = resolve_tools(tuple(tools))
        self._parse = get_parser(tool_format)
        self.max_output_chars, self.max_calls_per_turn = max_output_chars, max_calls_per_turn
        self.tools = [entry for _, entry in self._tools.values()]

    def call(self, call: ToolCall | str) -> tuple[str, bool]:
        """(the tool message's text, whether it is an error) for one parsed call."""
        if isinstance(call, str):
            return f"error: {call}", True
        if call.name not in self._tools:
            return (f"error: there is no tool '{call.name}'; the tools are "
                    f"{', '.join(self._tools)}"), True
        fn, _ = self._tools[call.name]
        params = inspect.signature(fn).parameters
        named = {n: p for n, p in params.items()
                 if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
        takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
        unknown = [] if takes_any else sorted(set(call.arguments) - set(named))
        missing = [n for n, p in named.items()
                   if p.default is p.empty and n not in call.arguments]
        if unknown or missing:
            why = "; ".join([f"no argument {', '.join(map(repr, unknown))}"] * bool(unknown)
                            + [f"{', '.join(map(repr, missing))} missing"] * bool(missing))
            return f"error: {call.name} takes ({', '.join(params)}): {why}", True
        try:
            out = fn(**call.arguments)
        except Exception as e:  # the tool's own failure is the model's observation
            return f"error: {call.name} raised {type(e).__name__}: {e}", True
        text = out if isinstance(out, str) else str(out)
        if len(text) > self.max_output_chars:
            text = text[:self.max_output_chars] + f"... ({len(text)} characters, cut)"
        return text, text.startswith("error:")

    def step(self, turn: str) -> Step:
        parsed = self._parse(turn)
        if not parsed.calls:
            return Step(done=True, info={"tool_calls": 0, "tool_errors": 0})
        observation, errors = [], 0
        for k, call in enumerate(parsed.calls):
            if k < self.max_calls_per_turn:
                text, failed = self.call(call)
            else:  # not run: a turn of hundreds of calls would hold the env step for minutes
                text, failed = (f"error: not run, at most {self.max_calls_per_turn} tool calls "
                                f"per turn"), True
            errors += failed
            name = call.name if isinstance(call, ToolCall) else "error"
            observation.append({"role": "tool", "name": name, "content": text})
        return Step(observation, info={"tool_calls": len(parsed.calls), "tool_errors": errors})
