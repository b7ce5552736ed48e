"""`benchmarks/vs_trl.py --preset smoke`: rl-train (one worker, ZeRO stage 0, as the smollm2
preset), rl-train on ZeRO-3, TRL's GRPOTrainer, the plain loop, rl-train with ngram
speculation, rl-train training LoRA adapters (synced merged, and as adapters) and TRL training
them each run 2 steps of the same work on the tiny model, and the comparison table (with memory
and bytes synced) and ratios come out."""
import os
import re
import sys
from pathlib import Path

import pytest

from tests.early import early

pytestmark = pytest.mark.slow  # the fast tier: pytest -m "not slow"

ROOT = Path(__file__).parents[2]


def smoke_command(tmp: Path) -> list[str]:
    # two rows at a time: the smoke times nothing, and it runs beside the unit tests and the
    # other early runs, which keep both cores busy, so its CPU-seconds are what counts. Eight at
    # once cost more (alone, from an empty cache: 168-169 CPU-s against 139-156 for two at a
    # time, 84-92 s either way; one at a time 158 CPU-s, 157 s)
    return [sys.executable, "benchmarks/vs_trl.py", "--preset", "smoke", "--jobs", "2", "--out",
            str(tmp / "out")]


# started with the session, beside the unit tests (tests/early.py)
SMOKE = early("vs_trl_smoke", __file__, smoke_command,
              lambda tmp: dict(os.environ, RL_CACHE_DIR=str(tmp / "cache")))


@pytest.mark.integration
def test_smoke_preset_runs_every_row():
    out = SMOKE.passed()
    stdout = out.stdout
    names = {"rl-train", "rl-train/zero3", "trl", "raw", "rl-train+ngram", "rl-train/lora",
             "rl-train/lora-adapters", "trl/lora"}
    rows = {m.group(1): m.group(2).split(" | ")
            for m in re.finditer(r"^\| (\S+) \| float32 \| (.*) \|$", stdout, re.MULTILINE)}
    assert set(rows) == names, stdout
    for name, cells in rows.items():
        step, samples_per_s = float(cells[0]), float(cells[1])
        assert step > 0 and samples_per_s > 0, (name, cells)
        if name != "raw":  # every trainer's peak memory; rl-train's bytes per sync
            assert float(cells[7]) > 0, (name, cells)
        if name.startswith("rl-train"):
            assert float(cells[8]) > 0, (name, cells)
    assert float(rows["rl-train/lora-adapters"][8]) < 0.1 * float(rows["rl-train"][8])
    assert float(rows["rl-train/lora"][8]) == float(rows["rl-train"][8])  # merged: full weights
    for ratio in ("rl-train / TRL samples/s", "rl-train step / raw step",
                  "rl-train update / raw train", "rl-train rollout tok/s / raw",
                  "rl-train/zero3 / TRL samples/s", "ZeRO-3 / ZeRO-0 step",
                  "ZeRO-3 / ZeRO-0 update", "ZeRO-3 / ZeRO-0 sync",
                  "rl-train/lora / trl/lora samples/s",
                  "rl-train/lora-adapters / trl/lora samples/s"):
        assert re.search(rf"float32: {re.escape(ratio)} = \d+\.\d+x", stdout), ratio
    assert re.search(r"float32: rl-train/lora-adapters / rl-train \(full fine-tuning\): trainer "
                     r"peak RSS \d+\.\d+x \(target <= 0\.6\), bytes synced \d+\.\d+x "
                     r"\(target <= 0\.05\)", stdout), stdout
    assert re.search(r"float32: ngram speculation: rollout tok/s \d+\.\d+x of rl-train's, step "
                     r"\d+\.\d+x \(acceptance \d+\.\d+\)", stdout), stdout
