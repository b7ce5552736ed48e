"""Bytes per device: a trainer rank (model states by ZeRO stage, ZeRO-3's gathered weights, a
micro-batch's activations and logits, the reference, the critic, LoRA) and a rollout engine rank
(weights, KV cache), then what a device holds under each placement.

Glossary: Φ parameters, N trainer ranks, t TP ranks per engine, L layers, h hidden, I the MLP's
width, V vocab, T tokens of a micro-batch, R its response tokens, b bytes of an element.
"""
from __future__ import annotations

from dataclasses import dataclass

from rl.plan.shape import ModelShape

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# elements a decoder layer keeps per token it runs, for its backward (HF Llama/Qwen2 with
# SDPA): the two norms' inputs and outputs and the residual (6h), the rotated q and attention's
# output (2q), the MLP's gate, up and act(gate)*up (3I: update.mlp recomputes act(gate) in the
# backward); the keys and values are attention_key_elements. Counted with saved-tensor hooks
# on bench-100m's shared-prompt forward (docs/planning.md; tests/unit/rl/plan/test_memory.py)
def layer_activation_elements(s: ModelShape) -> int:
    return 6 * s.hidden + 2 * s.q_dim + 3 * s.intermediate


def attention_key_elements(s: ModelShape, side: TrainerSide) -> int:
    """The keys and values a layer's attention keeps for its backward, per micro-batch:
    transformers repeats the KV heads up to the query heads before SDPA whenever the batch has a
    padding mask (an RL batch always has), so 2·q_dim elements a key, for every sequence that
    reads it: each token the forward runs (micro_tokens) is a key of its own sequence, and with
    shared prompts each sample reads its prompt's P keys again in the responses' pass (gathered
    before its own)."""
    t, _ = micro_tokens(side)
    again = side.micro_batch * side.prompt_tokens if side.share_prompts else 0
    return 2 * s.q_dim * (t + again)


# float32 copies of the response logits the loss holds at once: the logits its backward reads,
# and the gradient that backward writes in place (update.forward.TokenLogprob)
LOGIT_COPIES = 2


@dataclass(frozen=True)
class TrainerSide:
    """What sizes a trainer rank (from the recipe)."""
    ranks: int
    zero_stage: int
    dtype: str  # float32 | bfloat16
    bf16_mode: str  # weights | autocast
    micro_batch: int  # samples per forward on a rank
    prompt_tokens: int
    response_tokens: int
    group_size: int  # samples per prompt (n): the shared-prompt layout runs a prompt once
    share_prompts: bool
    checkpointing: bool
    whole_model_max: int  # trainer.zero3_whole_model_max
    release: bool  # trainer.zero3_release_params
    reference: bool  # a frozen reference copy (KL without LoRA)
    critic: bool
    lora_params: int = 0  # adapter parameters (0: full fine-tuning)
    gpu: bool = False


def state_bytes(trained: float, side: TrainerSide) -> dict:
    """Weights, gradients and optimizer state of `trained` parameters on one rank: mixed bf16
    keeps 2 + 2 + 12 bytes (bf16 weights and gradients, an fp32 master copy, Adam's m and v),
    float32 and autocast 4 + 4 + 8; ZeRO-1 shards the optimizer over N, ZeRO-2 the gradients
    too, ZeRO-3 the weights too (the ZeRO paper's 4Φ + 12Φ/N, 2Φ + 14Φ/N, 16Φ/N in bf16)."""
    w, g, o = (2, 2, 12) if side.dtype == "bfloat16" and side.bf16_mode == "weights" else (4, 4, 8)
    n, z = side.ranks, side.zero_stage
    return {"weights": trained * w / (n if z >= 3 else 1),
            "gradients": trained * g / (n if z >= 2 else 1),
            "optimizer": trained * o / (n if z >= 1 else 1)}


