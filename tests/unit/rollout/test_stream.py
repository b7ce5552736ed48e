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

    def add_request(self, request_id, prompt, seed, constraint, max_tokens):
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
        loop.submit([("g", [1, 2, 3], 10, None)])
        wait_steps(loop, 5)
        loop.pause(interrupt=True)
        assert engine.active == {}  # nothing left in the engine while paused
        cut = loop.steps
        time.sleep(0.05)
        assert loop.steps == cut  # a paused loop does not step
        engine.weights = 1
        loop.resume(1)
        (group,) = collect_all(loop, 1)
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
