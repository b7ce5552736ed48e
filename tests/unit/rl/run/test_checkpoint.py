"""Checkpoint publishing (a crash mid-save never damages `latest`), pruning, finding what
--resume means, and refusing a resume that would not continue the same run."""
import json
from dataclasses import asdict

import pytest

from rl.config import ConfigError, load_config, to_yaml
from rl.run import checkpoint as ckpt


def fake_model(path):
    path.mkdir(parents=True)
    (path / "config.json").write_text('{"hidden_size": 8}')
    (path / "model.safetensors").write_bytes(b"weights")
    return path


def write_checkpoint(run_dir, step, cfg, model):
    tmp = ckpt.begin(run_dir, step)
    (tmp / "config.yaml").write_text(to_yaml(cfg))
    state = ckpt.DriverState(step, {}, str(model), ckpt.model_digest(str(model)))
    (tmp / "controller.json").write_text(json.dumps({  # as ckpt.save writes it
        "step": step, **asdict(state), "metrics": {"step": step}}))
    return tmp


def test_a_crash_before_or_during_publishing_leaves_latest_on_the_previous_one(tmp_path):
    cfg, model = load_config(None), fake_model(tmp_path / "model")
    run = tmp_path / "run"
    ckpt.commit(run, write_checkpoint(run, 2, cfg, model), 2, keep=0)
    tmp = write_checkpoint(run, 4, cfg, model)  # a crash now: written, not published
    assert ckpt.latest_checkpoint(run).name == "step_2"
    tmp.rename(tmp.with_name("step_4"))  # a crash between the rename and the marker
    assert ckpt.latest_checkpoint(run).name == "step_2"
    assert ckpt.find_resume_point(cfg, str(run)).step == 2
    ckpt.commit(run, write_checkpoint(run, 6, cfg, model), 6, keep=0)
    assert ckpt.find_resume_point(cfg, str(run)).step == 6
    assert ckpt.find_resume_point(cfg, str(run / "checkpoints" / "step_2")).step == 2


def test_keep_checkpoints_prunes_the_oldest(tmp_path):
    cfg, model = load_config(None), fake_model(tmp_path / "model")
    run = tmp_path / "run"
    for step in (1, 2, 3, 4):
        ckpt.commit(run, write_checkpoint(run, step, cfg, model), step, keep=2)
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*")) == ["step_3", "step_4"]


def test_resume_finds_the_newest_run_of_the_name(tmp_path):
    cfg = load_config(None, [f"run.output_dir={tmp_path}", "run.name=q"])
    with pytest.raises(ConfigError, match="no run directory"):
        ckpt.find_resume_point(cfg, None)
    model = fake_model(tmp_path / "model")
    for name in ("q", "q-2", "q-10"):
        (tmp_path / name).mkdir()
    with pytest.raises(ConfigError, match=r"q-10\) has no complete checkpoint"):
        ckpt.find_resume_point(cfg, None)
    ckpt.commit(tmp_path / "q-10", write_checkpoint(tmp_path / "q-10", 3, cfg, model), 3, 0)
    assert ckpt.find_resume_point(cfg, None).run_dir == (tmp_path / "q-10").resolve()
    with pytest.raises(ConfigError, match="no such directory"):
        ckpt.find_resume_point(cfg, str(tmp_path / "nope"))


def test_resume_refuses_config_changes_and_a_changed_base_model(tmp_path):
    cfg, model = load_config(None), fake_model(tmp_path / "model")
    run = tmp_path / "run"
    ckpt.commit(run, write_checkpoint(run, 2, cfg, model), 2, keep=0)
    point = ckpt.find_resume_point(cfg, str(run))
    longer = load_config(None, ["trainer.total_steps=99", "run.loggers=[jsonl,tensorboard]"])
    ckpt.check_resume(longer, point, allow_change=False)  # how long and what it logs: fine
    other = load_config(None, ["algorithm.loss.kl_coef=0.5", "rollout.n=2"])
    with pytest.raises(ConfigError, match=r"algorithm.loss.kl_coef \(0.0 -> 0.5\), rollout.n "
                                          r"\(8 -> 2\); .*--allow-config-change"):
        ckpt.check_resume(other, point, allow_change=False)
    ckpt.check_resume(other, point, allow_change=True)
    (model / "model.safetensors").write_bytes(b"other weights")
    with pytest.raises(ConfigError, match="base model .* is gone or changed"):
        ckpt.check_resume(cfg, point, allow_change=False)


def test_resuming_from_an_older_checkpoint_abandons_the_newer_ones(tmp_path):
    cfg, model = load_config(None), fake_model(tmp_path / "model")
    run = tmp_path / "run"
    for step in (2, 4, 6):
        ckpt.commit(run, write_checkpoint(run, step, cfg, model), step, keep=0)
    point = ckpt.find_resume_point(cfg, str(run / "checkpoints" / "step_2"))
    ckpt.supersede_newer(point)
    assert ckpt.latest_checkpoint(run).name == "step_2"  # a restart continues from here
    assert [p.name for p in ckpt.published(run / "checkpoints")] == ["step_2"]
    assert (run / "checkpoints" / "step_6.superseded").is_dir()
    # saving step 4 again, with keep=1: the new step_4 is latest and survives the pruning
    ckpt.commit(run, write_checkpoint(run, 4, cfg, model), 4, keep=1)
    assert ckpt.latest_checkpoint(run).name == "step_4"
    assert [p.name for p in ckpt.published(run / "checkpoints")] == ["step_4"]


def test_a_step_saved_again_replaces_the_old_one_without_a_gap(tmp_path):
    cfg, model = load_config(None), fake_model(tmp_path / "model")
    run = tmp_path / "run"
    ckpt.commit(run, write_checkpoint(run, 2, cfg, model), 2, keep=0)
    ckpt.commit(run, write_checkpoint(run, 2, cfg, model), 2, keep=0)
    assert ckpt.latest_checkpoint(run).name == "step_2"
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["latest", "step_2"]
