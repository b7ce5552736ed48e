"""`benchmarks/vs_trl.py --preset smoke`: rl-train (one worker, ZeRO stage 0, as the smollm2
preset), rl-train on ZeRO-3, TRL's GRPOTrainer, the plain loop and rl-train with ngram
speculation each run 2 steps of the same work on the tiny model, and the comparison table and
ratios come out."""
import os
import re
import sys
from pathlib import Path

import pytest

from tests.early import early

pytestmark = pytest.mark.slow  # the fast tier: pytest -m "not slow"

ROOT = Path(__file__).parents[2]


def smoke_command(tmp: Path) -> list[str]:
    # the five rows at once: their start-ups leave cores idle (four rows: 39 -> 35 s against
    # two at a time), and the smoke times nothing
    return [sys.executable, "benchmarks/vs_trl.py", "--preset", "smoke", "--jobs", "5", "--out",
            str(tmp / "out")]


# started with the session, beside the unit tests (tests/early.py)
SMOKE = early("vs_trl_smoke", __file__, smoke_command,
              lambda tmp: dict(os.environ, RL_CACHE_DIR=str(tmp / "cache")))


@pytest.mark.integration
def test_smoke_preset_runs_every_row():
    out = SMOKE.passed(timeout=600)
    stdout = out.stdout
    rows = {m.group(1): [float(x) for x in m.group(2).split(" | ")[:6]]
            for m in re.finditer(r"^\| (rl-train|rl-train/zero3|trl|raw|rl-train\+ngram) \| "
                                 r"float32 \| (.*) \|$", stdout, re.MULTILINE)}
    assert set(rows) == {"rl-train", "rl-train/zero3", "trl", "raw", "rl-train+ngram"}, stdout
    for name, (step, samples_per_s, *_rest) in rows.items():
        assert step > 0 and samples_per_s > 0, (name, rows[name])
    for ratio in ("rl-train / TRL samples/s", "rl-train step / raw step",
                  "rl-train update / raw train", "rl-train rollout tok/s / raw",
                  "rl-train/zero3 / TRL samples/s", "ZeRO-3 / ZeRO-0 step",
                  "ZeRO-3 / ZeRO-0 update", "ZeRO-3 / ZeRO-0 sync"):
        assert re.search(rf"float32: {re.escape(ratio)} = \d+\.\d+x", stdout), ratio
    assert re.search(r"float32: ngram speculation: rollout tok/s \d+\.\d+x of rl-train's, step "
                     r"\d+\.\d+x \(acceptance \d+\.\d+\)", stdout), stdout
