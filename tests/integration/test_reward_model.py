"""`reward_model` scores a batch with a tiny locally built classifier, in its own Ray actor."""
import math

import pytest
import torch

from rl.run.rewarding import RewardScorer
from rl.schema import RewardConfig, RewardTerm

pytestmark = pytest.mark.slow  # the fast tier: pytest -m "not slow"


@pytest.fixture(scope="module")
def classifier(tmp_path_factory):
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForSequenceClassification

    from rl.data.models import build_tiny_model

    lm = build_tiny_model("tiny-qwen2", seed=4, out_dir=tmp_path_factory.mktemp("m") / "lm")
    tok = AutoTokenizer.from_pretrained(lm)
    cfg = Qwen2Config.from_pretrained(lm)
    cfg.num_labels, cfg.pad_token_id = 1, tok.pad_token_id
    torch.manual_seed(0)
    model = Qwen2ForSequenceClassification(cfg)
    out = lm.parent / "rm"
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def test_reward_model_scores_a_batch(ray_session, classifier):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    term = RewardTerm(name="reward_model", args={"path": str(classifier), "batch_size": 2})
    # 2 s bound the scoring only: the actor's start-up (importing torch and transformers in a
    # new process, loading the model) takes longer and must not count
    scorer = RewardScorer(RewardConfig(functions=[term], timeout_s=2.0), "prompt")
    rows = [{"prompt": "What is 1 + 1?"}, {"prompt": "What is 2 + 2?"}, {"prompt": "Hi"}]
    completions = ["2", "5", "hello there"]
    try:
        totals, m = scorer.score(rows, completions)
    finally:
        scorer.close()
    assert m["reward/errors"] == 0 and m["reward/timeouts"] == 0
    assert all(math.isfinite(t) for t in totals) and len(set(totals)) == 3
    # the same numbers as the model run here, one text at a time (batching changes nothing)
    from tests.numerics import depth, rounding, width

    tok = AutoTokenizer.from_pretrained(classifier)
    model = AutoModelForSequenceClassification.from_pretrained(classifier).eval()
    with torch.no_grad():
        direct = [model(**tok(r["prompt"] + c, return_tensors="pt")).logits[0, 0].item()
                  for r, c in zip(rows, completions)]
    # a batch pads and rounds otherwise than one text at a time (tests/numerics.py)
    tol = rounding(max(map(abs, direct)), depth(model.config), width(model.config))
    assert totals == pytest.approx(direct, rel=0, abs=tol)
    assert m["reward/reward_model/mean"] == pytest.approx(sum(direct) / 3, rel=0, abs=tol)


def test_a_reward_model_that_cannot_load_stops_at_start(ray_session, tmp_path):
    """Not every sample scored with the fallback: one error naming the term and its path."""
    (tmp_path / "config.json").write_text("{}")
    term = RewardTerm(name="reward_model", args={"path": str(tmp_path)})
    with pytest.raises(ValueError, match=r"reward term 'reward_model' \(args.path=.*\) did not "
                                         r"load: .+"):
        RewardScorer(RewardConfig(functions=[term]), "prompt")
