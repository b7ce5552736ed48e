"""rollout.stream.GenerationLoop's bookkeeping, on a scripted engine (the real vLLM engine is in
tests/integration/test_pipeline.py): what a pause does to sequences in flight, and the version
and behavior logprob every token keeps."""
import time
from types import SimpleNamespace

import pytest

from rollout.stream import GenerationLoop


class ScriptedEngine:
    """One token per request per step. Token j of a request is (its prompt length + j) % 97; its
    logprob is -weights (which version of the weights made it shows in the logprob)."""

    def __init__(self):
        self.weights = 0
        self.active = {}  # request id -> [prompt, generated, max_tokens, constraint]
        self.added = []  # (request id, prompt, max_tokens)

    def add_request(self, request_id, prompt, seed, constraint, max_tokens, greedy=False):
        self.active[request_id] = [list(prompt), [], [], max_tokens]
        self.added.append((request_id, list(prompt), max_tokens))

    def step(self):
        time.sleep(0.002)
        outs = []
        for rid, (prompt, tokens, lps, max_tokens) in list(self.active.items()):
            tokens.append((len(prompt) + len(tokens)) % 97)
            lps.append({tokens[-1]: SimpleNamespace(logprob=-float(self.weights))})
            done = len(tokens) == max_tokens
            outs.append(SimpleNamespace(request_id=rid, finished=done, outputs=[SimpleNamespace(
                token_ids=list(tokens), logprobs=list(lps),
                finish_reason="length" if done else None, text=f"t{len(tokens)}")]))
            if done:
                del self.active[rid]
        return outs

    def abort(self, request_ids):
        for rid in request_ids:
            del self.active[rid]

    def decode(self, token_ids):
        return " ".join(map(str, token_ids))


def wait_steps(loop, n):
    deadline = time.time() + 10
    while loop.steps < n:
        assert time.time() < deadline
        time.sleep(0.001)


def collect_all(loop, groups):
    got, deadline = [], time.time() + 10
    while len(got) < groups:
        assert time.time() < deadline, f"{len(got)} of {groups} groups finished"
        got += loop.collect(1)
    return got


@pytest.fixture
def engine():
    return ScriptedEngine()


def test_an_interrupted_sequence_goes_on_under_the_new_version(engine):
    loop = GenerationLoop(engine, version=0, n=2, max_new_tokens=20)
    try:
        assert loop.idle  # nothing submitted yet
        loop.submit([("g", [1, 2, 3], 10, None)])
        wait_steps(loop, 5)
        loop.pause(interrupt=True)
        assert engine.active == {} and not loop.idle  # nothing in the engine, but paused
        cut = loop.steps
        time.sleep(0.05)
        assert loop.steps == cut  # a paused loop does not step
        engine.weights = 1
        loop.resume(1)
        (group,) = collect_all(loop, 1)
        assert loop.idle  # all done: waiting for a submit
    finally:
        loop.stop()
    for c in group["completions"]:
        assert len(c["token_ids"]) == 20 and c["finish_reason"] == "length"
        assert c["token_ids"] == [(3 + j) % 97 for j in range(20)]  # the continuation follows on
        first = c["versions"].index(1)
        assert 0 < first < 20 and c["versions"] == [0] * first + [1] * (20 - first)
        # each token keeps the logprob of the weights that produced it
        assert c["logprobs"] == [0.0] * first + [-1.0] * (20 - first)
        assert c["text"] == " ".join(map(str, c["token_ids"]))  # decoded whole
    # the continuation: prompt + the tokens so far, with the rest of the token budget
    (rid, prompt, budget), = [a for a in engine.added[2:3]]
    assert len(prompt) == 3 + (20 - budget) and prompt[:3] == [1, 2, 3]
    assert loop.take_times()["interrupted"] == 2


def test_a_draining_pause_lets_sequences_finish_under_their_version(engine):
    loop = GenerationLoop(engine, version=0, n=2, max_new_tokens=12)
    try:
        loop.submit([("a", [1], 0, None)])
        wait_steps(loop, 3)
        loop.pause(interrupt=False)
        assert engine.active == {}
        loop.submit([("b", [2, 2], 0, None)])  # waits for the resume
        time.sleep(0.02)
        assert len(engine.added) == 2
        engine.weights = 1
        loop.resume(1)
        groups = {g["key"]: g for g in collect_all(loop, 2)}
    finally:
        loop.stop()
    for c in groups["a"]["completions"]:
        assert c["versions"] == [0] * 12 and c["logprobs"] == [0.0] * 12
    for c in groups["b"]["completions"]:
        assert c["versions"] == [1] * 12


