"""rl.run.agent_turns.AgentTurns over a real envs.agent_server endpoint (uvicorn, the openai
SDK), the sampled turns given by hand in place of an engine: a program's calls become the
trajectory's prompt and observations and its return value the reward; a program that raises,
hangs or returns garbage ends its own trajectory only; a session that has ended refuses calls;
two sessions stepped interleaved never see each other's replies."""
import asyncio
import time
import types

import pytest

from envs.agent_server import AgentServer
from rl.run.agent_turns import GREEDY_NOTE, AgentTurns

SAMPLING = {"temperature": 1.0, "top_p": 1.0}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    from rl.data.models import build_tiny_model

    return AutoTokenizer.from_pretrained(build_tiny_model(
        "tiny-qwen2", out_dir=tmp_path_factory.mktemp("m") / "q"))


@pytest.fixture(scope="module")
def server():
    s = AgentServer("policy")
    yield s
    s.stop()


def turns_for(program, tokenizer, server, timeout_s=30.0, max_turns=4):
    env = types.SimpleNamespace(program=program, parse_tool_calls=True)
    return AgentTurns(env, tokenizer, server, max_turns, 16, timeout_s, SAMPLING)


def ids(tokenizer, text):
    return tokenizer.encode(text) + [tokenizer.convert_tokens_to_ids("<|im_end|>")]


async def chat(client, row):
    """Two calls: the row's question, then "and again?" after the reply; reward: whether the
    second reply repeats the first."""
    messages = [{"role": "user", "content": row["q"]}]
    first = await client.chat.completions.create(model="policy", messages=messages,
                                                 max_tokens=8, logprobs=True)
    messages += [first.choices[0].message, {"role": "user", "content": "and again?"}]
    second = await client.chat.completions.create(model="policy", messages=messages)
    row["seen"] = [first.choices[0].message.content, second.choices[0].message.content,
                   second.system_fingerprint, len(first.choices[0].logprobs.content)]
    return float(first.choices[0].message.content == second.choices[0].message.content)


def test_a_programs_calls_are_its_trajectory_and_its_return_value_the_reward(tokenizer, server):
    turns = turns_for(chat, tokenizer, server)
    row = {"q": "Say yes."}
    turns.remember("g", row)
    state = turns.start("g", 0)
    begin = turns.begin(state)
    assert begin.prompt == tokenizer.apply_chat_template(
        [{"role": "user", "content": "Say yes."}], add_generation_prompt=True, tokenize=True,
        return_dict=True)["input_ids"] and begin.next_turn_tokens == 8
    turn = ids(tokenizer, "yes")
    nxt = turns.step(state, turn, "stop", [-0.1] * len(turn))
    assert nxt.prompt is None and tokenizer.decode(nxt.observation) == (
        "\n<|im_start|>user\nand again?<|im_end|>\n<|im_start|>assistant\n")
    assert nxt.info["agent/calls"] == 1 and nxt.next_turn_tokens is None
    end = turns.step(state, ids(tokenizer, "yes"), "stop", [0.0] * 4)
    assert end.done and end.reward == 1.0 and not end.error
    assert row["seen"] == ["yes", "yes", None, len(turn)]
    turns.finish(state)


async def raises(client, row):
    await client.chat.completions.create(model="policy", messages=[
        {"role": "user", "content": "x"}])
    raise RuntimeError("the agent broke")


async def hangs(client, row):
    await asyncio.sleep(60)


async def garbage(client, row):
    await client.chat.completions.create(model="policy", messages=[
        {"role": "user", "content": "x"}])
    return "yes"


def early(client, row):  # a plain def, returning before any call
    return 1.0


# the timeout fires for `hangs` only (its wait is the test's time); the others' calls arrive
# long before theirs, however loaded the machine (a healthy first call takes 3-45 ms here, and
# a CI machine ran 4-8x slower than this one beside the suite's early runs)
@pytest.mark.parametrize("program, first, timeout_s, why", [
    (raises, False, 30.0, "agent program raised RuntimeError: the agent broke"),
    (hangs, True, 1.0, "made no call and did not return within 1 s"),
    (garbage, False, 30.0, "agent program returned str, not a number or None"),
    (early, True, 30.0, "agent program returned before its first call"),
])
def test_a_failing_program_ends_its_own_trajectory_with_the_error(tokenizer, server, program,
                                                                   first, timeout_s, why):
    turns = turns_for(program, tokenizer, server, timeout_s=timeout_s)
    turns.remember("g", {})
    state = turns.start("g", 0)
    result = turns.begin(state)
    if not first:
        assert result.prompt and not result.error
        result = turns.step(state, ids(tokenizer, "ok"), "stop", None)
    assert result.done and why in result.error and result.info["env_errors"] == 1
    turns.finish(state)


