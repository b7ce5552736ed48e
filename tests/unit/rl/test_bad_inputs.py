"""Bad input to `rl-train`: each case ends in one line `rl-train: ...` that names the key, file or
row and says the fix, exit status 2, no traceback, and Ray never started. docs/errors.md ("When
rl-train refuses to start") lists the same cases."""
import json
import shutil
from pathlib import Path

import pytest

from rl.cli import main

QUICK = "recipes/quickstart.yaml"


class RayStarted(Exception):
    pass


def refuse(capsys, argv: list[str], *expected: str) -> str:
    import rl.run.cluster
    import rl.run.lifecycle

    def start_ray(cfg, num_cpus=None):  # a refusal must come before this (others may hold Ray)
        raise RayStarted("refused after Ray started")

    modules = (rl.run.cluster, rl.run.lifecycle)  # rl-eval calls cluster's, rl-train lifecycle's
    real = [m.start_ray for m in modules]
    for module in modules:
        module.start_ray = start_ray
    try:
        code = main(argv)
    finally:
        for module, fn in zip(modules, real):
            module.start_ray = fn
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert err.startswith("rl-train: ") and "\n" not in err and "Traceback" not in err, err
    for text in expected:
        assert text in err, (text, err)
    return err


@pytest.fixture
def data(tmp_path):
    def write(name: str, text: str) -> str:
        path = tmp_path / name
        path.write_text(text)
        return str(path)
    return write


