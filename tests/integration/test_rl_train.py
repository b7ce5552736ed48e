"""A real `rl-train` run: 2-rank ZeRO-3 + vLLM colocated on Ray, warm-up, KL, checkpoints."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
REQUIRED = ["step", "reward/mean", "reward/std", "loss/policy", "kl/mean", "time/rollout",
            "time/reward", "time/update", "time/sync", "throughput/tokens_per_s",
            "sync/logprob_max_abs_diff"]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("run")
    env = dict(os.environ, RL_CACHE_DIR=str(tmp / "cache"))
    cmd = [sys.executable, "-m", "rl.cli", "recipes/quickstart.yaml",
           f"run.output_dir={tmp}", "run.name=it", "trainer.total_steps=3",
           "trainer.checkpoint_every=2", "warmup.sft_steps=4", "rollout.prompts_per_step=8",
           "rollout.n=4", "trainer.micro_batch_size=8", "algorithm.loss.kl_coef=0.01"]
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    return tmp / "it", out.stdout


def test_metrics_have_every_key_and_finite_values(finished_run):
    run_dir, _ = finished_run
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2, 3]
    for m in lines:
        missing = [k for k in REQUIRED if k not in m]
        assert not missing, missing
        assert all(v == v and abs(v) != float("inf") for v in m.values())  # finite
        assert m["sync/logprob_max_abs_diff"] <= 1e-3
    assert lines[-1]["kl/mean"] > 0.0  # the policy moved away from the reference


def test_run_leaves_config_checkpoint_plot_and_loadable_model(finished_run):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run_dir, stdout = finished_run
    assert "warm-up step 4/4" in stdout and "step 3/3" in stdout
    assert (run_dir / "config.yaml").read_text().count("total_steps: 3") == 1
    assert (run_dir / "checkpoints" / "step_2").is_dir()
    assert (run_dir / "metrics.png").stat().st_size > 0
    assert (run_dir / "rollouts.jsonl").read_text().strip()
    model = AutoModelForCausalLM.from_pretrained(run_dir / "final_model")
    tok = AutoTokenizer.from_pretrained(run_dir / "final_model")
    assert model.config.vocab_size >= len(tok)