def test_a_session_that_has_ended_refuses_calls(tokenizer, server):
    import openai

    kept = {}

    def keep(client, row):
        for _ in range(2):
            try:
                client.chat.completions.create(model="policy", messages=[
                    {"role": "user", "content": "x"}])
            except openai.BadRequestError as e:
                kept["refused"] = str(e)

    turns = turns_for(keep, tokenizer, server, max_turns=1)
    turns.remember("g", {})
    state = turns.start("g", 0)
    assert turns.begin(state).prompt
    # past env.max_turns calls: truncated, the pending call refused when the session closes
    nxt = turns.step(state, ids(tokenizer, "a"), "stop", None)
    assert nxt.done and not nxt.error
    turns.finish(state)
    end = time.monotonic() + 30  # the refusal crosses the server's loop and the program's thread
    while "refused" not in kept and time.monotonic() < end:
        time.sleep(0.01)
    assert "has ended" in kept["refused"]  # the pending call
    later = openai.OpenAI(base_url=state.channel.url, api_key="x", max_retries=0)
    with pytest.raises(openai.NotFoundError, match="has ended"):
        later.chat.completions.create(model="policy", messages=[
            {"role": "user", "content": "x"}])
    assert [m.id for m in later.models.list()] == ["policy"]


def test_interleaved_sessions_see_only_their_own_replies(tokenizer, server):
    turns = turns_for(chat, tokenizer, server)
    rows = {k: {"q": f"Say {k}."} for k in "ab"}
    states = {}
    for k, row in rows.items():
        turns.remember(k, row)
        states[k] = turns.start(k, 0, greedy=k == "b")
        assert turns.begin(states[k]).prompt
    said = {"a": ["one", "one"], "b": ["two", "three"]}
    turns.step(states["b"], ids(tokenizer, said["b"][0]), "stop", [0.0] * 2)
    turns.step(states["a"], ids(tokenizer, said["a"][0]), "stop", [0.0] * 2)
    ends = {k: turns.step(states[k], ids(tokenizer, said[k][1]), "stop", None) for k in "ab"}
    assert ends["a"].reward == 1.0 and ends["b"].reward == 0.0
    assert rows["a"]["seen"][:3] == ["one", "one", None]
    assert rows["b"]["seen"][:3] == ["two", "three", GREEDY_NOTE]  # greedy: it says so
    for state in states.values():
        turns.finish(state)


def test_a_call_with_another_temperature_is_refused_in_training(tokenizer, server):
    import openai

    async def hot(client, row):
        try:
            await client.chat.completions.create(model="policy", temperature=0.3, messages=[
                {"role": "user", "content": "x"}])
        except openai.BadRequestError as e:
            return 1.0 if "rollout.temperature" in str(e) else 0.0
        return -1.0

    turns = turns_for(hot, tokenizer, server)
    turns.remember("g", {})
    result = turns.begin(turns.start("g", 0))
    assert result.done and result.error == "agent program returned before its first call"


def test_the_recipes_agent_scripted_for_the_warm_up_renders_as_the_tools_env(tmp_path, server):
    """The warm-up's SFT target of recipes/quickstart_openai_agent.yaml (its program, replies
    scripted) is token for token the tools quickstart's (the calculator env's)."""
    from transformers import AutoTokenizer

    from envs.config import EnvConfig
    from envs.openai_agent import OpenAIAgent
    from envs.registry import env_factory
    from rl.data.models import build_tiny_model
    from rl.data.warmup import scripted_trajectory

    tok = AutoTokenizer.from_pretrained(build_tiny_model("tiny-qwen2-tools",
                                                         out_dir=tmp_path / "t"))
    program = OpenAIAgent("recipes/agents/calculator_agent.py:solve")
    turns = AgentTurns(program, tok, server, 3, None, 10.0, SAMPLING)
    row = {"prompt": [{"role": "user", "content": "What is 47 * 386?"}], "answer": "18142"}
    script = ['<tool_call>\n{"name": "calculator", "arguments": {"expression": "47 * 386"}}\n'
              '</tool_call>', "18152"]
    prompt, ids, mask = turns.script(row, script, tok.eos_token_id)
    want_ids, want_mask = scripted_trajectory(
        env_factory(EnvConfig(name="tools", tools=["calculator"])), row, script, tok)
    assert prompt == tok.apply_chat_template(row["prompt"], add_generation_prompt=True,
                                             tokenize=True, return_dict=True)["input_ids"]
    assert (ids, mask) == (want_ids, want_mask) and "18142" in tok.decode(ids)
