"""A step's time: T_rollout (prefill, then decode steps bound by the bytes they read or the FLOPs
they run), T_update (scoring at 2Φ FLOPs a token, the update at 6Φ, 8Φ with recompute) and
T_sync (the weights over the placement's link), combined per pipeline mode; and what
speculative decoding gains where decoding is bound by reading the weights."""
from __future__ import annotations

from dataclasses import dataclass

from rl.plan.hardware import Hardware
from rl.plan.shape import ModelShape


@dataclass(frozen=True)
class StepShape:
    """One RL step's work, from the recipe."""
    samples: int  # prompts_per_step * n
    group_size: int  # n
    prompt_tokens: int
    response_tokens: int
    engines: int
    tp: int
    engine_dtype: str
    trainer_dtype: str
    trainer_ranks: int
    micro_batches: int  # per rank per step
    scoring_passes: int  # forwards before the update: old logprobs (two-pass), reference, critic
    updates: int  # ppo_epochs: each a forward and a backward
    recompute: bool
    critic: bool
    adapter_params: int = 0  # > 0: syncs move a LoRA adapter of this size, the base never
    zero_stage: int = 0
    # processes of a kind that share one device: a CPU node's engines, or its trainer ranks,
    # share its cores and memory bandwidth (1 on GPUs: a device each)
    engines_per_device: int = 1
    ranks_per_device: int = 1


def decode_step_seconds(shape: ModelShape, hw: Hardware, s: StepShape, batch: int,
                        context: float, kv_per_token: float) -> tuple[float, str]:
    """One decode step of `batch` sequences on one TP rank: it reads the rank's weights and each
    sequence's KV cache once, and runs 2 FLOPs per weight and sequence; the slower bound wins."""
    from rl.plan.memory import DTYPE_BYTES

    read = shape.params() * DTYPE_BYTES[s.engine_dtype] / s.tp + batch * context * kv_per_token
    share = s.engines_per_device
    memory_s = read * share / (hw.bandwidth * hw.decode_utilization)
    compute_s = batch * shape.forward_flops(int(context)) / s.tp * share / (
        hw.flops(s.engine_dtype) * hw.prefill_utilization)
    return (memory_s, "memory") if memory_s >= compute_s else (compute_s, "compute")


def rollout_seconds(shape: ModelShape, hw: Hardware, s: StepShape, max_sequences: int,
                    kv_per_token: float) -> dict:
    """An engine's share of the step's samples, in waves of at most max_sequences at once:
    the prompts' prefill (each prompt once: prefix caching shares it between its n samples),
    then response_tokens decode steps per wave."""
    per_engine = -(-s.samples // s.engines)
    batch = max(1, min(max_sequences, per_engine))
    waves = -(-per_engine // batch)
    prefill_tokens = -(-per_engine // s.group_size) * s.prompt_tokens
    prefill = prefill_tokens * shape.forward_flops(s.prompt_tokens // 2) / s.tp * (
        s.engines_per_device) / (hw.flops(s.engine_dtype) * hw.prefill_utilization)
    step, bound = decode_step_seconds(shape, hw, s, batch,
                                      s.prompt_tokens + s.response_tokens / 2, kv_per_token)
    fixed = hw.decode_step_overhead + batch * hw.decode_sequence_overhead
    step = max(step, fixed) if hw.gpu else step + fixed
    decode = waves * s.response_tokens * step
    return {"prefill": prefill, "decode": decode, "seconds": prefill + decode,
            "decode_step": step, "bound": bound, "batch": batch, "waves": waves,
            "decode_steps": waves * s.response_tokens, "decode_step_fixed": fixed}


def update_seconds(shape: ModelShape, hw: Hardware, s: StepShape, share_prompts: bool) -> dict:
    """A rank's tokens through the scoring passes (2Φ FLOPs a token each) and the update (6Φ:
    forward and backward; 8Φ with recompute), the critic's alike, at the calibrated fraction of
    the peak."""
    per_rank = s.samples / s.trainer_ranks
    prompts = per_rank / s.group_size if share_prompts else per_rank
    tokens = prompts * s.prompt_tokens + per_rank * s.response_tokens
    phi = shape.linear_params()
    flops = tokens * phi * (2 * s.scoring_passes + (8 if s.recompute else 6) * s.updates)
    if s.critic:
        flops += tokens * phi * 6 * s.updates
    rate = hw.flops(s.trainer_dtype) * hw.train_utilization / s.ranks_per_device
    # each layer runs once per scoring pass, twice per update (forward, backward; thrice with
    # recompute), per micro-batch
    passes = s.micro_batches * shape.layers * (
        s.scoring_passes + (3 if s.recompute else 2) * s.updates * (2 if s.critic else 1))
    overhead = passes * (hw.layer_pass_overhead
                         + (hw.zero3_pass_overhead if s.zero_stage == 3 else 0.0))
    compute = flops / rate
    seconds = max(compute, overhead) if hw.gpu else compute + overhead
    return {"tokens_per_rank": tokens, "flops_per_rank": flops, "compute_seconds": compute,
            "overhead_seconds": overhead, "seconds": seconds, "layer_passes": passes,
            "zero3_layer_passes": passes if s.zero_stage == 3 else 0}


def sync_seconds(shape: ModelShape, s: StepShape, link: float, overhead: float) -> dict:
    """Every TP rank's slice (the whole model between them) over the placement's link, and
    the sync's own fixed work; a LoRA adapter (sync.lora=adapters) goes whole, in the trainer's
    dtype, to each engine."""
    from rl.plan.memory import DTYPE_BYTES

    if s.adapter_params:
        total = s.adapter_params * DTYPE_BYTES[s.trainer_dtype]
        return {"bytes_per_tp_rank": total, "bytes": total, "seconds": total / link + overhead}
    total = shape.params() * DTYPE_BYTES[s.engine_dtype]
    return {"bytes_per_tp_rank": total / s.tp, "bytes": total,
            "seconds": total / link + overhead}


def step_seconds(rollout: float, update: float, sync: float, mode: str) -> float:
    """sync: one after the other; one_step: the next batch is generated during the update and
    sync; fully_async: the engines stream while the trainer updates, pausing for the sync."""
    if mode == "sync":
        return rollout + update + sync
    if mode == "one_step":
        return max(rollout, update + sync)
    return max(rollout + sync, update)


def speculation(acceptance: float, k: int, step_s: float, draft_step_s: float,
                bound: str) -> dict:
    """Expected tokens per verification step, (1 - α^(k+1)) / (1 - α) (Leviathan et al. 2023),
    and the decode speed-up: where a decode step reads the weights (memory-bound) verifying
    k + 1 tokens costs about one step, plus k draft steps; where it is compute-bound it costs
    k + 1 steps, and speculation cannot pay."""
    a = min(max(acceptance, 0.0), 0.999999)
    tokens = (1 - a ** (k + 1)) / (1 - a)
    verify = step_s if bound == "memory" else (k + 1) * step_s
    cost = verify + k * draft_step_s
    return {"tokens_per_step": tokens, "speedup": tokens * step_s / cost}
