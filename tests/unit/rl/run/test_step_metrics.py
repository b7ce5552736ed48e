"""The multi-turn parts of a step's metrics and logged rollouts: env counts per trajectory,
the env's share of the tokens, conversations split at the loss mask, and which trajectories
are kept out of the loss."""
from rl.algo.batch import Sample
from rl.run.collect import mask_untrained
from rl.run.step_metrics import conversation, env_metrics, rollout_records


def trajectory(mask, **kw) -> Sample:
    ids = list(range(10, 10 + len(mask)))
    return Sample(0, 0, [1, 2], ids, [0.0] * len(ids), "stop", "x", loss_mask=mask, **kw)


def test_env_metrics_count_per_trajectory_and_the_envs_token_share():
    a = trajectory([1, 1, 0, 0, 1], turns=2, env_info={"tool_calls": 1, "env_seconds": 0.5})
    b = trajectory([1, 1, 1], turns=1, env_info={"tool_calls": 0}, truncated=True)
    c = trajectory([1, 0, 1], turns=2, env_error="env.step: TimeoutError")
    m = env_metrics([a, b, c])
    assert m["env/turns"] == 5 / 3 and m["env/tool_calls"] == 1 / 3
    assert m["env/env_seconds"] == 0.5 / 3
    assert m["env/masked_token_frac"] == 3 / 11
    assert m["env/truncated_frac"] == m["env/failed_frac"] == 1 / 3


def test_failed_and_untrained_truncated_trajectories_leave_the_loss():
    ok, cut = trajectory([1, 0, 1]), trajectory([1, 0, 1], truncated=True)
    failed = trajectory([1, 0, 1], env_error="env.step: RuntimeError")
    assert mask_untrained([ok, cut, failed], train_truncated=True) == 1
    assert [s.trained for s in (ok, cut, failed)] == [True, True, False]
    assert mask_untrained([ok, cut, failed], train_truncated=False) == 2
    assert cut.model_token_mask() == [0, 0, 0] and cut.num_loss_tokens == 0
    assert ok.model_token_mask() == [1, 0, 1] and cut.num_model_tokens == 2


def test_conversations_split_at_the_loss_mask():
    decode = lambda ids: ",".join(map(str, ids))  # noqa: E731
    assert conversation([5, 6, 7, 8, 9], [1, 1, 0, 0, 1], decode) == [
        {"model": "5,6"}, {"env": "7,8"}, {"model": "9"}]
    record = rollout_records([trajectory([1, 0], turns=1)], ["p"], -1, decode)[0]
    assert record["conversation"] == [{"model": "10"}, {"env": "11"}] and record["trained"]
    assert "conversation" not in rollout_records([trajectory([1, 0])], ["p"], -1)[0]
