"""The engine wrapper's pure parts (the engine itself runs in tests/integration)."""


def write_model(path, shapes: dict) -> str:
    from safetensors.torch import save_file
    import torch

    path.mkdir()
    save_file({n: torch.zeros(s) for n, s in shapes.items()}, str(path / "model.safetensors"))
    return str(path)


def test_parameters_are_counted_from_the_safetensors_headers(tmp_path):
    from rollout.vllm_engine import model_num_params

    path = write_model(tmp_path / "m", {"a": (3, 4), "b": (5,), "c": (2, 3, 7)})
    assert model_num_params(path) == 12 + 5 + 42


def test_compiled_on_gpu_and_for_large_models_on_cpu_eager_otherwise(tmp_path):
    from rollout.config import RolloutConfig
    from rollout.vllm_engine import eager_mode

    small = write_model(tmp_path / "small", {"w": (100, 100)})  # 10k parameters
    auto = RolloutConfig(compile_min_params=10_000)
    assert eager_mode(RolloutConfig(compile_min_params=10_001), small, "cpu") is True
    assert eager_mode(auto, small, "cpu") is False  # at the threshold: compiled
    assert eager_mode(RolloutConfig(compile_min_params=10**12), small, "cuda") is False
    # the recipe's word wins either way
    assert eager_mode(RolloutConfig(enforce_eager=True), small, "cuda") is True
    assert eager_mode(RolloutConfig(enforce_eager=False, compile_min_params=10**12), small,
                      "cpu") is False
    # speculative decoding stays on the path it was measured on
    assert eager_mode(RolloutConfig(compile_min_params=0, speculative_method="ngram"), small,
                      "cpu") is True