def zero_buffers(trained: float, side: TrainerSide, bucket: float | None = None) -> float:
    """What DeepSpeed's ZeRO optimizer holds beyond the model states: a flat float32 copy of its
    partition beside float32 weights (bf16's 12 bytes count it already), and the contiguous
    bucket gradients are reduced through (`bucket` elements: reduce_bucket_size, 5e8 by default;
    update.zero sets a ZeRO-3 model gathered module by module its largest gather unit). ZeRO-3
    keeps the copy too: DeepSpeed 0.19 would reuse float32 weights as their master copy, but it
    tests `tensor.device == "cpu"` (or "cuda:0"), and a torch.device never equals a string
    (found by a census of bench-100m's storages at rest: docs/planning.md). On a GPU the bucket
    is allocated whole; on a CPU only the pages the gradients write become resident."""
    if side.zero_stage == 0:
        return 0.0
    bucket = REDUCE_BUCKET if bucket is None else bucket
    mixed = side.dtype == "bfloat16" and side.bf16_mode == "weights"
    copy = 0.0 if mixed else trained * 4 / side.ranks
    return copy + (bucket if side.gpu else min(bucket, trained)) * (2 if mixed else 4)


def reduce_bucket(shape: ModelShape, side: TrainerSide) -> float:
    """reduce_bucket_size as update.zero.ds_config sets it: under ZeRO-3 gathered module by
    module with the release, the largest gather unit (a decoder layer, or the embedding if
    larger: update.zero.release_unit); else DeepSpeed's default."""
    if side.zero_stage == 3 and side.release and not gathered_whole(shape, side):
        return max(shape.layer_params(), shape.embedding_params())
    return REDUCE_BUCKET


REDUCE_BUCKET = 5 * 10 ** 8  # DeepSpeed's default reduce_bucket_size, in elements


def gathered_whole(shape: ModelShape, side: TrainerSide) -> bool:
    """update.zero.is_whole: ZeRO-3 gathers a model whole up to zero3_whole_model_max
    parameters or on one rank (0: never)."""
    if side.zero_stage != 3 or side.whole_model_max == 0:
        return False
    return side.ranks == 1 or shape.params() <= side.whole_model_max


def gathered_bytes(shape: ModelShape, side: TrainerSide, b: int) -> float:
    """ZeRO-3's full copies during a forward and backward: the whole model, or module by module
    a decoder layer in use and one prefetched, beside the largest other module (embedding or
    head); without the release, DeepSpeed keeps a model gathered from forward to backward."""
    if side.zero_stage != 3:
        return 0.0
    if gathered_whole(shape, side) or not side.release:
        return shape.params() * b
    return (2 * shape.layer_params() + shape.embedding_params()) * b