CONFIG_CASES = {
    "unknown key": (["rollout.temprature=1.0"], ["rollout.temprature", "temperature"]),
    "colocated TP ranks over a part of a worker": (
        ["rollout.tensor_parallel_size=2", "ray.num_workers=3", "rollout.prompts_per_step=24"],
        ["rollout.tensor_parallel_size=2", "ray.num_workers=3", "multiple of 2"]),
    "colocated TP engines on GPUs": (
        ["rollout.tensor_parallel_size=2", "ray.num_gpus_per_worker=1"],
        ["rollout.tensor_parallel_size=2", "placement=disaggregated"]),
    "wrong type": (["rollout.n=many"], ["rollout.n", "many"]),
    "override without =": (["rollout.n"], ["key=value"]),
    "unknown advantage": (["algorithm.advantage=grpp"], ["algorithm.advantage", "grpo"]),
    "unknown policy loss": (["algorithm.loss.policy_loss=ppo_clipp"],
                            ["algorithm.loss.policy_loss", "ppo_clip"]),
    "unknown aggregation": (["algorithm.loss.loss_agg=token_avg"],
                            ["algorithm.loss.loss_agg", "token_mean"]),
    "unknown KL estimator": (["algorithm.loss.kl_estimator=k9"],
                             ["algorithm.loss.kl_estimator", "k3"]),
    "unknown reward": (["reward.functions=[{name: exact_answr}]"], ["exact_answr", "exact_answer"]),
    "batch does not divide": (["rollout.prompts_per_step=3", "rollout.n=3"],
                              ["do not split evenly", "ray.num_workers"]),
    "unknown placement": (["placement=sideways"], ["placement", "disaggregated"]),
    "unknown trainer dtype": (["trainer.dtype=float8"], ["trainer.dtype", "bfloat16"]),
    "unknown ZeRO stage": (["trainer.zero_stage=5"], ["trainer.zero_stage", "in [0, 3]"]),
    "unknown logger": (["run.loggers=[jsonl,tensorbord]"], ["run.loggers", "tensorboard"]),
    "unknown environment": (["env.name=tool"], ["env.name", "tools"]),
    "unknown tool": (["env.name=tools", "env.tools=[calculater]"],
                     ["env.tools", "calculater", "calculator"]),
    "environment argument it does not take": (["env.name=tools", "env.args={retries: 2}"],
                                              ["env.tools/env.args", "retries"]),
    "tools without an environment": (["env.tools=[calculator]"], ["env.tools", "env.name"]),
    "multi-turn with speculative decoding": (["env.name=tools", "rollout.speculative_method=ngram"],
                                             ["rollout.speculative_method", "env.name=tools"]),
    "a turn longer than the trajectory's budget": (
        ["env.name=tools", "env.turn_max_new_tokens=64"],
        ["env.turn_max_new_tokens=64", "rollout.max_new_tokens=8"]),
    "scripted warm-up turns without an environment": (["warmup.target_turns=[x]"],
                                                      ["warmup.target_turns", "env.name"]),
    "gae without a critic": (["algorithm.advantage=gae"], ["algorithm.critic=true"]),
    "LoRA of rank 0": (["trainer.lora.rank=0"], ["trainer.lora.rank", ">= 1"]),
    "unknown LoRA key": (["trainer.lora.rnk=8"], ["trainer.lora.rnk", "rank, alpha"]),
    "LoRA with a critic": (["trainer.lora.rank=8", "algorithm.critic=true"],
                           ["trainer.lora", "algorithm.critic=true", "adapter config"]),
    "unknown LoRA sync": (["sync.lora=full"], ["sync.lora", "adapters, merged"]),
    "LoRA rank above vLLM's with adapter syncs": (["trainer.lora.rank=1024", "sync.lora=adapters"],
                                                  ["trainer.lora.rank=1024", "512",
                                                   "sync.lora=merged"]),
    "missing model": (["model.path=/nonexistent/model"], ["model.path", "does not exist"]),
    "unknown built-in model": (["model.path=builtin:gpt-9"], ["model.path", "tiny-qwen2"]),
    "missing data file": (["data.train_path=/nonexistent/rows.jsonl"],
                          ["/nonexistent/rows.jsonl", "data.train_path"]),
    "unknown data suffix": (["data.train_path=rows.csv"], ["rows.csv", ".jsonl"]),
    "unknown built-in data": (["data.train_path=builtin:poetry"], ["builtin:arithmetic"]),
    "unreachable ray.address": (["ray.address=127.0.0.1:1"], ["ray.address", "ray start --head"]),
    "rollout pool resources when colocated": (["ray.rollout_resources={rollout_node: 1}"],
                                              ["placement=disaggregated"]),
    "unknown pipeline mode": (["pipeline.mode=async"], ["pipeline.mode", "fully_async"]),
    "async pipeline when colocated": (["pipeline.mode=one_step"],
                                      ["same cores", "placement=disaggregated"]),
    "async pipeline with dynamic sampling": (
        ["placement=disaggregated", "pipeline.mode=fully_async", "algorithm.dynamic_sampling=true"],
        ["algorithm.dynamic_sampling", "pipeline.mode=sync"]),
    "async pipeline with speculative decoding": (
        ["placement=disaggregated", "pipeline.mode=one_step", "rollout.speculative_method=ngram"],
        ["rollout.speculative_method", "pipeline.mode=sync"]),
    "negative staleness bound": (["placement=disaggregated", "pipeline.mode=fully_async",
                                  "pipeline.max_staleness=-1"], ["pipeline.max_staleness"]),
    "unknown off-policy correction": (["algorithm.loss.correction=is"],
                                      ["algorithm.loss.correction", "decoupled"]),
    "held-out fraction out of range": (["data.eval_fraction=1.5"], ["data.eval_fraction", "[0, 1)"]),
    "periodic evaluation without a held-out set": (
        ["data.eval_fraction=0", "trainer.eval_every=10"],
        ["trainer.eval_every", "data.eval_fraction"]),
    "missing held-out file": (["data.eval_fraction=0", "data.eval_path=/nonexistent/held.jsonl"],
                              ["data.eval_path", "/nonexistent/held.jsonl"]),
    "periodic evaluation with an async pipeline": (
        ["placement=disaggregated", "pipeline.mode=one_step", "data.eval_fraction=0.1",
         "trainer.eval_every=10"],
        ["trainer.eval_every", "trainer.eval_every=0"]),
}


@pytest.mark.parametrize("case", list(CONFIG_CASES))
def test_config_level_inputs_are_refused_before_anything_starts(capsys, case):
    overrides, expected = CONFIG_CASES[case]
    refuse(capsys, [QUICK, *overrides], *expected)


def test_missing_recipe(capsys):
    refuse(capsys, ["recipes/quickstrat.yaml"], "recipes/quickstrat.yaml", "does not exist")


def test_recipe_that_is_not_yaml(capsys, data):
    path = data("broken.yaml", "run:\n  name: [unclosed\n")
    refuse(capsys, [path], "broken.yaml", "not valid YAML", "line")


def test_empty_data_file(capsys, data):
    path = data("rows.jsonl", "\n")
    refuse(capsys, [QUICK, f"data.train_path={path}"], "rows.jsonl", "has no rows")


