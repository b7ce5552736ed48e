"""Multi-turn rollouts driven by an agent program over the OpenAI API (envs.openai_agent):
rollout.stream's TurnHandler over sessions of this engine's envs.agent_server.

Per trajectory: `start` opens a session and launches the program; `begin` (in a worker thread)
waits for its first call, whose rendering is the trajectory's prompt; after each sampled turn,
`step` returns the reply to the pending call and waits for the program's next move: a call that
continues the session (its new messages' tokens are appended), one that does not (a new
branch: the trajectory restarts from its prompt, `agent/prefix_breaks`), or its end (its
reward, or None for the run's rewards). Every wait is bounded by env.step_timeout_s, so a
program that hangs anywhere (before its first call, between calls, before returning) ends its
trajectory; one that raises or returns something else than a number or None ends it too, with
the error kept; the run goes on. `finish` closes the session: a later call, or one still
pending when a limit ended the trajectory, gets an error.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

from envs.agent_session import Session
from rl.run.turns import EnvTurns, GroupRows, worker_span
from rollout.stream import TurnResult

GREEDY_NOTE = "rlstack-greedy-evaluation"  # system_fingerprint of an evaluation's replies


@dataclass
class _Agent:
    channel: object  # envs.agent_server.Channel
    session: Session
    greedy: bool
    body: dict = field(default_factory=dict)  # the pending call's request


def turn_handler(env_cfg, tokenizer, rollout_cfg, spans=None, server=None):
    """The generation loops' TurnHandler for the run's env (an envs.config.EnvConfig): an
    AgentTurns when it is an agent program (envs.openai_agent; server() gives the engine's
    envs.agent_server.AgentServer), else rl.run.turns.EnvTurns."""
    from envs.openai_agent import OpenAIAgent
    from envs.registry import env_factory

    make_env = env_factory(env_cfg)
    if issubclass(make_env.func, OpenAIAgent):
        return AgentTurns(make_env(), tokenizer, server(), env_cfg.max_turns,
                          env_cfg.turn_max_new_tokens, env_cfg.step_timeout_s,
                          {"temperature": rollout_cfg.temperature, "top_p": rollout_cfg.top_p},
                          spans)
    return EnvTurns(make_env, tokenizer, env_cfg.max_turns, env_cfg.step_timeout_s, spans)


class AgentTurns(GroupRows):
    def __init__(self, env, tokenizer, server, max_turns: int, turn_tokens: int | None,
                 step_timeout_s: float, sampling: dict, spans=None):
        """env: the run's envs.openai_agent.OpenAIAgent (its program); server: this engine's
        envs.agent_server.AgentServer; sampling: the run's {temperature, top_p}; turn_tokens:
        env.turn_max_new_tokens (None: no cap beyond the budget)."""
        super().__init__()
        self.env, self.tokenizer, self.server = env, tokenizer, server
        self.max_turns, self.turn_tokens = max_turns, turn_tokens
        self.step_timeout_s, self.sampling, self.spans = step_timeout_s, sampling, spans

    def start(self, key: object, index: int, greedy: bool = False) -> _Agent:
        return self._open(self.rows[key], greedy)

    def _open(self, row: dict, greedy: bool) -> _Agent:
        channel = self.server.open(None if greedy else self.sampling)
        agent = _Agent(channel, Session(self.tokenizer, channel.id, self.server.model_name),
                       greedy)
        self.server.launch(channel, self.env.program, row)
        return agent

    def finish(self, state: _Agent) -> None:
        self.server.close(state.channel, "the trajectory ended (the program returned, or a "
                                         "limit: env.max_turns, rollout.max_new_tokens)")

    def begin(self, state: _Agent) -> TurnResult:
        with self._span(state):
            return self._next(state, first=True)

    def _span(self, state: _Agent):
        """An `agent program` span on the timeline: the wait for the program's next move."""
        return worker_span(self.spans, "agent program", call=state.session.calls + 1)

    def step(self, state: _Agent, turn_ids: list[int], finish_reason: str,
             logprobs: list[float] | None) -> TurnResult:
        body = state.body
        reply = state.session.answer(
            turn_ids, logprobs if body.get("logprobs") else None, finish_reason,
            parse_tools=self.env.parse_tool_calls and bool(body.get("tools")))
        if state.greedy:  # the evaluator samples greedily, whatever the call asked
            reply["system_fingerprint"] = GREEDY_NOTE
        state.channel.respond(200, reply)
        with self._span(state):
            return self._next(state)

    def _next(self, state: _Agent, first: bool = False) -> TurnResult:
        """The program's next move, as the generation loop's TurnResult."""
        t0 = time.perf_counter()
        try:
            kind, payload = state.channel.next(self.step_timeout_s)
        except TimeoutError as e:
            return TurnResult(done=True, error=f"agent program: {e}",
                              info={"env_seconds": time.perf_counter() - t0, "env_errors": 1})
        info = {"env_seconds": time.perf_counter() - t0}
        failed = {**info, "env_errors": 1}
        if kind == "error":
            return TurnResult(done=True, error=f"agent program raised {type(payload).__name__}: "
                                               f"{payload}", info=failed)
        if kind == "end":
            if first:
                return TurnResult(done=True, error="agent program returned before its first "
                                                   "call", info=failed)
            if payload is not None and (isinstance(payload, bool)
                                        or not isinstance(payload, (int, float))):
                return TurnResult(done=True, error=f"agent program returned "
                                                   f"{type(payload).__name__}, not a number or "
                                                   f"None", info=failed)
            return TurnResult(done=True, reward=payload, info=info)
        if state.session.calls >= self.max_turns:  # the call is refused when the session ends
            return TurnResult(done=True, truncated=True, info=info)
        state.body = payload
        dropped = state.session.length
        how, ids = state.session.call(payload)
        info.update({"agent/calls": 1, "agent/prefix_breaks": 0, "agent/dropped_tokens": 0})
        asked = payload.get("max_completion_tokens") or payload.get("max_tokens")
        limit = min(asked, self.turn_tokens or asked) if asked else None
        if how == "continue":
            return TurnResult(ids, info=info, next_turn_tokens=limit)
        if not first:  # a new branch: the tokens so far are not trained
            info.update({"agent/prefix_breaks": 1, "agent/dropped_tokens": dropped})
        return TurnResult(prompt=ids, info=info, next_turn_tokens=limit)

    def script(self, row: dict, turns: list[str], eos: int) -> tuple[list, list, list]:
        """(prompt ids, token ids, loss mask) of the program's trajectory on `row` when its
        replies are `turns` (each closed with `eos`) instead of samples: a multi-turn
        warm-up's SFT target, rendered exactly as RL renders it."""
        state = self._open(row, greedy=True)
        try:
            result = self.begin(state)
            prompt, ids, mask = result.prompt, [], []
            for k, text in enumerate(turns):
                if result.error:
                    raise ValueError(f"warm-up: the agent program on row {row!r:.80}: "
                                     f"{result.error}")
                turn = self.tokenizer.encode(text, add_special_tokens=False) + [eos]
                ids, mask = ids + turn, mask + [1] * len(turn)
                if k == len(turns) - 1:
                    break
                result = self.step(state, turn, "stop", None)
                if result.done:
                    break
                if result.prompt is not None:
                    prompt, ids, mask = result.prompt, [], []
                ids, mask = ids + result.observation, mask + [0] * len(result.observation)
            return prompt, ids, mask
        finally:
            self.finish(state)


@contextlib.contextmanager
def warmup_script(cfg, tokenizer, prompts):
    """For a multi-turn warm-up of an agent program (env openai_agent, warmup.target_turns):
    script(row index, turns) -> (prompt ids, token ids, loss mask), each (row, turns) run once
    through an endpoint in this process; None for any other run."""
    from envs.openai_agent import OpenAIAgent
    from envs.registry import env_factory

    make_env = env_factory(cfg.env)
    if not cfg.warmup.target_turns or make_env is None or not issubclass(make_env.func,
                                                                          OpenAIAgent):
        yield None
        return
    from envs.agent_server import AgentServer

    server = AgentServer("policy")
    agent = AgentTurns(make_env(), tokenizer, server, cfg.env.max_turns, None,
                       cfg.env.step_timeout_s, {})
    done: dict = {}

    def script(i: int, turns: list[str]):
        key = (i, tuple(turns))
        if key not in done:
            done[key] = agent.script(prompts.env_rows[i], turns, tokenizer.eos_token_id)
        return done[key]

    try:
        yield script
    finally:
        server.stop()
