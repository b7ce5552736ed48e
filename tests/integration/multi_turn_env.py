"""A scripted environment for the multi-turn tests: it answers each model turn with the user
message "go on" until the third turn, then ends; a row whose "how" is "raise" or "hang" makes
its second step raise or sleep past any test's env.step_timeout_s."""
import time

from envs.api import Env, Step

OBSERVATION = [{"role": "user", "content": "go on"}]


class Scripted(Env):
    def reset(self, row: dict) -> list[dict]:
        self.how, self.turns = row.get("how", "ok"), 0
        return super().reset(row)

    def step(self, turn: str) -> Step:
        self.turns += 1
        if self.turns == 2 and self.how == "raise":
            raise RuntimeError("the scripted env broke")
        if self.turns == 2 and self.how == "hang":
            time.sleep(30)
        if self.turns == 3:
            return Step(done=True, info={"scripted_steps": 1})
        return Step(OBSERVATION, info={"scripted_steps": 1})
