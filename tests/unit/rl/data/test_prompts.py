"""Prompts: rendering, structured-output constraints per row, over-long prompts filtered."""
import json

import pytest

from rl.data.models import build_tiny_model
from rl.data.prompts import PromptSet, output_constraint, resolve_rows
from rl.schema import DataConfig
from rollout.config import RolloutConfig


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(
        build_tiny_model("tiny-qwen2", out_dir=tmp_path_factory.mktemp("m") / "q"))


def test_overlong_prompts_are_filtered_with_a_count(tok, capsys):
    rows = [{"prompt": "short"}, {"prompt": "long " * 200}, {"prompt": "also short"}]
    ps = PromptSet(rows, tok, DataConfig(), 0, RolloutConfig(max_model_len=64,
                                                              max_new_tokens=16))
    assert ps.num_filtered == 1 and [r["prompt"] for r in ps.rows] == ["short", "also short"]
    assert "skipped 1 of 3 prompts longer than 48 tokens" in capsys.readouterr().out


def test_all_prompts_too_long_is_an_error_that_says_the_fix(tok):
    import re

    rows = [{"prompt": "long " * 200}, {"prompt": "long " * 50}]
    with pytest.raises(ValueError, match=r"max_model_len=256 leaves beside rollout.max_new_tokens="
                                         r"200 \(the shortest has \d+ tokens\)") as e:
        PromptSet(rows, tok, DataConfig(), 0, RolloutConfig(max_model_len=256, max_new_tokens=200))
    raise_to, lower_to = map(int, re.search(r"max_model_len to (\d+) or lower "
                                            r"rollout.max_new_tokens to (\d+)", str(e.value)).groups())
    # each fix it names, applied alone, keeps the shortest prompt
    assert PromptSet(rows, tok, DataConfig(), 0, RolloutConfig(
        max_model_len=raise_to, max_new_tokens=200)).num_filtered == 1
    assert PromptSet(rows, tok, DataConfig(), 0, RolloutConfig(
        max_model_len=256, max_new_tokens=lower_to)).num_filtered == 1


def test_missing_prompt_field_names_the_row(tok):
    with pytest.raises(KeyError, match="row 1 has no field 'prompt'"):
        PromptSet([{"prompt": "a"}, {"question": "b"}], tok, DataConfig(), 0)


def test_output_constraints_from_rows():
    cfg = RolloutConfig()
    schema = {"type": "object"}
    assert output_constraint({"json_schema": json.dumps(schema)}, cfg, 0) == {"json": schema}
    assert output_constraint({"regex": "[0-9]+"}, cfg, 0) == {"regex": "[0-9]+"}
    assert output_constraint({"choices": ["a", "b"], "regex": None}, cfg, 0) == \
        {"choice": ["a", "b"]}
    assert output_constraint({"prompt": "x"}, cfg, 0) is None
    with pytest.raises(ValueError, match="row 3 has json and regex constraints"):
        output_constraint({"json_schema": "{}", "regex": "a"}, cfg, 3)


def test_builtin_extraction_rows_carry_a_schema(tmp_path, monkeypatch):
    monkeypatch.setenv("RL_CACHE_DIR", str(tmp_path))
    rows = resolve_rows(DataConfig(train_path="builtin:extraction", num_rows=5), 0)
    assert len(rows) == 5 and json.loads(rows[0]["json_schema"])["required"] == ["count"]
    with pytest.raises(ValueError, match="built-in data sets are builtin:arithmetic"):
        resolve_rows(DataConfig(train_path="builtin:nope"), 0)


def test_a_forked_order_does_not_shift_the_main_order(tok):
    rows = [{"prompt": f"q{i}"} for i in range(10)]
    reference, main = (PromptSet(rows, tok, DataConfig(), 0) for _ in range(2))
    fork = main.with_order(1)
    fork.next_batch(7)  # the warm-up draws from its own order (or is cached and draws none)
    assert main.next_batch(12) == reference.next_batch(12)
    assert fork.prompt_ids is main.prompt_ids  # shares the prompts, not copies them


def test_held_out_split_is_by_prompt_text_not_by_row(tmp_path, monkeypatch):
    """builtin:arithmetic repeats prompts (4000 rows of 2 * 16 * 16 = 512 problems): a split by
    row index would put rows of the same problem on both sides."""
    from rl.data.prompts import prompt_text, split_rows

    monkeypatch.setenv("RL_CACHE_DIR", str(tmp_path))
    cfg = DataConfig(max_operand=15, eval_fraction=0.1)
    rows = resolve_rows(cfg, 0)
    split = split_rows(rows, cfg)
    train = {r["prompt"] for r in split.train}
    held = [r["prompt"] for r in split.held_out]
    assert len(held) == len(set(held)) == round(0.1 * len({r["prompt"] for r in rows}))
    assert not train & set(held)
    assert len(split.train) + sum(
        sum(prompt_text(r, "prompt") == h for r in rows) for h in held) == len(rows)
    # the held-out texts do not depend on the rows' order or the seed
    again = split_rows(list(reversed(rows)), cfg)
    assert sorted(r["prompt"] for r in again.held_out) == sorted(held)


def test_held_out_file_drops_training_rows_with_its_prompts():
    from rl.data.prompts import split_rows

    rows = [{"prompt": p, "answer": "1"} for p in ["a", "b", "a", "c", "d"]]
    held = [{"prompt": "a", "answer": "1"}, {"prompt": "z", "answer": "2"},
            {"prompt": "a", "answer": "1"}]
    split = split_rows(rows, DataConfig(eval_path="held.jsonl"), held)
    assert [r["prompt"] for r in split.train] == ["b", "c", "d"] and split.dropped == 2
    assert [r["prompt"] for r in split.held_out] == ["a", "z"]  # each prompt once
    with pytest.raises(ValueError, match="holds out 0"):
        split_rows(rows, DataConfig(eval_fraction=0.01))


def test_warmup_sees_no_held_out_prompt(tok, tmp_path, monkeypatch):
    """The warm-up draws its SFT rows from the training PromptSet: none is held out."""
    from rl.data.prompts import split_rows

    monkeypatch.setenv("RL_CACHE_DIR", str(tmp_path))
    cfg = DataConfig(max_operand=15, eval_fraction=0.2)
    split = split_rows(resolve_rows(cfg, 0), cfg)
    prompts = PromptSet(split.train, tok, cfg, 0)
    warm = prompts.with_order(1)
    seen = {warm.rows[i]["prompt"] for i in warm.next_batch(5000)}
    assert seen == {r["prompt"] for r in split.train}
    assert not seen & {r["prompt"] for r in split.held_out}


def _rows_in_a_fresh_process(cache: str) -> int:
    import os

    os.environ["RL_CACHE_DIR"] = cache
    return len(resolve_rows(DataConfig(train_path="builtin:arithmetic", num_rows=20000), 0))


def test_runs_sharing_a_cache_generate_the_same_data_at_once(tmp_path):
    """Two runs on one machine (or a test's concurrent runs) may both find the data set missing:
    each writes under a name of its own and publishes it whole, so neither fails."""
    import multiprocessing

    with multiprocessing.get_context("spawn").Pool(4) as pool:
        counts = pool.map(_rows_in_a_fresh_process, [str(tmp_path)] * 8)
    assert counts == [20000] * 8
    names = [p.name for p in (tmp_path / "data").iterdir()]  # one data set, nothing left over
    assert len(names) == 1 and names[0].startswith("arithmetic-") and ".tmp" not in names[0]
