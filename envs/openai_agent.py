"""`openai_agent`: any agent program written against the OpenAI chat-completions API, trained
unchanged.

    env: {name: openai_agent, args: {program: my_agent.py:solve}}   # or module:function

    async def solve(client, row):            # client: an openai.AsyncOpenAI (a plain def gets
        reply = await client.chat.completions.create(   # an openai.OpenAI)
            model="policy", messages=[...], tools=[...])
        ...                                   # as many calls as it likes, its own tools
        return 1.0                            # its reward, or None: the run's rewards score
                                              # the last reply with the row

Each trajectory runs the program once, with a client whose base_url is a session of its own on
the rollout engine (envs.agent_server); each call is sampled by the engine's generation loop
and its tokens kept exactly (envs.agent_session: continuation, branches). The rollout side is
rl.run.agent_turns; this class is what the config names (the program is loaded, and its
signature checked, before Ray starts), and its `reset` renders the row's prompt as a
single-turn run would (the program's own first call is each trajectory's real prompt).
"""
from __future__ import annotations

import inspect

from envs.api import Env, Step, register


def load_program(spec: str):
    """The program `spec` names (path/to/file.py:function or module:function), checked to take
    (client, row)."""
    from rewards.registry import from_spec

    if not isinstance(spec, str) or ":" not in spec:
        raise ValueError(f"env.args.program={spec!r}: give the agent program as "
                         f"path/to/file.py:function or module:function (async def "
                         f"solve(client, row))")
    program = from_spec(spec, kind="agent program")
    try:
        inspect.signature(program).bind(None, None)
    except (TypeError, ValueError):
        raise ValueError(f"env.args.program={spec!r}: the program must take (client, row)"
                         ) from None
    return program


@register("openai_agent")
class OpenAIAgent(Env):
    def __init__(self, program: str | None = None, parse_tool_calls: bool = True):
        """program: path/to/file.py:function or module:function; parse_tool_calls: a reply's
        Hermes <tool_call> blocks come back as message.tool_calls when the call gave tools."""
        self.program = load_program(program)
        self.parse_tool_calls = parse_tool_calls

    def step(self, turn: str) -> Step:
        raise RuntimeError("openai_agent trajectories are driven by their program "
                           "(rl.run.agent_turns), not stepped turn by turn")