def test_constrained_sequences_are_never_cut(engine):
    loop = GenerationLoop(engine, version=0, n=1, max_new_tokens=15)
    try:
        loop.submit([("json", [1], 0, {"regex": "[0-9]+"})])
        wait_steps(loop, 3)
        loop.submit([("free", [1], 0, None)])
        wait_steps(loop, 6)
        loop.pause(interrupt=True)  # waits for json to finish; free is cut then
        loop.resume(1)
        groups = {g["key"]: g for g in collect_all(loop, 2)}
    finally:
        loop.stop()
    assert set(groups["json"]["completions"][0]["versions"]) == {0}
    assert set(groups["free"]["completions"][0]["versions"]) == {0, 1}


def test_a_failing_engine_reaches_the_caller(engine):
    def broken():
        raise RuntimeError("engine died")

    engine.step = broken
    loop = GenerationLoop(engine, version=0, n=1, max_new_tokens=4)
    loop.submit([("g", [1], 0, None)])
    with pytest.raises(RuntimeError, match="generation loop failed.*engine died"):
        loop.collect(10)


class Turns:
    """Each turn is answered with observation [90 + t, 95] until `turns` turns; group keys
    name how a step behaves ('slow' sleeps, 'boom' raises on the second turn)."""

    def __init__(self, turns=3, next_turn_tokens=None):
        self.turns, self.seen, self.lock = turns, [], __import__("threading").Lock()
        self.next_turn_tokens = next_turn_tokens

    def start(self, key, index, greedy=False):
        return {"key": key, "index": index, "t": 0}

    def step(self, state, turn_ids, finish_reason, logprobs=None):
        from rollout.stream import TurnResult

        state["t"] += 1
        with self.lock:
            self.seen.append((state["key"], state["t"], list(turn_ids)))
        if state["key"] == "slow":
            time.sleep(0.3)
        if state["key"] == "boom" and state["t"] == 2:
            raise ValueError("env broke")
        if state["t"] == self.turns:
            return TurnResult(done=True, info={"tool_calls": 0})
        return TurnResult(observation=[90 + state["t"], 95], info={"tool_calls": 1},
                          next_turn_tokens=self.next_turn_tokens)


def test_turns_alternate_with_observations_that_the_loss_mask_leaves_out(engine):
    handler = Turns(turns=3)
    loop = GenerationLoop(engine, version=0, n=1, max_new_tokens=50, turns=handler,
                          turn_tokens=3)
    try:
        loop.submit([("g", [1, 2], 0, None)])
        (group,) = collect_all(loop, 1)
    finally:
        loop.stop()
    c = group["completions"][0]
    # turn 1 from the 2-token prompt, then [91, 95], turn 2 from 2 + 5 tokens, [92, 95], turn 3
    assert c["token_ids"] == [2, 3, 4, 91, 95, 7, 8, 9, 92, 95, 12, 13, 14]
    assert c["loss_mask"] == [1, 1, 1, 0, 0, 1, 1, 1, 0, 0, 1, 1, 1]
    assert c["logprobs"] == [0.0] * 13 and len(c["versions"]) == 13
    assert c["turns"] == 3 and c["info"] == {"tool_calls": 2} and not c["error"]
    assert c["text"] == "12 13 14"  # the last model turn
    # each turn's request: the prompt and everything so far, at most turn_tokens new tokens
    assert [(p, m) for _, p, m in engine.added] == [
        ([1, 2], 3), ([1, 2, 2, 3, 4, 91, 95], 3), ([1, 2, 2, 3, 4, 91, 95, 7, 8, 9, 92, 95], 3)]
    assert [ids for _, _, ids in handler.seen] == [[2, 3, 4], [7, 8, 9], [12, 13, 14]]


def test_a_slow_environment_holds_up_only_its_own_trajectory(engine):
    handler = Turns(turns=3)
    loop = GenerationLoop(engine, version=0, n=1, max_new_tokens=50, turns=handler,
                          turn_tokens=2)
    try:
        loop.submit([("slow", [1], 0, None), ("fast", [1], 0, None)])
        first = collect_all(loop, 1)
        assert first[0]["key"] == "fast"  # all three turns while 'slow' waited on its env
        collect_all(loop, 1)
    finally:
        loop.stop()
    fast = [t for key, t, _ in handler.seen if key == "fast"]
    assert fast == [1, 2, 3]


def test_a_failing_environment_ends_its_trajectory_and_the_budget_truncates(engine):
    loop = GenerationLoop(engine, version=0, n=1, max_new_tokens=9, turns=Turns(turns=5),
                          turn_tokens=3)
    try:
        loop.submit([("boom", [1], 0, None), ("long", [1], 0, None)])
        groups = {g["key"]: g["completions"][0] for g in collect_all(loop, 2)}
    finally:
        loop.stop()
    boom, long = groups["boom"], groups["long"]
    assert boom["error"] == "ValueError: env broke" and boom["turns"] == 2
    assert len(boom["token_ids"]) == 3 + 2 + 3 and not boom["truncated"]
    # 3 + 2 + 3 tokens, then another observation would leave no room for a model token
    assert long["truncated"] and long["finish_reason"] == "length" and not long["error"]
    assert long["loss_mask"] == [1, 1, 1, 0, 0, 1, 1, 1]