def micro_tokens(side: TrainerSide) -> tuple[int, int]:
    """(T, R): tokens a micro-batch's forward runs and its response tokens. The shared-prompt
    layout runs each prompt once for its group_size samples."""
    r = side.micro_batch * side.response_tokens
    prompts = side.micro_batch * side.prompt_tokens
    if side.share_prompts:
        prompts = -(-side.micro_batch // side.group_size) * side.prompt_tokens
    return prompts + r, r


def activation_bytes(shape: ModelShape, side: TrainerSide) -> float:
    """What a micro-batch's forward keeps for its backward: every layer's activations, or with
    recompute each layer's input and one layer's activations recomputed in the backward."""
    t, _ = micro_tokens(side)
    b = 2 if side.dtype == "bfloat16" else 4
    per_layer = (layer_activation_elements(shape) * t + attention_key_elements(shape, side)) * b
    if side.gpu and side.dtype == "float32":
        # CUDA's flash attention takes 16-bit inputs only: in float32 with a padding mask SDPA
        # keeps the scores and the probabilities, B·heads·S² each (calibrated on the H200 run
        # of benchmarks/update_gpu.py; the CPU's flash kernel takes float32 and keeps neither)
        seq = side.prompt_tokens + side.response_tokens
        per_layer += 2 * side.micro_batch * shape.heads * seq * seq * 4
    if side.checkpointing:  # shared prompts: the prompts' keys and values stay for the responses
        prompts = t - side.micro_batch * side.response_tokens if side.share_prompts else 0
        return shape.layers * (shape.hidden * t + 2 * shape.kv_dim * prompts) * b + per_layer
    return shape.layers * per_layer


def logits_bytes(shape: ModelShape, side: TrainerSide) -> float:
    """The response positions' logits in float32, LOGIT_COPIES at once (full layout: one more
    position per sample)."""
    _, r = micro_tokens(side)
    return (r + side.micro_batch) * shape.vocab * 4 * LOGIT_COPIES


def trainer_memory(shape: ModelShape, side: TrainerSide) -> dict:
    """Bytes on one trainer rank, by item; 'peak' = what persists + the larger phase (a training
    micro-batch, or the reference's scoring pass)."""
    b = 2 if side.dtype == "bfloat16" else 4
    phi = shape.params()
    out = {}
    if side.lora_params:  # the base frozen in the compute dtype (sharded by ZeRO-3), adapters train
        out["base (frozen)"] = phi * b / (side.ranks if side.zero_stage == 3 else 1)
        states = state_bytes(side.lora_params, side)
    else:
        states = state_bytes(phi, side)
    out.update(states)
    bucket = reduce_bucket(shape, side)
    buffers = zero_buffers(side.lora_params or phi, side, bucket)
    if buffers:
        out["zero buffers"] = buffers
    if side.reference:  # a frozen copy in the compute dtype, sharded as the weights are
        out["reference"] = phi * b / (side.ranks if side.zero_stage == 3 else 1)
    if side.critic:  # a second model of the same shape with its own optimizer (a value head)
        out["critic"] = sum(state_bytes(phi, side).values()) + zero_buffers(phi, side, bucket)
    train = {"gathered": gathered_bytes(shape, side, b),
             "activations": activation_bytes(shape, side), "logits": logits_bytes(shape, side)}
    out.update(train)
    persistent = sum(v for k, v in out.items() if k not in train)
    scoring = phi * b if side.reference and side.zero_stage == 3 else 0.0
    out["peak"] = persistent + max(sum(train.values()), scoring)
    return out


@dataclass(frozen=True)
class EngineSide:
    """What sizes a rollout engine (from the recipe and the hardware)."""
    tp: int
    dtype: str
    max_model_len: int
    block_size: int
    max_num_seqs: int
    kv_cap_bytes: float | None  # CPU: rollout.kv_cache_gib; GPU: None (the memory fraction)
    memory_fraction: float  # GPU: rollout.gpu_memory_utilization of the device
    seq_tokens: int  # a sequence's tokens (prompt + response)
    # CPU with rollout.cpu_linear=repack: oneDNN's packed copy of each linear beside its weight
    kept_weights: bool = False


def kv_bytes_per_token_per_rank(shape: ModelShape, e: EngineSide) -> float:
    """A TP rank keeps its share of the KV heads (each KV head on t / n_kv ranks when t > n_kv)."""
    heads = max(1, shape.kv_heads // e.tp)
    return 2 * shape.layers * heads * shape.head_dim * DTYPE_BYTES[e.dtype]


def engine_memory(shape: ModelShape, e: EngineSide, device_bytes: float) -> dict:
    """One engine TP rank: its weights (on CPU with cpu_linear=repack, the linears twice: the
    weights syncs write into and oneDNN's packed copy), its KV budget (CPU: what max_num_seqs
    sequences of max_model_len tokens take, at most the cap, as
    rollout.vllm_cpu.kv_cache_bytes; GPU: the memory fraction less the weights), the blocks
    and the sequences held at once."""
    weights = shape.params() * DTYPE_BYTES[e.dtype] / e.tp
    if e.kept_weights:  # the linears (the layers' and the head's) packed beside their weights
        weights += shape.linear_params() * DTYPE_BYTES[e.dtype] / e.tp
    per_token = kv_bytes_per_token_per_rank(shape, e)
    if e.kv_cap_bytes is not None:
        whole = shape.kv_bytes_per_token(DTYPE_BYTES[e.dtype])  # all ranks' heads
        kv = min(e.max_num_seqs * e.max_model_len * whole, e.kv_cap_bytes) * per_token / whole
    else:
        kv = max(0.0, e.memory_fraction * device_bytes - weights)
    blocks = int(kv // (e.block_size * per_token))
    per_seq = -(-min(e.seq_tokens, e.max_model_len) // e.block_size)
    return {"weights": weights, "kv_cache": kv, "kv_per_token": per_token,
            "kv_per_sequence": per_token * e.max_model_len, "kv_blocks": blocks,
            "max_sequences": min(e.max_num_seqs, blocks // max(1, per_seq)),
            "peak": weights + kv}
