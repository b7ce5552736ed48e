"""Typed configuration of multi-turn rollouts: the `env:` section of a recipe."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional


@dataclass
class EnvConfig:
    name: Optional[str] = None
    ("The environment each trajectory runs against: a built-in (tools, single_turn), an entry "
     "point of the group rlstack.envs, module:Class or path/to/file.py:Class; None: single-turn "
     "(one model turn per sample, then the reward).")
    tools: List[str] = field(default_factory=list)
    ("name: tools: the tools the model may call: calculator, python (the code sandbox), "
     "module:function or path/to/file.py:function (typed arguments, a docstring with Args:).")
    args: Dict[str, Any] = field(default_factory=dict)
    ("Keyword arguments of the environment class (tools: max_output_chars, "
     "max_calls_per_turn, tool_format).")
    max_turns: int = field(default=4, metadata={"bound": ">= 1"})
    ("Model turns per trajectory at most; one that asks for more is truncated. The token budget "
     "of a trajectory (model and environment tokens together) is rollout.max_new_tokens.")
    turn_max_new_tokens: Optional[int] = field(default=None, metadata={"bound": ">= 1"})
    "Tokens of one model turn at most (None: rollout.max_new_tokens)."
    step_timeout_s: float = field(default=30.0, metadata={"bound": "> 0"})
    ("Seconds one env.step may take; past it the trajectory ends with the error (counted in "
     "env/errors, the text in rollouts.jsonl).")
    num_workers: int = field(default=16, metadata={"bound": ">= 1"})
    "Environment steps run at once per rollout engine (threads beside the engine's loop)."
    train_truncated: bool = True
    ("Train on trajectories a limit cut (turns, tokens): True as any sample; False: their "
     "tokens are masked out of the loss (they still count in their group's reward statistics).")

    def env_args(self) -> dict:
        """The environment class's keyword arguments (tools given under `tools` go in too)."""
        return {**self.args, **({"tools": list(self.tools)} if self.tools else {})}
