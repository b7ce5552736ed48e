"""What an environment is: one per trajectory, made from the dataset row, stepped with each
model turn.

    env = Env(**args)                      # the run's env.args; one object per trajectory
    messages = env.reset(row)              # the first prompt's messages
    step = await env.step(turn_text)       # after each model turn: observation, reward, done

The rollout side renders `step.observation` (chat messages: role "tool" or "user") with the
model's chat template, appends those tokens after the model's sampled ones (token in, token
out: the model's tokens are never re-tokenized) and samples the next turn, until `done` or a
limit (turns, tokens). Observation tokens take no part in the loss (`loss_mask` 0).
`step` may be a plain or an `async def`; the caller runs it with a timeout, many
trajectories at once, and a step that raises, hangs or returns something else than a Step
ends that trajectory (counted, its error kept), not the run.
Environments are found like rewards: a built-in name (`ENVS`), an entry point in the group
`rlstack.envs`, `module:Class` or `path/to/file.py:Class` (envs.registry).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from rewards.api import registrar

ENVS: dict[str, type] = {}
register = registrar(ENVS, "env")
"Register a built-in environment class under `name`."


@dataclass
class Step:
    observation: list[dict] = field(default_factory=list)
    "Messages to append before the next model turn ([] when done)."
    reward: float | None = None
    "The trajectory's reward when the env decides it (at done); None: the run's rewards score it."
    done: bool = False
    "The trajectory ends with this model turn."
    info: dict = field(default_factory=dict)
    "Numbers summed over the trajectory's steps into its metrics (e.g. tool_calls, tool_errors)."


class Env:
    """The base: a single-turn env (the row's prompt, done after the first model turn)."""

    tools: list[dict] = []
    "JSON schemas of the tools, for the chat template's `tools=`."

    def reset(self, row: dict) -> list[dict]:
        prompt = row.get("prompt")
        if isinstance(prompt, list):  # already chat messages
            return list(prompt)
        if not isinstance(prompt, str):
            raise ValueError(f"the row has no 'prompt' string or message list: {sorted(row)}")
        return [{"role": "user", "content": prompt}]

    def step(self, turn: str) -> Step:
        return Step(done=True)


register("single_turn")(Env)
