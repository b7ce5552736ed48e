"""metrics.png and the smoothing of its reward curve."""
import json

import pytest

from rl.observe.metrics import RunLog, eval_curves, keep_lines, smooth


def test_smooth_is_a_debiased_moving_average():
    assert smooth([1.0, 1.0, 1.0]) == pytest.approx([1.0, 1.0, 1.0])  # no pull towards 0
    values = [0.0] * 10 + [1.0] * 10
    out = smooth(values)
    assert out[9] == 0.0 and 0.0 < out[10] < 1.0 and out[-1] > out[10]


def test_plot_has_reward_eval_kl_length_and_time_panels(tmp_path):
    import matplotlib.image

    log = RunLog(tmp_path, total_steps=4)
    log.log_step({"step": 0, "eval/accuracy": 0.1, "eval/num_prompts": 102.0,
                  "time/eval": 2.0})  # the base model's
    for step in range(1, 5):
        m = {"step": step, "reward/mean": 0.1 * step, "reward/std": 0.1, "kl/mean": 0.01,
             "response/length_mean": 7.0, "time/rollout": 0.1, "time/reward": 0.01,
             "time/update": 0.2, "time/sync": 0.05, "time/step": 0.36,
             "sync/logprob_max_abs_diff": 1e-7}
        if step in (1, 4):
            m["eval/accuracy"], m["eval/num_prompts"] = 0.2 * step, 102.0
        log.log_step(m)
    log.close()
    assert [m["step"] for m in log.history] == [0, 1, 2, 3, 4]
    assert log.eta_seconds(log.history[-1]) == 0.0
    path = log.plot()
    assert eval_curves(log.history) == ["eval/accuracy"]  # the count would flatten the curves
    assert log.plot_panels == ["reward", "held-out evaluation (102 prompts)", "KL to the reference",
                               "response length (tokens)", "step time (s)"]
    height, width, _ = matplotlib.image.imread(path).shape
    assert width > 1.5 * height  # two rows of three panels


def test_a_terminal_gets_a_bar_with_reward_and_eta(tmp_path):
    import io

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    out = Terminal()
    log = RunLog(tmp_path, total_steps=10, stream=out)
    for step in (1, 2, 3):
        log.log_step({"step": step, "reward/mean": 0.25, "reward/std": 0.1,
                      "response/length_mean": 7.0, "time/rollout": 0.5, "time/reward": 0.1,
                      "time/update": 1.0, "time/sync": 0.4, "time/step": 2.0,
                      "sync/logprob_max_abs_diff": 1e-7})
    log.close()
    text = out.getvalue()
    assert "reward=0.250" in text and "eta=0.2 min" in text and "step 3/10" in text


def test_logs_keep_the_steps_up_to_the_checkpoint(tmp_path):
    log = tmp_path / "metrics.jsonl"
    log.write_text("".join(json.dumps({"step": s, "x": s}) + "\n" for s in (1, 2, 3, 4, 5)))
    kept = keep_lines(log, 3)
    assert [m["step"] for m in kept] == [1, 2, 3]
    assert log.read_text().count("\n") == 3


def test_a_line_torn_by_the_crash_is_dropped(tmp_path):
    log = tmp_path / "rollouts.jsonl"
    log.write_text(json.dumps({"step": 1}) + "\n" + json.dumps({"step": 2}) + '\n{"step": 3, "pro')
    assert [m["step"] for m in keep_lines(log, 2)] == [1, 2]