def test_malformed_row_names_the_line(capsys, data):
    rows = [json.dumps({"prompt": "1+1?", "answer": "2"})] * 2 + ['{"prompt": "2+2?", "answer": ']
    path = data("rows.jsonl", "\n".join(rows) + "\n")
    refuse(capsys, [QUICK, f"data.train_path={path}"], "rows.jsonl", "line 3", "not valid JSON")


def test_row_that_is_not_an_object(capsys, data):
    path = data("rows.jsonl", json.dumps({"prompt": "1+1?", "answer": "2"}) + "\n[1, 2]\n")
    refuse(capsys, [QUICK, f"data.train_path={path}"], "line 2", "not an object")


def test_missing_prompt_key_names_the_row(capsys, data):
    rows = [{"prompt": "1+1?", "answer": "2"}, {"question": "2+2?", "answer": "4"}]
    path = data("rows.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
    refuse(capsys, [QUICK, f"data.train_path={path}"], "row 1", "'prompt'", "data.prompt_key")


def test_model_directory_that_is_not_a_model(capsys, tmp_path):
    refuse(capsys, [QUICK, f"model.path={tmp_path}"], "model.path", "no config.json")


def test_resume_with_no_run(capsys, tmp_path):
    refuse(capsys, [QUICK, f"run.output_dir={tmp_path}", "--resume"], "--resume",
           "no run directory")


def test_resume_with_no_checkpoint(capsys, tmp_path):
    (tmp_path / "quickstart").mkdir()
    refuse(capsys, [QUICK, f"run.output_dir={tmp_path}", "--resume"], "no complete checkpoint",
           "trainer.checkpoint_every")


def test_resume_of_another_recipe(capsys, tmp_path):
    from rl.config import load_config, to_yaml
    from rl.run import checkpoint as ckpt

    other = load_config("recipes/dapo.yaml")
    run = tmp_path / "quickstart"
    tmp = ckpt.begin(run, 2)
    (tmp / "config.yaml").write_text(to_yaml(other))
    (tmp / "controller.json").write_text(json.dumps({"step": 2, "model_path": str(tmp_path),
                                                     "model_sha256": ""}))
    ckpt.commit(run, tmp, 2, keep=0)
    refuse(capsys, [QUICK, f"run.output_dir={tmp_path}", "--resume"], "config differs",
           "algorithm.name", "--allow-config-change")


# cases that need the tokenizer: the controller refuses them before Ray starts
@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    import os

    from rl.data.models import resolve_model_path

    os.environ.setdefault("RL_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
    return Path(resolve_model_path("builtin:tiny-qwen2"))


def test_every_prompt_too_long(capsys, tmp_path, tiny_model):
    refuse(capsys, [QUICK, f"model.path={tiny_model}", "rollout.max_model_len=16",
                    "warmup.sft_steps=0", f"run.output_dir={tmp_path}"],
           "every prompt", "rollout.max_model_len")
    assert not list(tmp_path.iterdir()), "a refused run leaves no run directory"


def test_lora_targets_that_match_no_module(capsys, tmp_path, tiny_model):
    refuse(capsys, [QUICK, f"model.path={tiny_model}", "trainer.lora.target_modules=[qproj]",
                    "warmup.sft_steps=0", f"run.output_dir={tmp_path}"],
           "trainer.lora.target_modules=['qproj']", "q_proj")
    assert not list(tmp_path.iterdir()), "a refused run leaves no run directory"


def test_tokenizer_without_chat_template(capsys, tmp_path, tiny_model):
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    for extra in model.glob("chat_template.*"):
        extra.unlink()
    refuse(capsys, [QUICK, f"model.path={model}", "warmup.sft_steps=0",
                    f"run.output_dir={tmp_path / 'runs'}"], "no chat template", "model.path")


def test_prompt_of_the_wrong_type(capsys, data, tmp_path, tiny_model):
    path = data("rows.jsonl", json.dumps({"prompt": 42, "answer": "2"}) + "\n")
    refuse(capsys, [QUICK, f"model.path={tiny_model}", f"data.train_path={path}",
                    "warmup.sft_steps=0", f"run.output_dir={tmp_path / 'runs'}",
                    # one row: nothing to hold out
                    "data.eval_fraction=0", "trainer.eval_every=0"],
           "row 0", "must be a string or a list")
