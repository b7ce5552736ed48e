"""LoRA adapters (PEFT) on the policy: where they go, their names, their merge into the base.

PEFT injects each adapter into the HF model in place: a target linear `...q_proj` becomes a
LoRA layer holding the frozen `...q_proj.base_layer.weight` and the trained
`...q_proj.lora_A.default.weight` (r x in) and `...q_proj.lora_B.default.weight` (out x r); its
output is base(x) + (alpha / r) * B A x. The trainer keeps training the HF model object itself
(rollouts and the update see the same module tree); `PeftModel` is only the handle that switches
the adapter off (the reference policy) and names the adapter files as PEFT saves them.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from update.config import LoraConfig

ADAPTER = "default"  # PEFT's name of the one adapter
BASE = ".base_layer."
LORA_A, LORA_B = f".lora_A.{ADAPTER}.", f".lora_B.{ADAPTER}."


def peft_config(cfg: LoraConfig):
    from peft import LoraConfig as PeftLoraConfig

    targets = cfg.target_modules
    return PeftLoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout,
                          target_modules="all-linear" if targets == ["all-linear"] else targets,
                          bias="none", task_type="CAUSAL_LM")


def add_adapters(model: torch.nn.Module, cfg: LoraConfig, seed: int = 0):
    """Inject the adapters into `model` in place (its base parameters frozen, B = 0 so that it
    starts as the base model); returns the PeftModel around it. A is drawn from a generator
    seeded with `seed` alone: every rank starts from the same adapters (ZeRO-3 shards each
    rank's own copy) and the process's random state is left as it was. ValueError when no
    module matches `target_modules`."""
    from peft import get_peft_model

    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return get_peft_model(model, peft_config(cfg))
    except ValueError as e:
        first = str(e).splitlines()[0]
        names = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                        if isinstance(m, torch.nn.Linear)})
        what = ("match no module of" if "not found" in first
                else "are refused by PEFT for")
        raise ValueError(f"target_modules={cfg.target_modules} {what} {type(model).__name__} "
                         f"({first}); its linear layers: {', '.join(names)} (or all-linear)"
                         ) from None


def check_targets(config, cfg: LoraConfig) -> None:
    """`cfg` fits a model of HF config `config` (built on the meta device: no weights): its
    targets match modules, and every one is a linear layer inside the model whose weight is its
    own. ValueError naming the offending modules otherwise. The merge (W + scale B A under W's
    name) and vLLM's LoRA both assume a linear layer; an embedding would get other adapter
    tensors (lora_embedding_A/B), and the output head's weight may be the input embeddings'
    (tied): merged into it, the adapter would be lost when the model ties them again."""
    from peft.tuners.lora import LoraLayer
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    head = model.get_output_embeddings()
    add_adapters(model, cfg)
    bad = sorted(name for name, m in model.named_modules()
                 if isinstance(m, LoraLayer)
                 and (type(m.base_layer) is not torch.nn.Linear or m.base_layer is head))
    if bad:
        raise ValueError(f"target_modules={cfg.target_modules} match {', '.join(bad[:4])}"
                         f"{' ...' if len(bad) > 4 else ''}, which take no adapter here: "
                         f"only the linear layers inside the model do (not embeddings nor "
                         f"the output head; all-linear picks exactly those)")


def is_adapter(name: str) -> bool:
    return LORA_A in name or LORA_B in name


def scale(cfg: LoraConfig) -> float:
    return cfg.alpha / cfg.rank


def base_name(name: str) -> str:
    """The HF model's own name of a parameter of the adapted model (`...q_proj.base_layer.weight`
    -> `...q_proj.weight`)."""
    return name.replace(BASE, ".")


def merged(full: dict[str, torch.Tensor], lora_scale: float) -> dict[str, torch.Tensor]:
    """The HF model's weights with every adapter merged: W + scale * B @ A under W's own name;
    adapter tensors dropped, other weights as they are (not copied). `full`: every parameter of
    the adapted model, whole."""
    out = {}
    for name, w in full.items():
        if is_adapter(name):
            continue
        if BASE in name and name.endswith(".weight"):
            stem = name[:-len(BASE + "weight")]
            a, b = full.get(stem + LORA_A + "weight"), full.get(stem + LORA_B + "weight")
            if a is not None and b is not None:
                w = torch.addmm(w, b.to(w.dtype), a.to(w.dtype), alpha=lora_scale)
        out[base_name(name)] = w
    return out


def adapter_file_name(name: str) -> str:
    """The name PEFT's adapter files give an adapter tensor (`model.layers.0...lora_A.default.
    weight` -> `base_model.model.model.layers.0...lora_A.weight`)."""
    return "base_model.model." + name.replace(f".{ADAPTER}.", ".")


def adapter_config(cfg: LoraConfig, base_model: str = "") -> dict:
    """adapter_config.json of the adapter (what `peft` and vLLM read)."""
    config = peft_config(cfg).to_dict()
    config["base_model_name_or_path"] = base_model
    config["target_modules"] = sorted(config["target_modules"]) if isinstance(
        config["target_modules"], (set, list)) else config["target_modules"]
    return json.loads(json.dumps(config, default=sorted))


def write_adapter(directory: str | Path, tensors: dict[str, torch.Tensor], config: dict) -> int:
    """An adapter directory that `peft.PeftModel.from_pretrained` and vLLM load: tensors under
    their PEFT file names (adapter_model.safetensors) and adapter_config.json; returns the
    tensors' bytes."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    named = {adapter_file_name(n): t.detach().contiguous().cpu() for n, t in tensors.items()}
    save_file(named, str(directory / "adapter_model.safetensors"))
    (directory / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return sum(t.numel() * t.element_size() for t in named.values())


def plain_model(config, weights: dict[str, torch.Tensor],
                buffers: dict[str, torch.Tensor]) -> torch.nn.Module:
    """An HF model of `config` whose parameters are `weights` and buffers `buffers` (HF names;
    not copied): what a sync of the merged model sends from."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    missing, unexpected = model.load_state_dict(weights, strict=False, assign=True)
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
        missing = [k for k in missing if k != "lm_head.weight"]
    for name, buf in buffers.items():  # non-persistent ones (rotary inv_freq) included
        owner, _, leaf = base_name(name).rpartition(".")
        model.get_submodule(owner).register_buffer(leaf, buf, persistent=leaf in
                                                   model.get_submodule(owner).state_dict())
    if missing or unexpected:
        raise RuntimeError(f"merged weights do not fit {type(model).__name__}: missing "
                           f"{missing[:3]}, unexpected {unexpected[:3]} (PEFT or transformers "
                           f"named them otherwise; sync.lora=adapters syncs without a merge)")
    return model.requires_grad_(False)