def test_a_sync_cuts_a_turn_which_goes_on_under_the_new_version(engine):
    loop = GenerationLoop(engine, version=0, n=1, max_new_tokens=40, turns=Turns(turns=2),
                          turn_tokens=10)
    try:
        loop.submit([("g", [1], 0, None)])
        wait_steps(loop, 4)
        loop.pause(interrupt=True)
        engine.weights = 1
        loop.resume(1)
        (group,) = collect_all(loop, 1)
    finally:
        loop.stop()
    c = group["completions"][0]
    assert c["loss_mask"] == [1] * 10 + [0, 0] + [1] * 10  # the cut turn still has 10 tokens
    assert c["versions"][0] == 0 and c["versions"][-1] == 1


def test_the_environment_may_set_the_next_turns_token_limit(engine):
    loop = GenerationLoop(engine, version=0, n=1, max_new_tokens=50,
                          turns=Turns(turns=3, next_turn_tokens=2), turn_tokens=4)
    try:
        loop.submit([("g", [1], 0, None)])
        (group,) = collect_all(loop, 1)
    finally:
        loop.stop()
    assert [m for _, _, m in engine.added] == [4, 2, 2]
    assert group["completions"][0]["loss_mask"] == [1] * 4 + [0, 0, 1, 1] + [0, 0, 1, 1]


class Odd:
    """A turn handler whose answers are wrong in the way its group key says."""

    def start(self, key, index, greedy=False):
        return key

    def step(self, key, turn_ids, finish_reason, logprobs=None):
        from rollout.stream import TurnResult

        if key == "text_info":
            return TurnResult(observation=[1], info={"tool": "calc"})
        if key == "no_tokens":
            return TurnResult(observation=None)
        if key == "cancelled":
            raise __import__("asyncio").CancelledError()
        if key == "zero_budget":
            return TurnResult(observation=[1], next_turn_tokens=0)
        return TurnResult(done=True, reward=0.5)


def test_a_bad_answer_of_the_turn_handler_ends_its_trajectory_never_loses_it(engine):
    loop = GenerationLoop(engine, version=0, n=1, max_new_tokens=20, turns=Odd(), turn_tokens=2)
    keys = ["text_info", "no_tokens", "cancelled", "zero_budget", "fine"]
    try:
        loop.submit([(k, [1], 0, None) for k in keys])
        got = {g["key"]: g["completions"][0] for g in collect_all(loop, len(keys))}
    finally:
        loop.stop()
    assert "is not a dict of numbers" in got["text_info"]["error"]
    assert "not a list of token ids" in got["no_tokens"]["error"]
    assert got["cancelled"]["error"].startswith("CancelledError")
    assert got["zero_budget"]["truncated"] and not got["zero_budget"]["error"]
    assert got["fine"]["env_reward"] == 0.5 and not got["fine"]["error"]


class Branching(Turns):
    """A handler that makes each trajectory's first prompt itself (`begin`), restarts it from a
    new prompt after its first turn (a branch), ends it after the second, and is told each
    trajectory's end (`finish`); group 'hang' never answers its first turn."""

    def __init__(self):
        super().__init__(turns=2)
        self.finished = []

    def begin(self, state):
        from rollout.stream import TurnResult

        return TurnResult(prompt=[7, 7, 7], next_turn_tokens=2)

    def step(self, state, turn_ids, finish_reason, logprobs=None):
        from rollout.stream import TurnResult

        if state["key"] == "hang":
            time.sleep(0.5)
        state["t"] += 1
        if state["t"] == 1:
            return TurnResult(prompt=[5, 5], info={"branches": 1})
        return TurnResult(done=True, reward=1.0)

    def finish(self, state):
        with self.lock:
            self.finished.append(state["key"])


def test_a_handler_makes_the_prompt_restarts_a_branch_and_hears_every_end(engine):
    handler = Branching()
    loop = GenerationLoop(engine, version=0, n=1, max_new_tokens=50, turns=handler,
                          turn_tokens=3)
    try:
        loop.submit([("g", [1, 2], 0, None), ("hang", [1, 2], 0, None)])
        (group,) = collect_all(loop, 1)
    finally:
        loop.stop()  # 'hang' is still in its env step: it ends with the loop
    c = group["completions"][0]
    # the first turn from begin's prompt (2 tokens: its next_turn_tokens), then the branch: the
    # trajectory is the second prompt and what was sampled from it, nothing of the first
    assert [(p, m) for _, p, m in engine.added[:1]] == [([7, 7, 7], 2)]
    assert c["prompt_ids"] == [5, 5] and c["token_ids"] == [2, 3, 4] and c["loss_mask"] == [1] * 3
    assert c["env_reward"] == 1.0 and c["info"] == {"branches": 1}
    assert sorted(handler.finished) == ["g", "hang"]
