"""Every recipe runs 2 RL steps end to end on the real engines (tiny model, shared Ray, actors
kept between recipes of the same placement shape)."""
import json
from pathlib import Path

import pytest

from rl.config import load_config
from rl.run.controller import Controller
from tests.integration.recipe_checks import check_step_metrics

pytestmark = pytest.mark.slow  # the fast tier: pytest -m "not slow"

ROOT = Path(__file__).parents[2]
RECIPES = sorted(p.name for p in (ROOT / "recipes").glob("*.yaml"))
SMALL = ["trainer.total_steps=2", "rollout.prompts_per_step=8", "rollout.n=4",
         "trainer.micro_batch_size=8", "warmup.sft_steps=30", "warmup.batch_size=32",
         # the shared 2-CPU Ray instance must fit a disaggregated recipe's 4 actors
         "ray.num_cpus_per_worker=0.5", "ray.num_cpus_per_rollout_worker=0.5"]
# Recipes on a real pretrained model take minutes even for 2 steps (6.4 min for SmolLM2-135M on
# 2 cores): benchmarks/smollm2_before_after.py runs them; tests/unit/rewards checks their data.
REAL_MODEL = {"smollm2_chain_sum.yaml", "smollm2_tools.yaml"}
# Recipes another integration test runs end to end already, with the same step checks
# (recipe_checks.check_step_metrics): quickstart_lora's resumed run (test_lora.py), ppo's
# killed and resumed runs (test_resume.py), quickstart's CLI run (test_rl_train.py),
# quickstart_one_step's hurt runs (test_async_faults.py; fully_async's too, but its final
# evaluation is checked here), quickstart_disaggregated's run beside the colocated one, with
# its held-out evaluations (test_disaggregated_run.py)
RUN_ELSEWHERE = {"quickstart_lora.yaml", "ppo.yaml", "quickstart.yaml",
                 "quickstart_one_step.yaml", "quickstart_disaggregated.yaml"}
RECIPES = [r for r in RECIPES if r not in REAL_MODEL | RUN_ELSEWHERE]
# A multi-turn recipe's held-out evaluations (at step 0 and after the last) on this many
# problems: the recipes hold out 200, every one a few turns (10-14 s of their 2-step runs here)
HELD_OUT = 40


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_runs_two_steps(recipe, placements, tmp_path):
    # fully async, the last step stops the streaming engines for the final evaluation
    held_out = ["data.eval_fraction=0.2", "trainer.eval_k=2"] if "fully_async" in recipe else []
    overrides = SMALL + held_out + [f"run.output_dir={tmp_path}"]
    cfg = load_config(str(ROOT / "recipes" / recipe), overrides)
    if cfg.env.name is not None and cfg.data.eval_fraction * cfg.data.num_rows > HELD_OUT:
        overrides.append(f"data.eval_fraction={HELD_OUT / cfg.data.num_rows}")
        cfg = load_config(str(ROOT / "recipes" / recipe), overrides)
    run_dir = Controller(cfg, placements=placements).run()
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    if cfg.data.eval_fraction or cfg.data.eval_path:  # the base model's and the last evaluation
        assert lines[0]["step"] == 0 and "eval/greedy_accuracy" in lines[0]
        assert "eval/greedy_accuracy" in lines[-1]
        lines = lines[1:]
    assert [m["step"] for m in lines] == [1, 2]
    check_step_metrics(cfg, lines)
