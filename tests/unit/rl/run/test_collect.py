"""collect: rollout rounds until the batch holds prompts_per_step groups, from the generate and
score functions it is given (no controller)."""
from rl.algo.batch import Sample
from rl.config import load_config
from rl.run.collect import collect


def run(overrides: list[str], rewards_of_row):
    """collect with a fake engine: row r's n samples get rewards_of_row(r); returns (batch, the
    rows each round asked for)."""
    cfg = load_config(None, overrides)
    rows = iter(range(1000))
    asked = []

    def generate(batch_rows, round_index):
        asked.append((round_index, batch_rows))
        samples = [Sample(r, g, [1], [2, 3], [-0.5, -0.5], "stop", str(r))
                   for g, r in enumerate(batch_rows) for _ in range(cfg.rollout.n)]
        return samples, {"rollout/round": float(round_index)}

    def score(samples):
        for i, s in enumerate(samples):
            s.reward = s.score = rewards_of_row(s.row)[i % cfg.rollout.n]
        return {"reward/errors": 0.0}

    batch = collect(cfg, lambda k: [next(rows) for _ in range(k)], generate, score)
    return batch, asked


def test_dynamic_sampling_keeps_informative_groups_and_fills_the_shortfall_with_flat_ones():
    # even rows: every sample rewarded alike (flat); odd rows: informative
    batch, asked = run(["rollout.prompts_per_step=4", "rollout.n=2", "ray.num_workers=1",
                        "algorithm.dynamic_sampling=true", "algorithm.max_sampling_rounds=2"],
                       lambda r: [1.0, 1.0] if r % 2 == 0 else [0.0, 1.0])
    assert [i for i, _ in asked] == [0, 1]  # 2 informative groups a round: two rounds
    rows = [s.row for s in batch.samples]
    assert rows == [1, 1, 3, 3, 5, 5, 7, 7]  # the informative groups of both rounds
    assert [s.group for s in batch.samples] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert len(batch.all_samples) == 16  # the flat groups still count for the reward metrics
    assert batch.metrics["dynamic/rounds"] == 2.0
    assert batch.metrics["dynamic/flat_groups_filled"] == 0.0
    assert batch.engine_stats == {"rollout/round": 1.0}  # the last round's counters


def test_without_dynamic_sampling_one_round_is_the_batch():
    batch, asked = run(["rollout.prompts_per_step=2", "rollout.n=2", "ray.num_workers=1"],
                       lambda r: [1.0, 1.0])
    assert asked == [(0, [0, 1])]
    assert [s.row for s in batch.samples] == [0, 0, 1, 1]
    assert batch.metrics["reward/mean"] == 1.0 and "dynamic/rounds" not in batch.metrics
