"""Typed configuration of the rollout engine (vLLM) and its sampling."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RolloutConfig:
    n: int = 8
    "Samples per prompt (the GRPO group size G)."
    prompts_per_step: int = 16
    "Prompts drawn per RL step; the rollout batch is prompts_per_step * n samples."
    temperature: float = 1.0
    "Sampling temperature (1.0 keeps rollout logprobs comparable with the trainer's)."
    top_p: float = 1.0
    "Nucleus sampling mass."
    max_new_tokens: int = 16
    "Longest response in tokens."
    max_model_len: int = 512
    "Longest prompt + response the engine accepts."
    dtype: str = "float32"
    "vLLM weights/activations dtype: float32, bfloat16 or auto."
    enable_prefix_caching: bool = True
    "Reuse KV blocks of shared prompt prefixes (reset after every weight sync)."
    block_size: int = 32
    "KV block size in tokens; the CPU default (128) caches only full 128-token blocks."
    kv_cache_gib: int = 1
    "KV cache size per engine on CPU (VLLM_CPU_KVCACHE_SPACE)."
    gpu_memory_utilization: float = 0.5
    "Fraction of GPU memory for the engine when colocated with training on a GPU."
