"""Multi-turn rollouts: rollout.stream's TurnHandler over an envs/ environment.

One environment per trajectory, made from the dataset row at submit (`start`); after each
model turn (`step`, in the generation loop's worker thread) the turn's text goes to
`env.step` under a timeout, and the observation messages come back as the chat template's
tokens (envs.render). An environment that raises, hangs past the timeout or returns something
else than an envs.api.Step ends its trajectory with the error kept; the run goes on.
"""
from __future__ import annotations

import asyncio
import contextlib
import inspect
import threading
import time
from dataclasses import dataclass

from envs.api import Env, Step
from envs.render import observation_ids
from rollout.stream import TurnResult


@dataclass
class _Trajectory:
    env: Env
    turns: int = 0


def call_with_timeout(fn, arg, timeout_s: float):
    """fn(arg) (awaited when it is a coroutine function) in a daemon thread; raises
    TimeoutError past timeout_s (the thread is left to finish on its own: Python cannot kill
    it, and it holds no lock of ours)."""
    box: dict = {}

    def run():
        try:
            out = fn(arg)
            box["value"] = asyncio.run(out) if inspect.isawaitable(out) else out
        except BaseException as e:  # handed to the caller
            box["error"] = e

    thread = threading.Thread(target=run, daemon=True, name="env-call")
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise TimeoutError(f"no answer within {timeout_s:g} s")
    if "error" in box:
        raise box["error"]
    return box["value"]


def _problem(step) -> str:
    """What is wrong with an env's return value ('' when it is a well-formed Step)."""
    if not isinstance(step, Step):
        return f"env.step returned {type(step).__name__}, not an envs.api.Step"
    if not isinstance(step.observation, list) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str) for m in step.observation):
        return "env.step's observation is not a list of {role, content} messages"
    if not step.done and not step.observation:
        return "env.step returned neither an observation nor done"
    return ""


def check_env(make_env, tokenizer) -> None:
    """Make the run's environment once (make_env: envs.registry.env_factory's) and render an
    observation with the model's chat template: raises ValueError/TypeError with the reason
    (the caller names the key)."""
    env = make_env()
    observation_ids(tokenizer, [{"role": "tool", "content": "0"}], env.tools or None, None)


def worker_span(spans, name: str, **args):
    """A span on the timeline (timeline.json) for what a generation loop's worker thread does
    now, in a lane of its own (the pool's worker index); a no-op without `spans`."""
    if spans is None:
        return contextlib.nullcontext()
    lane = threading.current_thread().name.rpartition("_")[2]
    return spans.span(name, lane=1 + int(lane) if lane.isdigit() else 1, **args)


class GroupRows:
    """The rows the trajectories of each submitted group start from: `remember(key, row)` at
    submit (rl.data.prompts' env_row), `forget(key)` once the group is done."""

    def __init__(self):
        self.rows: dict[object, dict] = {}

    def remember(self, key: object, row: dict) -> None:
        self.rows[key] = row

    def forget(self, key: object) -> None:
        self.rows.pop(key, None)


class EnvTurns(GroupRows):
    """Made once per generation loop: each trajectory of group `key` resets its environment
    with the row remembered for it."""

    def __init__(self, make_env, tokenizer, max_turns: int, step_timeout_s: float,
                 spans=None):
        """make_env: a callable making one environment (env_factory); spans: an
        rl.observe.timeline.Spans that records each env step (timeline.json)."""
        super().__init__()
        self.make_env, self.tokenizer = make_env, tokenizer
        self.max_turns, self.step_timeout_s, self.spans = max_turns, step_timeout_s, spans

    def start(self, key: object, index: int, greedy: bool = False) -> _Trajectory:
        env = self.make_env()
        env.reset(self.rows[key])
        return _Trajectory(env)

    def step(self, state: _Trajectory, turn_ids: list[int], finish_reason: str,
             logprobs: list[float] | None = None) -> TurnResult:
        with worker_span(self.spans, "env step", turn=state.turns + 1):
            return self._step(state, turn_ids)

    def _step(self, state: _Trajectory, turn_ids: list[int]) -> TurnResult:
        state.turns += 1
        text = self.tokenizer.decode(turn_ids, skip_special_tokens=True)
        t0 = time.perf_counter()
        try:
            step = call_with_timeout(state.env.step, text, self.step_timeout_s)
        except Exception as e:
            return TurnResult(done=True, error=f"env.step: {type(e).__name__}: {e}",
                              info={"env_seconds": time.perf_counter() - t0, "env_errors": 1})
        info = {"env_seconds": time.perf_counter() - t0}
        problem = _problem(step)
        if problem:
            return TurnResult(done=True, error=problem, info={**info, "env_errors": 1})
        info.update({k: v for k, v in step.info.items() if isinstance(v, (int, float))})
        reward = step.reward if isinstance(step.reward, (int, float)) else None
        if step.done:
            return TurnResult(done=True, info=info, reward=reward)
        if state.turns >= self.max_turns:  # the model asked for more than the limit allows
            return TurnResult(done=True, truncated=True, info=info)
        tools = getattr(state.env, "tools", None) or None
        return TurnResult(observation_ids(self.tokenizer, step.observation, tools,
                                          turn_ids[-1] if turn_ids else None), info=info)
