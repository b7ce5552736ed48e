"""A real `rl-train` run: 2-rank ZeRO-3 + vLLM colocated on Ray, warm-up, KL, checkpoints,
held-out evaluation, and what it leaves: metrics in jsonl, TensorBoard and offline W&B,
timeline.json, the plot; `rl-eval` of its base model."""
import json
import os
import sys
from pathlib import Path

import pytest

from rl.config import load_config
from tests.early import early
from tests.integration.recipe_checks import check_step_metrics

pytestmark = pytest.mark.slow  # the fast tier: pytest -m "not slow"

ROOT = Path(__file__).parents[2]
REQUIRED = ["step", "reward/mean", "reward/std", "loss/policy", "kl/mean", "time/rollout",
            "time/reward", "time/update", "time/sync", "throughput/tokens_per_s",
            "sync/logprob_max_abs_diff"]


def run_command(tmp: Path) -> list[str]:
    return [sys.executable, "-m", "rl.cli", "recipes/quickstart.yaml",
            f"run.output_dir={tmp}", "run.name=it", "trainer.total_steps=3",
            "trainer.checkpoint_every=2", "warmup.sft_steps=4", "rollout.prompts_per_step=8",
            "rollout.n=4", "trainer.micro_batch_size=8", "algorithm.loss.kl_coef=0.01",
            # the two-pass path, so that the timeline has prepare spans too
            "algorithm.old_logprobs=pass", "run.loggers=[jsonl,tensorboard,wandb]",
            # held-out evaluation before step 1, after step 2 and after the last; every
            # trained completion logged, to check none is of a held-out prompt
            "data.eval_fraction=0.1", "trainer.eval_every=2", "trainer.eval_k=2",
            "run.log_samples=-1"]


def run_env(tmp: Path) -> dict:
    env = dict(os.environ, RL_CACHE_DIR=str(tmp / "cache"))  # a cache of its own: builds all
    env.pop("WANDB_API_KEY", None)
    env.pop("WANDB_MODE", None)
    return env


def eval_command(tmp: Path) -> list[str]:
    """`rl-eval` of the run's base model (made once the run has ended)."""
    base = (RUN.dir / "stdout").read_text().split("warm-up: saved the base model to ")
    base = base[1].split()[0] if len(base) > 1 else "(the run saved no base model)"
    rl_eval = Path(sys.executable).parent / "rl-eval"  # the installed entry point
    return [str(rl_eval), str(RUN.dir / "it" / "config.yaml"), base, "--output", str(tmp)]


# started with the session, beside the unit tests (tests/early.py); rl-eval after the run
RUN = early("rl_train", __file__, run_command, run_env)
EVAL = early("rl_eval", __file__, eval_command,
             lambda tmp: dict(os.environ, RL_CACHE_DIR=str(RUN.dir / "cache")), after=RUN)


@pytest.fixture(scope="module")
def finished_run():
    out = RUN.passed()
    return RUN.dir / "it", out.stdout


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_metrics_have_every_key_and_finite_values(finished_run):
    run_dir, _ = finished_run
    lines = read_metrics(run_dir)
    assert [m["step"] for m in lines] == [0, 1, 2, 3]  # step 0: the base model's evaluation
    assert "eval/greedy_accuracy" in lines[0] and "reward/mean" not in lines[0]
    assert ["eval/pass@2" in m for m in lines] == [True, False, True, True]
    lines = lines[1:]
    check_step_metrics(load_config(str(run_dir / "config.yaml")), lines)
    # the run's plan (plan.json) beside what it measured: the KV blocks vLLM allocated and the
    # bytes each TP rank received, exactly (docs/planning.md)
    plan = json.loads((run_dir / "plan.json").read_text())
    assert plan["fits"] and plan["engine"]["kv_blocks"] > 0
    for m in lines:
        assert m["plan/kv_blocks"] == m["rollout/kv_blocks"]
        assert m["plan/sync_bytes_per_tp_rank"] == m["sync/bytes_per_tp_rank"]
        assert m["plan/time_update"] > 0 and m["plan/trainer_peak_rss_mib"] > 0
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


