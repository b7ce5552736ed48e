"""The same short GRPO run, colocated and disaggregated (same seed): the rollouts, metrics and
final model agree bit for bit (the placements move the weights differently, the trainers compute
alike), and every sample records the policy version that generated it. The two runs are the
recipes recipes/quickstart.yaml and recipes/quickstart_disaggregated.yaml as shipped (with the
tests' small sizes), each with the step checks every recipe's run gets (test_algorithms.py)."""
import json
from pathlib import Path

import pytest

from rl.config import load_config
from rl.run.controller import Controller
from tests.integration.recipe_checks import check_step_metrics

pytestmark = pytest.mark.slow  # the fast tier: pytest -m "not slow"

ROOT = Path(__file__).parents[2]
OVERRIDES = ["trainer.total_steps=3", "rollout.prompts_per_step=8", "rollout.n=4",
             "trainer.micro_batch_size=8", "warmup.sft_steps=30", "warmup.batch_size=32",
             "run.log_samples=-1", "ray.num_cpus_per_worker=0.5",
             "ray.num_cpus_per_rollout_worker=0.5"]
# the disaggregated recipe is the quickstart with its placement (2 trainer ranks, 2 engines)
RECIPES = {"colocated": "quickstart.yaml", "disaggregated": "quickstart_disaggregated.yaml"}
# what must agree; time/* and throughput differ by design
COMPARED = ["reward/mean", "reward/std", "loss/policy", "kl/mean", "response/length_mean",
            "advantages/abs_mean", "grad/norm", "mismatch/kl"]


@pytest.fixture(scope="module")
def runs(placements, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("runs")
    out = {}
    for placement, recipe in RECIPES.items():
        cfg = load_config(str(ROOT / "recipes" / recipe), OVERRIDES + [
            f"run.output_dir={tmp}", f"run.name={placement}"])
        assert cfg.placement == placement
        out[placement] = Controller(cfg, placements=placements).run()
    return out


def lines(run_dir, name):
    return [json.loads(x) for x in (run_dir / name).read_text().splitlines()]


def test_metrics_match_the_colocated_run(runs):
    colocated, disaggregated = (lines(runs[p], "metrics.jsonl")
                                for p in ("colocated", "disaggregated"))
    # the held-out evaluations (the base model's in a line of its own, then after the last
    # step) agree too: the same prompts, seeds and engines
    evals = [k for k in colocated[0] if k.startswith("eval/")]
    assert len(evals) == 5 and colocated[0]["step"] == disaggregated[0]["step"] == 0
    for a, b in ((colocated[0], disaggregated[0]), (colocated[-1], disaggregated[-1])):
        assert {k: a[k] for k in evals} == {k: b[k] for k in evals}
    colocated, disaggregated = colocated[1:], disaggregated[1:]
    assert len(colocated) == len(disaggregated) == 3
    for placement, steps in (("colocated", colocated), ("disaggregated", disaggregated)):
        check_step_metrics(load_config(str(runs[placement] / "config.yaml")), steps)
    for a, b in zip(colocated, disaggregated):
        for key in COMPARED:  # bit for bit: the same trainer kernels on the same batches
            assert a[key] == b[key], (a["step"], key, a[key], b[key])
        assert b["sync/logprob_max_abs_diff"] <= 1e-3
        assert b["rollout/policy_version"] == a["rollout/policy_version"] == a["step"] - 1
        assert b["rollout/staleness"] == 0.0 and b["sync/retries"] == 0.0


def test_rollouts_match_and_carry_their_policy_version(runs):
    colocated, disaggregated = (lines(runs[p], "rollouts.jsonl")
                                for p in ("colocated", "disaggregated"))
    assert len(colocated) == len(disaggregated) == 3 * 8 * 4
    for a, b in zip(colocated, disaggregated):
        assert a["completion"] == b["completion"] and a["reward"] == b["reward"]
        assert b["policy_version"] == b["step"] - 1


def test_final_models_match(runs):
    import torch
    from safetensors.torch import load_file

    a, b = (load_file(runs[p] / "final_model" / "model.safetensors")
            for p in ("colocated", "disaggregated"))
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])]
