"""Config loading: YAML + overrides onto the typed schema; errors name the key and the fix."""
from pathlib import Path

import pytest

from rl.config import ConfigError, grad_accum_steps, load_config
from rl.schema import AlgorithmConfig, Config
from update.config import LossConfig

RECIPES = sorted((Path(__file__).parents[3] / "recipes").glob("*.yaml"))


def test_defaults_and_overrides():
    cfg = load_config(None, ["rollout.n=4", "algorithm.loss.kl_coef=0.05", "ray.address=auto"])
    assert isinstance(cfg, Config)
    assert cfg.rollout.n == 4 and cfg.algorithm.loss.kl_coef == 0.05 and cfg.ray.address == "auto"


@pytest.mark.parametrize("override, message", [
    ("rollout.nn=3", r"config key 'rollout.nn' \(in the override rollout.nn=3\) is not known"
                     r".*known keys in rollout: n, "),
    ("foo=1", r"config key 'foo' \(in the override foo=1\) is not known.*known keys: run, model"),
    ("rollout.n=abc", r"config key 'rollout.n' \(in the override rollout.n=abc\) has a wrong "
                      r"value.*give a int"),
    ("algorithm.loss.klcoef=1", "algorithm.loss.klcoef.*Did you mean: 'kl_coef'"),
    ("rollout", "override 'rollout' is not key=value"),
    ("rollout.n=3 rollout.prompts_per_step=5", "15 samples do not split evenly"),
    ("trainer.zero_stage=4", r"config key 'trainer.zero_stage' = 4 \(from the override "
                             r"trainer.zero_stage=4\) is out of range: give a value in \[0, 3\]"),
    ("placement=split", "placement='split' is not known; use one of: colocated, disaggregated"),
    ("placement=disaggregated ray.num_rollout_workers=0", "needs at least one rollout engine"),
    ("sync.checksum=md5", "sync.checksum='md5' is not known; use one of: sum64, crc32"),
    ("rollout.cpu_linear=fast", "rollout.cpu_linear='fast' is not known; use one of: auto, plain, "
                                "repack, packed"),
    ("trainer.gradient_checkpointing=sometimes",
     "trainer.gradient_checkpointing='sometimes': use true, false or auto"),
    ("trainer.gradient_checkpointing=1", "give a bool or str like the default 'auto'"),
])
def test_bad_config_errors_name_the_key(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, override.split())


@pytest.mark.parametrize("cpu_linear, dtype, mode", [
    ("auto", "float32", "repack"), ("auto", "bfloat16", "repack"), ("plain", "bfloat16", "plain"),
    ("packed", "float32", "packed")])
def test_cpu_linear_auto_repacks_in_every_dtype(cpu_linear, dtype, mode):
    cfg = load_config(None, [f"rollout.cpu_linear={cpu_linear}", f"rollout.dtype={dtype}"])
    assert cfg.rollout.cpu_linear_mode() == mode