def test_tensorboard_and_wandb_hold_every_step(finished_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from rl.observe.loggers import wandb_offline_history

    run_dir, _ = finished_run
    lines = read_metrics(run_dir)[1:]
    want = [(m["step"], m["reward/mean"]) for m in lines]
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    tb = [(e.step, e.value) for e in events.Scalars("reward/mean")]
    assert [s for s, _ in tb] == [s for s, _ in want]
    # TensorBoard keeps float32: one rounding, u = 2^-24 relative
    assert [v for _, v in tb] == pytest.approx([v for _, v in want], rel=2.0 ** -24, abs=0)
    from tensorboard.plugins.hparams import plugin_data_pb2

    assert "config/text_summary" in events.Tags()["tensors"], events.Tags()
    start = plugin_data_pb2.HParamsPluginData.FromString(
        events.PluginTagToContent("hparams")["_hparams_/session_start_info"])
    hparams = start.session_start_info.hparams
    assert hparams["algorithm.loss.kl_coef"].number_value == pytest.approx(0.01)
    assert hparams["run.name"].string_value == "it"
    wandb_rows = [r for r in wandb_offline_history(run_dir) if "reward/mean" in r]
    assert [(r["_step"], r["reward/mean"]) for r in wandb_rows] == want


def test_timeline_has_a_track_per_actor_and_the_step_phases(finished_run):
    run_dir, _ = finished_run
    trace = json.loads((run_dir / "timeline.json").read_text())["traceEvents"]
    tracks = {e["pid"]: e["args"]["name"] for e in trace
              if e["ph"] == "M" and e["name"] == "process_name"}
    assert sorted(tracks.values()) == ["driver (controller)", "worker 0 (trainer rank 0 + engine 0)",
                                       "worker 1 (trainer rank 1 + engine 1)"]
    spans = [e for e in trace if e["ph"] == "X"]
    assert all(e["dur"] >= 0 and e["ts"] > 0 for e in spans)
    for track in tracks.values():
        names = {e["name"] for e in spans if tracks[e["pid"]] == track}
        want = {"generate", "prepare", "update", "sync", "checkpoint"}
        want |= {"reward"} if track.startswith("driver") else {"verification"}
        assert want <= names, (track, want - names)
    # one wall clock: a worker's update of step 2 lies inside the driver's update of step 2
    driver = next(e for e in spans if e["name"] == "update" and e["args"]["step"] == 2
                  and tracks[e["pid"]].startswith("driver"))
    worker = next(e for e in spans if e["name"] == "update" and e["args"]["step"] == 2
                  and tracks[e["pid"]].startswith("worker 0"))
    assert driver["ts"] <= worker["ts"] and worker["ts"] + worker["dur"] <= driver["ts"] + driver["dur"]


def test_no_held_out_prompt_is_trained_on(finished_run):
    run_dir, _ = finished_run
    held = [json.loads(x)["prompt"] for x in (run_dir / "eval" / "step_0.jsonl").open()]
    trained = {json.loads(x)["prompt"] for x in (run_dir / "rollouts.jsonl").open()}
    assert len(held) == len(set(held)) > 10 and len(trained) > 10
    assert not trained & set(held)
    assert sorted((run_dir / "eval").iterdir()) == [run_dir / "eval" / f"step_{n}.jsonl"
                                                    for n in (0, 2, 3)]


def test_rl_eval_of_the_base_model_reproduces_the_step_0_evaluation(finished_run):
    run_dir, _ = finished_run
    EVAL.passed()
    got = json.loads((EVAL.dir / "eval.json").read_text())
    step0 = read_metrics(run_dir)[0]
    keys = sorted(k for k in step0 if k.startswith("eval/"))
    assert keys == sorted(k for k in got if k.startswith("eval/")) and len(keys) == 5
    assert {k: got[k] for k in keys} == {k: step0[k] for k in keys}
    want = (run_dir / "eval" / "step_0.jsonl").read_text()
    assert (EVAL.dir / "step_0.jsonl").read_text() == want
