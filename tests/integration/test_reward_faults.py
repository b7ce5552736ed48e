"""A real run with a reward that raises, hangs, returns NaN or a string on some samples:
the run completes, the failure counters match the samples, and the other term is unharmed."""
import json

import pytest

from rl.config import load_config
from rl.run.controller import Controller

pytestmark = pytest.mark.slow  # the fast tier: pytest -m "not slow"

FLAKY = '''
import math, time

def kind(completion):
    return sum(map(ord, completion)) % 5

def flaky(prompt, completion, **row):
    k = kind(completion)
    if k == 0:
        raise ValueError("broken reward")
    if k == 3:
        time.sleep(30)
    return {1: math.nan, 2: "1.0"}.get(k, 1.0)
'''


def kind(completion):
    return sum(map(ord, completion)) % 5


def test_run_survives_a_faulty_reward(placements, tmp_path, capsys):
    plugin = tmp_path / "flaky.py"
    plugin.write_text(FLAKY)
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"""
reward:
  timeout_s: 1.0
  fallback: -0.5
  functions:
    - name: exact_answer
    - name: {plugin}:flaky
      weight: 0.1
""")
    cfg = load_config(str(recipe), [
        f"run.output_dir={tmp_path}", "run.log_samples=-1", "trainer.total_steps=2",
        "rollout.prompts_per_step=8", "rollout.n=4", "trainer.micro_batch_size=8",
        "rollout.max_new_tokens=6", "ray.num_cpus_per_worker=0.5"])
    run_dir = Controller(cfg, placements=placements).run()
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    records = [json.loads(x) for x in (run_dir / "rollouts.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:
        kinds = [kind(r["completion"]) for r in records if r["step"] == m["step"]]
        assert len(kinds) == 32
        assert m["reward/errors"] == sum(k in (0, 1, 2) for k in kinds)
        assert m["reward/timeouts"] == sum(k == 3 for k in kinds)
        assert m["reward/flaky/mean"] == sum(1.0 if k == 4 else -0.5 for k in kinds) / 32
        assert 0.0 <= m["reward/exact_answer/mean"] <= 1.0
    assert capsys.readouterr().out.count("first failure") == 1