def test_yaml_unknown_key_names_the_file(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("rollout:\n  temprature: 0.5\n")
    with pytest.raises(ConfigError, match=r"rollout.temprature' \(in .*r.yaml\)"):
        load_config(str(recipe))


def test_an_override_beside_a_recipe_is_named_as_the_override(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("rollout:\n  temperature: 0.5\n")
    with pytest.raises(ConfigError, match=r"'trainer.output_dir' \(in the override "
                                          r"trainer.output_dir=/tmp/x\) is not known"):
        load_config(str(recipe), ["trainer.output_dir=/tmp/x"])
    with pytest.raises(ConfigError, match=r"'trainer.lr' \(in the override trainer.lr=abc\)"):
        load_config(str(recipe), ["trainer.lr=abc"])
    # a key that only starts like another override's is not set by it
    with pytest.raises(ConfigError, match=r"'rollout.nn' \(in the override rollout.nn=3\)"):
        load_config(str(recipe), ["rollout.nn=3", "rollout.n=4"])


def test_an_unknown_key_in_a_list_item_names_its_path_its_section_and_its_source(tmp_path):
    override = "reward.functions=[{name: exact_answer, wieght: 2}]"
    with pytest.raises(ConfigError, match=r"'reward.functions\[0\].wieght' \(in the override "
                       r"reward.functions=\[\{name: exact_answer, wieght: 2\}\]\) is not known.*"
                       r"known keys in reward.functions\[0\]: name, weight, alias, args$"):
        load_config("recipes/quickstart.yaml", [override])
    recipe = tmp_path / "r.yaml"
    recipe.write_text("reward:\n  functions:\n  - name: exact_answer\n  - {name: x, wieght: 2}\n")
    with pytest.raises(ConfigError, match=r"'reward.functions\[1\].wieght' \(in .*r.yaml\)"):
        load_config(str(recipe))
    load_config("recipes/quickstart.yaml", [override.replace("wieght", "weight")])  # the fix


def test_max_new_tokens_beyond_max_model_len_names_both_keys():
    with pytest.raises(ConfigError, match=r"^rollout.max_new_tokens=600 leaves no room for a "
                                          r"prompt in rollout.max_model_len=512 .*lower "
                                          r"rollout.max_new_tokens below 512, or raise "
                                          r"rollout.max_model_len to 600 plus the longest prompt"):
        load_config("recipes/quickstart.yaml", ["rollout.max_new_tokens=600"])
    load_config("recipes/quickstart.yaml", ["rollout.max_new_tokens=511"])  # the first fix


def test_grad_accum_steps():
    # 16 prompts x 8 samples / 2 ranks = 64 per rank; micro 24 -> 3 micro-batches
    cfg = load_config(None, ["rollout.prompts_per_step=16", "rollout.n=8", "ray.num_workers=2",
                             "trainer.micro_batch_size=24"])
    assert grad_accum_steps(cfg) == 3


@pytest.mark.parametrize("recipe", RECIPES, ids=[r.name for r in RECIPES])
def test_every_recipe_loads_and_opens_with_its_command(recipe):
    load_config(str(recipe))
    assert recipe.read_text().splitlines()[0] == f"# rl-train recipes/{recipe.name}"


def test_recipes_exist():
    assert any(r.name == "quickstart.yaml" for r in RECIPES)


def test_every_placement_the_config_accepts_has_a_class():
    from rl.run import placement
    from rl.schema import PLACEMENTS

    assert set(placement.PLACEMENTS) == set(PLACEMENTS)  # the two lists of names stay in step


def test_one_pass_only_where_old_logprobs_equal_the_policy():
    assert AlgorithmConfig().one_pass()
    assert AlgorithmConfig(loss=LossConfig(kl_coef=0.01, use_kl_loss=True)).one_pass()
    # KL as a reward penalty needs reference logprobs before the advantages: keep the pass
    assert not AlgorithmConfig(loss=LossConfig(kl_coef=0.01, use_kl_loss=False)).one_pass()
    assert not AlgorithmConfig(critic=True).one_pass()
    assert not AlgorithmConfig(ppo_epochs=2).one_pass()
    assert not AlgorithmConfig(num_mini_batches=2).one_pass()
    assert not AlgorithmConfig(old_logprobs="pass").one_pass()


def test_loggers_are_checked_before_anything_starts(monkeypatch):
    import importlib.util

    with pytest.raises(ConfigError, match=r"run.loggers has 'tensorbord'; known: jsonl, tensorboard"):
        load_config(None, ["run.loggers=[jsonl,tensorbord]"])
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError, match=r"'wandb' but the wandb package is not installed; pip "):
        load_config(None, ["run.loggers=[jsonl,wandb]"])


def test_rollout_resources_need_engines_of_their_own():
    cfg = load_config(None, ["placement=disaggregated", "ray.rollout_resources={rollout_node: 1}",
                             "ray.trainer_resources={trainer_node: 0.5}"])
    assert cfg.ray.rollout_resources == {"rollout_node": 1.0}
    with pytest.raises(ConfigError, match="ray.rollout_resources .* needs placement=disaggregated"):
        load_config(None, ["placement=colocated", "ray.rollout_resources={rollout_node: 1}"])
