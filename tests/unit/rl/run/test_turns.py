"""rl.run.turns.EnvTurns on the tiny model's real tokenizer: prompts with the env's tools,
observations as the chat template's tokens (the conversation's tokens equal the template's
rendering of it), and every way an environment can fail ending only its trajectory."""
import asyncio
import functools
import time

import pytest

from envs.api import Env, Step
from envs.render import observation_ids
from envs.tools import ToolEnv
from rl.data.prompts import env_row, render_prompt
from rl.run.turns import EnvTurns
from rl.schema import DataConfig

CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "37*482"}}\n</tool_call>'


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    from rl.data.models import build_tiny_model

    return AutoTokenizer.from_pretrained(build_tiny_model(
        "tiny-qwen2", out_dir=tmp_path_factory.mktemp("m") / "q"))


def render(tokenizer, messages, **kw):
    return list(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                              **kw)["input_ids"])


def turn(tokenizer, text, end=True):
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return ids + [tokenizer.convert_tokens_to_ids("<|im_end|>")] * end


def test_a_tool_turn_appends_the_templates_tokens_and_an_answer_ends(tokenizer):
    turns = EnvTurns(functools.partial(ToolEnv, tools=["calculator"]), tokenizer, max_turns=4,
                     step_timeout_s=5)
    row = {"prompt": "What is 37*482?"}
    data = DataConfig()
    prompt = render_prompt(tokenizer, row, data, 0, turns.make_env())  # as PromptSet renders it
    turns.remember("g", env_row(row, data, 0))
    state = turns.start("g", 0)
    model = turn(tokenizer, CALL)
    result = turns.step(state, model, "stop")
    assert not result.done and not result.error and result.info["tool_calls"] == 1
    messages = [{"role": "user", "content": row["prompt"]},
                {"role": "assistant", "content": CALL},
                {"role": "tool", "name": "calculator", "content": "17834"}]
    # token in, token out: prompt + sampled + observation == the template's whole rendering
    assert prompt + model + result.observation == render(
        tokenizer, messages, tools=state.env.tools, add_generation_prompt=True)
    # a turn cut by the token limit (no end-of-turn token) gets the closing tokens as well
    cut = turn(tokenizer, CALL, end=False)
    ids = observation_ids(tokenizer, messages[2:], state.env.tools, cut[-1])
    assert tokenizer.decode(ids).startswith("<|im_end|>")
    done = turns.step(state, turn(tokenizer, "The answer is 17834."), "stop")
    assert done.done and not done.truncated and done.observation == []


class Failing(Env):
    def __init__(self, how):
        self.how = how

    def step(self, turn):
        if self.how == "raise":
            raise RuntimeError("the env broke")
        if self.how == "hang":
            time.sleep(3)
        if self.how == "garbage":
            return {"observation": "not a Step"}
        if self.how == "bad_messages":
            return Step(observation=["hello"])
        if self.how == "empty":
            return Step()
        return Step(observation=[{"role": "user", "content": "again"}])


class AsyncEnv(Env):
    async def step(self, turn):
        await asyncio.sleep(0.01)
        return Step(observation=[{"role": "user", "content": f"you said {turn}"}])


# only "hang" waits for its timeout; the others answer at once and get room for a loaded machine
@pytest.mark.parametrize("how,timeout_s,error", [
    ("raise", 30, "env.step: RuntimeError: the env broke"),
    ("hang", 0.2, "env.step: TimeoutError: no answer within 0.2 s"),
    ("garbage", 30, "env.step returned dict, not an envs.api.Step"),
    ("bad_messages", 30, "env.step's observation is not a list of {role, content} messages"),
    ("empty", 30, "env.step returned neither an observation nor done"),
])
def test_a_failing_environment_ends_its_trajectory_with_the_error(tokenizer, how, timeout_s,
                                                                  error):
    turns = EnvTurns(functools.partial(Failing, how), tokenizer, max_turns=4,
                     step_timeout_s=timeout_s)
    turns.remember("g", {"prompt": "hi"})
    result = turns.step(turns.start("g", 0), turn(tokenizer, "hello"), "stop")
    assert result.done and result.error == error and result.info["env_errors"] == 1


def test_max_turns_truncates_and_async_envs_work(tokenizer):
    turns = EnvTurns(AsyncEnv, tokenizer, max_turns=2, step_timeout_s=5)
    turns.remember("g", {"prompt": "hi"})
    state = turns.start("g", 0)
    first = turns.step(state, turn(tokenizer, "one"), "stop")
    assert "you said one" in tokenizer.decode(first.observation) and not first.done
    second = turns.step(state, turn(tokenizer, "two"), "stop")
    assert second.done and second.truncated and second.observation == []


def test_a_turn_cut_on_a_token_that_begins_the_closing_text_is_closed_whole(tokenizer):
    lt = tokenizer("<", add_special_tokens=False)["input_ids"]
    assert len(lt) == 1 and "<|im_end|>".startswith(tokenizer.decode(lt))
    ids = observation_ids(tokenizer, [{"role": "tool", "content": "1"}], None, lt[0])
    assert tokenizer.decode(ids).startswith("<|im_end|>\n<|im_start|>tool")


def test_the_envs_reward_reaches_the_turn_result(tokenizer):
    class Rewarding(Env):
        def step(self, turn):
            return Step(done=True, reward=0.75)

    turns = EnvTurns(Rewarding, tokenizer, max_turns=2, step_timeout_s=5)
    turns.remember("g", {"prompt": "hi"})
    assert turns.step(turns.start("g", 0), turn(tokenizer, "x"), "stop").reward == 0.75
