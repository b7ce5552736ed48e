"""Multi-turn rollouts through rl-train's controller on the real stack (the quickstart's
colocated placement; the async one_step pipeline disaggregated): 3-turn trajectories whose
model tokens are the engine's samples (the trainer's logprobs equal the engine's) and whose
observation tokens are the chat template's; environments that raise or hang end their own
trajectory, untrained, while the step, its sync and the held-out evaluation go on."""
import json
from pathlib import Path

import pytest

from envs.render import observation_ids
from rl.config import load_config
from rl.run.controller import Controller

pytestmark = pytest.mark.slow  # the fast tier: pytest -m "not slow"

ROOT = Path(__file__).parents[2]
ENV = str(Path(__file__).with_name("multi_turn_env.py")) + ":Scripted"
TURN = 4  # tokens of one model turn at most


def write_rows(tmp: Path, name: str = "rows", first: int = 0) -> Path:
    """Rows: most run the full script; two raise in their second step, two hang in it."""
    hows = ["ok"] * 12 + ["raise", "hang"] * 2
    path = tmp / f"{name}.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"What is {i} + 1?", "answer": str(i + 1),
                                        "how": how}) + "\n"
                            for i, how in enumerate(hows, start=first)))
    return path


def runs(mask: list[int]) -> list[tuple[int, int, int]]:
    """(value, start, end) of each run of equal values."""
    out, start = [], 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            out.append((mask[start], start, i))
            start = i
    return out


def controller(placements, tmp: Path, recipe: str, *extra: str) -> Controller:
    cfg = load_config(str(ROOT / "recipes" / recipe), [
        "warmup.sft_steps=0", f"data.train_path={write_rows(tmp)}", f"env.name={ENV}",
        "env.max_turns=3", f"env.turn_max_new_tokens={TURN}", "env.step_timeout_s=2",
        "rollout.max_new_tokens=64", "rollout.n=2", "rollout.prompts_per_step=16",
        "trainer.micro_batch_size=16", "ray.num_cpus_per_worker=0.5", "run.log_samples=-1",
        f"run.output_dir={tmp}", *extra])
    c = Controller(cfg, placements=placements)
    c.setup()
    return c


def step_and_evaluate(c: Controller) -> tuple[list, dict]:
    """Step 1, the held-out evaluation and the timeline, then c shut down: (the step's samples
    as its advantages took them, after prepare: the trainer's logprobs are on them; the step's
    and the evaluation's metrics)."""
    seen = {}
    advantages = c.advantages

    def keep(samples, token_rewards):
        seen["samples"] = samples
        return advantages(samples, token_rewards)

    c.advantages = keep
    try:
        metrics = c.step(1)
        metrics.update(c.evaluate(1))
        c.life.recorder.record(c.placement, 1)
    finally:
        c.life.shutdown()
    return seen["samples"], metrics


def test_three_turn_trajectories_train_on_the_engines_tokens_and_survive_failing_envs(
        placements, tmp_path):
    c = controller(placements, tmp_path, "quickstart.yaml", "run.name=sync",
                   "algorithm.old_logprobs=pass", "trainer.eval_every=1",
                   "data.eval_path=" + str(write_rows(tmp_path, "held_out", 100)),
                   "data.eval_fraction=0",
                   "trainer.total_steps=1")
    samples, metrics = step_and_evaluate(c)
    tok = c.tokenizer
    hows = {s.row: c.prompts.rows[s.row]["how"] for s in samples}
    ok = [s for s in samples if hows[s.row] == "ok"]
    assert ok and len(ok) < len(samples)
    for s in ok:  # model turn, "go on", model turn, "go on", model turn
        assert s.turns == 3 and not s.env_error and s.trained
        pattern = runs(s.loss_mask)
        assert [v for v, _, _ in pattern] == [1, 0, 1, 0, 1], pattern
        for value, start, end in pattern:
            if value:
                assert end - start <= TURN
                continue
            # observation tokens: the template's rendering of the env's message, logprob 0
            assert s.response_ids[start:end] == observation_ids(
                tok, [{"role": "user", "content": "go on"}], None, s.response_ids[start - 1])
            assert s.rollout_logprobs[start:end] == [0.0] * (end - start)
        # token in, token out: the trainer scores the engine's sampled tokens as it did
        model = [i for i, m in enumerate(s.loss_mask) if m]
        diff = max(abs(s.old_logprobs[i] - s.rollout_logprobs[i]) for i in model)
        assert diff < 1e-3, diff
    for s in samples:
        if hows[s.row] != "ok":
            want = "RuntimeError" if hows[s.row] == "raise" else "TimeoutError"
            assert want in s.env_error and s.turns == 2 and not s.trained, s.env_error
    assert metrics["env/turns"] > 2 and 0 < metrics["env/failed_frac"] < 1
    assert metrics["env/untrained"] == sum(not s.trained for s in samples)
    assert 0 < metrics["env/masked_token_frac"] < 1 and metrics["env/scripted_steps"] > 1
    assert metrics["sync/logprob_max_abs_diff"] < 1e-3  # the update was synced and checked
    assert metrics["eval/num_prompts"] == 16  # the held-out rows ran the script too, greedily
    run_dir = c.life.run_dir
    greedy = [json.loads(x) for x in (run_dir / "eval" / "step_1.jsonl").read_text().splitlines()]
    assert sum(len(g["conversation"]) == 5 for g in greedy) == 12  # the "ok" rows
    records = [json.loads(x) for x in (run_dir / "rollouts.jsonl").read_text().splitlines()]
    full = next(r for r in records if r["turns"] == 3)
    assert [next(iter(t)) for t in full["conversation"]] == ["model", "env", "model", "env",
                                                            "model"]
    assert "go on" in full["conversation"][1]["env"]
    assert any("TimeoutError" in r["env_error"] for r in records)
    trace = json.loads((run_dir / "timeline.json").read_text())["traceEvents"]
    assert any(e.get("name") == "env step" for e in trace)


def test_one_step_pipeline_streams_multi_turn_trajectories(placements, tmp_path):
    c = controller(placements, tmp_path, "quickstart_fully_async.yaml", "run.name=one_step",
                   "pipeline.mode=one_step", "ray.num_cpus_per_rollout_worker=0.5",
                   "run.timeline_steps=0")
    seen = []
    advantages = c.advantages
    c.advantages = lambda samples, rewards: seen.append(samples) or advantages(samples, rewards)
    try:
        metrics = [c.step(k) for k in (1, 2)]
    finally:
        c.life.shutdown()
    assert [m["rollout/staleness"] for m in metrics] == [0.0, 1.0]
    for samples in seen:
        ok = [s for s in samples if s.turns == 3]
        assert ok and all(len(s.token_versions) == len(s.response_ids) for s in ok)
        assert all([v for v, _, _ in runs(s.loss_mask)] == [1, 0, 1, 0, 1] for s in ok)
        assert any(s.env_error for s in samples)
