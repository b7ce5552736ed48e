"""A decoder-only model's shape, read from its config.json (Llama, Qwen2, Mistral, SmolLM2 and
alike: RMSNorm, rotary positions, grouped-query attention, a gated MLP), and what follows from it
alone: parameter counts, the KV cache per token, FLOPs per token."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

# model_type -> whether q/k/v projections carry a bias (Qwen2 does; Llama, Mistral do not)
QKV_BIAS = {"qwen2": True}


@dataclass(frozen=True)
class ModelShape:
    hidden: int  # h
    layers: int  # L
    heads: int  # query heads
    kv_heads: int  # key/value heads (GQA: fewer)
    head_dim: int  # d
    intermediate: int  # I, the gated MLP's width
    vocab: int  # V
    tied: bool  # the head shares the embedding's weights
    qkv_bias: bool = False
    model_type: str = "llama"

    @classmethod
    def from_config(cls, config: dict) -> "ModelShape":
        """From a transformers config.json's fields."""
        try:
            heads = config["num_attention_heads"]
            return cls(hidden=config["hidden_size"], layers=config["num_hidden_layers"],
                       heads=heads, kv_heads=config.get("num_key_value_heads") or heads,
                       head_dim=config.get("head_dim") or config["hidden_size"] // heads,
                       intermediate=config["intermediate_size"], vocab=config["vocab_size"],
                       tied=bool(config.get("tie_word_embeddings", False)),
                       qkv_bias=config.get("attention_bias", QKV_BIAS.get(
                           config.get("model_type", ""), False)),
                       model_type=config.get("model_type", "llama"))
        except KeyError as e:
            raise ValueError(f"the model's config has no {e.args[0]!r}: the planner knows "
                             f"decoder-only models of the Llama/Qwen2 family") from None

    @classmethod
    def from_dir(cls, path: str | Path) -> "ModelShape":
        file = Path(path) / "config.json"
        if not file.is_file():
            raise ValueError(f"{path} has no config.json; give a Hugging Face model directory "
                             f"(a directory holding only its config.json will do)")
        return cls.from_config(json.loads(file.read_text()))

    # ---------------------------------------------------------------- parameters
    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    def layer_params(self) -> int:
        """One decoder layer: q, k, v, o, the gated MLP's three matrices, two norms."""
        h = self.hidden
        attn = h * self.q_dim + 2 * h * self.kv_dim + self.q_dim * h
        if self.qkv_bias:
            attn += self.q_dim + 2 * self.kv_dim
        return attn + 3 * h * self.intermediate + 2 * h

    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    def params(self) -> int:
        """Φ: the embedding, the layers, the final norm, the head unless tied."""
        head = 0 if self.tied else self.embedding_params()
        return self.embedding_params() + self.layers * self.layer_params() + self.hidden + head

    def linear_params(self) -> int:
        """What the matmuls of one token's forward read: the layers' and the head's weights
        (the embedding is a lookup)."""
        return self.layers * self.layer_params() + self.embedding_params()

    # ---------------------------------------------------------------- per token
    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """K and V of every layer: 2 · L · n_kv · d · bytes."""
        return 2 * self.layers * self.kv_dim * dtype_bytes

    def forward_flops(self, context: int) -> float:
        """FLOPs of one token's forward: 2 per weight a matmul reads, plus attention over
        `context` earlier tokens (q·k and p·v: 4 · L · heads · d per position)."""
        return 2.0 * self.linear_params() + 4.0 * self.layers * self.q_dim * context

    def lora_params(self, rank: int, targets: list[str]) -> int:
        """Adapter parameters: r · (in + out) for each targeted linear of each layer."""
        h, q, kv, i = self.hidden, self.q_dim, self.kv_dim, self.intermediate
        linears = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                   "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}
        chosen = linears if "all-linear" in targets else {
            n: io for n, io in linears.items() if any(n.endswith(t) or t.endswith(n)
                                                      for t in targets)}
        return self.layers * sum(rank * (a + b) for a, b in chosen.values())
