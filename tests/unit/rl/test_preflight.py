"""Start-up checks: bfloat16 on a CPU without bf16 kernels warns; a tensor-parallel size that
does not fit the model or the engines' cores is refused."""
import pytest

from rl.config import load_config
from rl.preflight import bf16_warning, native_bf16, preflight


@pytest.mark.parametrize("overrides, keys, fix", [
    (["trainer.dtype=bfloat16"], "trainer.dtype=bfloat16 on", "set trainer.dtype=float32"),
    (["rollout.dtype=bfloat16"], "rollout.dtype=bfloat16 on", "set rollout.dtype=float32"),
    (["trainer.dtype=bfloat16", "rollout.dtype=bfloat16"],
     "trainer.dtype=bfloat16 and rollout.dtype=bfloat16 on",
     "set trainer.dtype=float32 rollout.dtype=float32"),
])
def test_bf16_without_bf16_kernels_warns_with_the_keys_and_the_fix(overrides, keys, fix):
    message = bf16_warning(load_config(None, overrides), native=False)
    assert message.startswith("warning: " + keys) and message.endswith(fix), message


@pytest.mark.parametrize("overrides, native", [
    (["trainer.dtype=float32", "rollout.dtype=float32"], False),  # nothing in bf16
    (["trainer.dtype=bfloat16", "rollout.dtype=bfloat16"], True),  # kernels there
    (["trainer.dtype=bfloat16", "ray.address=auto"], False),  # the workers are elsewhere
])
def test_no_bf16_warning_where_it_does_not_apply(overrides, native):
    assert bf16_warning(load_config(None, overrides), native=native) is None


def test_preflight_prints_the_warning_on_this_machine_exactly_when_it_lacks_bf16(tmp_path, capsys):
    data = tmp_path / "train.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": "2"}\n' * 4)
    cfg = load_config(None, [f"data.train_path={data}", "trainer.dtype=bfloat16",
                             "model.path=builtin:tiny-qwen2",
                             "reward.functions=[{name: exact_answer}]"])
    preflight(cfg)
    printed = capsys.readouterr().err
    assert ("bf16 matmuls run about 100x slower" in printed) == (not native_bf16()), printed


def test_tensor_parallel_size_must_fit_the_model_and_the_engines_cores():
    from rl.config import ConfigError
    from rl.preflight import check_tensor_parallel

    def cfg(*overrides):
        return load_config("recipes/quickstart_disaggregated.yaml",
                           ["ray.num_rollout_workers=1", *overrides])

    check_tensor_parallel(cfg("rollout.tensor_parallel_size=2"), num_cpus=2)  # 4 heads, 2 KV
    with pytest.raises(ConfigError, match=r"tensor_parallel_size=3 does not fit .*num_heads=4.*"
                                          r"sizes that fit this model: 1, 2, 4$"):
        check_tensor_parallel(cfg("rollout.tensor_parallel_size=3"), num_cpus=4)
    with pytest.raises(ConfigError, match=r"gets 1 core\(s\) here, which fits TP <= 1"):
        check_tensor_parallel(cfg("rollout.tensor_parallel_size=2"), num_cpus=1)
    with pytest.raises(ConfigError, match=r"each of the 2 rollout engine"):  # 2 engines, 2 cores
        check_tensor_parallel(cfg("rollout.tensor_parallel_size=2",
                                  "ray.num_rollout_workers=2"), num_cpus=2)


def test_colocated_tensor_parallel_checks_the_model_first_then_names_workers_that_split():
    """The model's heads come first (rollout.tensor_parallel_size=3 on 4 heads), and the worker
    count a refusal names passes the next check, the samples' split (256 samples here)."""
    import re

    from rl.config import ConfigError
    from rl.preflight import check_tensor_parallel

    with pytest.raises(ConfigError, match=r"does not fit .*num_heads=4"):
        check_tensor_parallel(load_config("recipes/quickstart.yaml",
                                          ["rollout.tensor_parallel_size=3"]), num_cpus=8)
    tp4 = ["rollout.tensor_parallel_size=4", "ray.num_workers=2"]
    with pytest.raises(ConfigError, match=r"take the cores of 4 workers") as e:
        check_tensor_parallel(load_config("recipes/quickstart.yaml", tp4), num_cpus=8)
    fix = re.search(r"set (ray.num_workers=\d+)", str(e.value))[1]
    check_tensor_parallel(load_config("recipes/quickstart.yaml", tp4 + [fix]), num_cpus=8)
    six = ["rollout.n=3", "rollout.prompts_per_step=2"]  # 6 samples: no 4 workers split them
    with pytest.raises(ConfigError, match=r"ray.num_workers=2 is not a multiple of 4: use "
                                          r"placement=disaggregated \(no multiple of 4 workers"):
        check_tensor_parallel(load_config("recipes/quickstart.yaml", tp4 + six), num_cpus=8)
    check_tensor_parallel(load_config("recipes/quickstart.yaml", tp4 + six + [
        "placement=disaggregated", "ray.num_rollout_workers=1"]), num_cpus=8)
