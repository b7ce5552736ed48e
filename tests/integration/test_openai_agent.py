"""An OpenAI-SDK agent program trained unchanged (env openai_agent) through rl-train's
controller on the real stack: in the quickstart's colocated sync step and its held-out
evaluation, and in the fully_async pipeline, disaggregated. The tokens trained are, call by call,
the ones the engine sampled and returned to the program (never re-tokenized); the observations
are the template's rendering of the program's new messages; programs that raise, hang or
return garbage end their own trajectory, untrained, and the run goes on."""
import json
from pathlib import Path

import pytest

from envs.render import observation_ids
from rl.config import load_config
from rl.run.agent_turns import GREEDY_NOTE
from rl.run.controller import Controller
from tests.integration.agents import GO_ON, TURN
from tests.integration.test_multi_turn import runs, step_and_evaluate

pytestmark = pytest.mark.slow  # the fast tier: pytest -m "not slow"

ROOT = Path(__file__).parents[2]
PROGRAM = str(Path(__file__).with_name("agents.py")) + ":solve"


def write_rows(tmp: Path, name: str, log: Path, first: int = 0) -> Path:
    hows = ["ok"] * 12 + ["raise", "hang", "garbage", "ok"]
    path = tmp / f"{name}.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"What is {i} + 1?", "q": f"What is {i} + 1?",
                                        "answer": str(i + 1), "how": how, "log": str(log)})
                            + "\n" for i, how in enumerate(hows, start=first)))
    return path


def controller(placements, tmp: Path, recipe: str, *extra: str) -> Controller:
    cfg = load_config(str(ROOT / "recipes" / recipe), [
        "warmup.sft_steps=0", f"data.train_path={write_rows(tmp, 'rows', tmp / 'calls.jsonl')}",
        "env.name=openai_agent", f"env.args={{program: '{PROGRAM}'}}", "env.max_turns=3",
        "env.step_timeout_s=2", "rollout.max_new_tokens=64", "rollout.n=2",
        "rollout.prompts_per_step=16", "trainer.micro_batch_size=16",
        "ray.num_cpus_per_worker=0.5", "run.log_samples=-1", f"run.output_dir={tmp}", *extra])
    c = Controller(cfg, placements=placements)
    c.setup()
    return c


def logged(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_an_openai_sdk_program_trains_on_the_engines_tokens_call_by_call(placements, tmp_path):
    held_out = write_rows(tmp_path, "held_out", tmp_path / "eval_calls.jsonl", 100)
    c = controller(placements, tmp_path, "quickstart.yaml", "run.name=agent_sync",
                   "algorithm.old_logprobs=pass", "trainer.eval_every=1",
                   f"data.eval_path={held_out}", "data.eval_fraction=0", "trainer.eval_k=2",
                   "trainer.total_steps=1")
    samples, metrics = step_and_evaluate(c)
    tok = c.tokenizer
    rows = {s.row: c.prompts.rows[s.row] for s in samples}
    sessions = logged(tmp_path / "calls.jsonl")
    ok = [s for s in samples if rows[s.row]["how"] == "ok"]
    assert len(ok) == 26 and len(sessions) == 28  # the garbage rows logged their calls too
    for s in ok:
        assert s.turns == 3 and not s.env_error and s.trained and s.env_info["agent/calls"] == 3
        # the program's first call is the prompt: the row's question, rendered
        assert s.prompt_ids == c.prompts.prompt_ids[s.row]
        pattern = runs(s.loss_mask)
        assert [v for v, _, _ in pattern] == [1, 0, 1, 0, 1], pattern
        model = [s.response_ids[a:b] for v, a, b in pattern if v]
        # call by call, the trained tokens are the ones the program got back (its own session)
        mine = [x for x in sessions if x["q"] == rows[s.row]["q"] and [c_["tokens"] for c_ in
                x["calls"]] == [[tok.decode([t]) for t in turn] for turn in model]]
        assert len(mine) >= 1, rows[s.row]["q"]
        assert [lp for c_ in mine[0]["calls"] for lp in c_["logprobs"]] == [
            s.rollout_logprobs[i] for i, m in enumerate(s.loss_mask) if m]
        for value, start, end in pattern:  # the program's "go on", as the template renders it
            if not value:
                assert s.response_ids[start:end] == observation_ids(
                    tok, [GO_ON], None, s.response_ids[start - 1])
        # token in, token out: the trainer scores the engine's sampled tokens as it did
        trained = [i for i, m in enumerate(s.loss_mask) if m]
        assert max(abs(s.old_logprobs[i] - s.rollout_logprobs[i]) for i in trained) < 1e-3
        assert all(len(turn) <= TURN for turn in model)  # the call's max_tokens
    for s in samples:
        how = rows[s.row]["how"]
        if how != "ok":
            want = {"raise": "RuntimeError: the agent broke", "hang": "within 2 s",
                    "garbage": "returned str"}[how]
            assert want in s.env_error and not s.trained, (how, s.env_error)
    assert metrics["agent/calls"] > 2 and 0 < metrics["env/failed_frac"] < 1
    assert metrics["sync/logprob_max_abs_diff"] < 1e-3  # the update was synced and checked
    assert metrics["eval/num_prompts"] == 16  # the held-out rows ran the program, greedily
    # before and after the step: each of the 14 rows that finish, greedily (and as many
    # times sampled, for pass@k, which the run samples at its temperature)
    notes = [{x["fingerprint"] for x in s_["calls"]} for s_ in logged(
        tmp_path / "eval_calls.jsonl")]
    trace = json.loads((c.life.run_dir / "timeline.json").read_text())["traceEvents"]
    assert any(e.get("name") == "agent program" for e in trace)
    k = c.cfg.trainer.eval_k
    assert notes.count({GREEDY_NOTE}) == 2 * 14 and notes.count({None}) == 2 * 14 * k


def test_fully_async_pipeline_streams_agent_trajectories_disaggregated(placements, tmp_path):
    c = controller(placements, tmp_path, "quickstart_fully_async.yaml", "run.name=agent_async",
                   "ray.num_cpus_per_rollout_worker=0.5", "run.timeline_steps=0")
    seen = []
    advantages = c.advantages
    c.advantages = lambda samples, rewards: seen.append(samples) or advantages(samples, rewards)
    try:
        metrics = [c.step(k) for k in (1, 2, 3)]
    finally:
        c.life.shutdown()
    bound = c.cfg.pipeline.max_staleness
    assert all(m["rollout/staleness_max"] <= bound for m in metrics), metrics
    for samples in seen:
        ok = [s for s in samples if s.turns == 3]
        # each token keeps the version that sampled it, across the syncs between calls
        assert ok and all(len(s.token_versions) == len(s.response_ids) for s in ok)
        assert all([v for v, _, _ in runs(s.loss_mask)] == [1, 0, 1, 0, 1] for s in ok)
        assert any(s.env_error for s in samples)
