"""reasoning-gym as a data source (reasoning_gym:<task>) and its verifiers as a reward."""
import json

import pytest

from rewards.registry import resolve, start_check_of
from rl.schema import DataConfig
from rl.data.prompts import resolve_rows


@pytest.fixture
def rows(tmp_path, monkeypatch):
    monkeypatch.setenv("RL_CACHE_DIR", str(tmp_path))
    cfg = DataConfig(train_path="reasoning_gym:basic_arithmetic", num_rows=20,
                     task_config={"min_terms": 2, "max_terms": 2, "max_digits": 1},
                     answer_instruction="Give the answer inside <answer></answer>.")
    return resolve_rows(cfg, 3)


def test_rows_carry_the_question_answer_and_the_entry(rows):
    assert len(rows) == 20
    row = rows[0]
    assert row["prompt"].endswith("Give the answer inside <answer></answer>.")
    assert row["reasoning_gym"]["task"] == "basic_arithmetic"
    assert row["reasoning_gym"]["entry"]["answer"] == row["answer"]
    json.dumps(rows)  # what the jsonl cache holds


def test_the_tasks_verifier_scores_the_answer_block(rows):
    reward = resolve("reasoning_gym")
    start_check_of(reward)(rows, {})
    for row in rows[:5]:
        right, wrong = row["answer"], str(int(row["answer"]) + 1)
        extra = {k: v for k, v in row.items() if k != "prompt"}  # as the scorer calls it
        assert reward(row["prompt"], f"<answer>{right}</answer>", **extra) == 1.0
        assert reward(row["prompt"], f"I think <answer>{wrong}</answer>", **extra) == 0.0
        assert reward(row["prompt"], right, **extra) == 1.0  # no block: the whole response
        said = f"{row['prompt']} The answer is {right}."
        assert reward(row["prompt"], said, **extra) < 1.0
        assert reward(row["prompt"], said, fallback="last_number", **extra) == 1.0
        assert reward(row["prompt"], f"{said} Or {wrong}", fallback="last_number", **extra) == 0.0
        assert reward(row["prompt"], f"<answer>{wrong}</answer> {right}", fallback="last_number",
                      **extra) == 0.0  # a block wins over the fallback


def test_rows_without_an_entry_and_unknown_tasks_are_refused(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="row 1 has no 'reasoning_gym' field"):
        start_check_of(resolve("reasoning_gym"))(
            [{"reasoning_gym": {"task": "x", "entry": {}}}, {"prompt": "a"}], {})
    with pytest.raises(ValueError, match="args.fallback is 'last'; use one of response, last_n"):
        start_check_of(resolve("reasoning_gym"))([], {"fallback": "last"})
    monkeypatch.setenv("RL_CACHE_DIR", str(tmp_path))
    with pytest.raises(ValueError, match="reasoning_gym:no_such_task.*check the task name"):
        resolve_rows(DataConfig(train_path="reasoning_gym:no_such_task", num_rows=2), 0)


def test_the_smollm2_recipe_holds_out_500_problems_and_its_reward_accepts_its_rows(tmp_path,
                                                                                   monkeypatch):
    from pathlib import Path

    from rl.config import load_config
    from rl.run.rewarding import checked_rows

    monkeypatch.setenv("RL_CACHE_DIR", str(tmp_path))
    recipe = Path(__file__).parents[3] / "recipes" / "smollm2_chain_sum.yaml"
    rows = checked_rows(load_config(str(recipe)))
    train, held_out = rows.train, rows.held_out
    assert len(held_out) >= 500  # docs/benchmarks.md's before/after is measured on these
    assert not {r["prompt"] for r in held_out} & {r["prompt"] for r in train}
