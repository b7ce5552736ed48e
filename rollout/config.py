"""Typed configuration of the rollout engine (vLLM) and its sampling."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

CPU_LINEAR = ("auto", "plain", "repack", "packed")
# vLLM's allowed max_lora_rank values (vllm.config.lora.MaxLoRARanks): an engine with LoRA
# reserves the smallest one at least the adapter's rank
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


@dataclass
class RolloutConfig:
    n: int = field(default=8, metadata={"bound": ">= 1"})
    "Samples per prompt (the GRPO group size G)."
    prompts_per_step: int = field(default=16, metadata={"bound": ">= 1"})
    "Prompts drawn per RL step; the rollout batch is prompts_per_step * n samples."
    temperature: float = field(default=1.0, metadata={"bound": "> 0"})
    "Sampling temperature; the trainer divides its logits by the same value."
    top_p: float = field(default=1.0, metadata={"bound": "in (0, 1]"})
    "Nucleus sampling mass (1.0: off)."
    top_k: int = field(default=0, metadata={"bound": ">= 0"})
    "Sample among the k most likely tokens (0: off)."
    min_p: float = field(default=0.0, metadata={"bound": "in [0, 1]"})
    "Drop tokens below min_p times the top token's probability (0: off)."
    max_new_tokens: int = field(default=16, metadata={"bound": ">= 1"})
    "Longest response in tokens."
    min_new_tokens: int = field(default=0, metadata={"bound": ">= 0"})
    ("Shortest response in tokens: eos and stop tokens are not sampled before (vLLM's "
     "min_tokens); benchmarks set it to max_new_tokens so that every row does the same work.")
    stop: List[str] = field(default_factory=list)
    "Stop strings (not included in the response)."
    stop_token_ids: List[int] = field(default_factory=list)
    "Extra token ids that end a response (the tokenizer's eos always does)."
    max_model_len: int = field(default=512, metadata={"bound": ">= 2"})
    "Longest prompt + response the engine accepts; longer prompts are filtered out up front."
    dtype: str = "float32"
    "vLLM weights/activations dtype: float32, bfloat16 or auto."
    logprobs_mode: str = "processed_logprobs"
    "Which logprobs vLLM returns; processed_logprobs (after temperature) match the trainer's."
    enable_prefix_caching: bool = True
    "Reuse KV blocks of shared prompt prefixes (reset after every weight sync)."
    block_size: int = field(default=32, metadata={"bound": ">= 1"})
    "KV block size in tokens; the CPU default (128) caches only full 128-token blocks."
    tensor_parallel_size: int = field(default=1, metadata={"bound": ">= 1"})
    ("TP ranks per engine: each engine's weights split over this many processes (on CPU, one "
     "per core run of the engine's cores: VLLM_CPU_OMP_THREADS_BIND 'a|b'). The model's heads, "
     "KV heads, intermediate size and padded vocab must divide it.")
    cpu_linear: str = "auto"
    ("CPU linears: repack (oneDNN's packed kernels, the weights kept beside them: syncs copy into "
     "the weights and re-pack; the linears' weights held twice), plain (F.linear on the weights as "
     "loaded: syncs copy, no re-pack, slower generation), packed (vLLM's own: weights dropped "
     "after packing, syncs go through vLLM's reload), or auto (packed where a TP-1 engine serves "
     "a LoRA adapter, whose base weights no sync writes; else repack). The figures: "
     "docs/placement-and-weight-sync.md.")
    enforce_eager: Optional[bool] = None
    ("Run the model eagerly (True) or compiled (False): on GPU vLLM's CUDA graphs, on CPU its "
     "torch.compile (inductor) graph, cached under ~/.cache/vllm after the first build; None: "
     "compiled on GPU, and on CPU for models of compile_min_params or more (the figures: "
     "docs/rollout.md). Speculative decoding stays eager.")
    compile_min_params: int = field(default=50_000_000, metadata={"bound": ">= 0"})
    ("enforce_eager None on CPU: the smallest model that is compiled (smaller ones generated no "
     "faster compiled: docs/rollout.md).")
    kv_cache_gib: float = field(default=1.0, metadata={"bound": "> 0"})
    ("Most KV cache per engine on CPU, in GiB; an engine takes less when vLLM-CPU's 256 "
     "sequences at once (its max_num_seqs) of max_model_len tokens fit in less (docs/rollout.md).")
    gpu_memory_utilization: float = field(default=0.5, metadata={"bound": "in (0, 1]"})
    "Fraction of GPU memory for the engine when colocated with training on a GPU."
    speculative_method: Optional[str] = None
    "Speculative decoding: None (off), ngram (prompt lookup) or draft (a small model)."
    num_speculative_tokens: int = field(default=3, metadata={"bound": ">= 1"})
    "Tokens proposed per speculation step."
    draft_model: Optional[str] = None
    "speculative_method=draft: a local model directory with the same tokenizer."
    prompt_lookup_max: int = field(default=4, metadata={"bound": ">= 1"})
    "ngram: longest n-gram matched in the prompt."
    prompt_lookup_min: int = field(default=1, metadata={"bound": ">= 1"})
    "ngram: shortest n-gram matched in the prompt."
    json_schema_key: str = "json_schema"
    "Row field with a JSON schema that the sample's output must follow (absent: free text)."
    regex_key: str = "regex"
    "Row field with a regex that the sample's output must match."
    choices_key: str = "choices"
    "Row field with a list of strings, one of which the output must be."

    def cpu_linear_mode(self, lora_adapter: bool = False) -> str:
        """How a CPU engine runs its linears: plain, repack or packed (see cpu_linear);
        lora_adapter: the engine serves a LoRA adapter (syncs move the adapter, never the base)."""
        if self.cpu_linear != "auto":
            return self.cpu_linear
        return "packed" if lora_adapter and self.tensor_parallel_size == 1 else "repack"

    def speculative_config(self) -> dict | None:
        """vLLM's speculative_config for the chosen method."""
        if self.speculative_method is None:
            return None
        if self.temperature not in (0.0, 1.0):
            # sampled-token logprobs are re-scored at temperature 1 under speculation
            raise ValueError(f"rollout.speculative_method with temperature={self.temperature}: "
                             f"use temperature 1.0 (or 0 for greedy) with speculation")
        if self.speculative_method == "ngram":
            return {"method": "ngram", "num_speculative_tokens": self.num_speculative_tokens,
                    "prompt_lookup_max": self.prompt_lookup_max,
                    "prompt_lookup_min": self.prompt_lookup_min}
        if self.speculative_method == "draft":
            if not self.draft_model:
                raise ValueError("rollout.speculative_method=draft needs rollout.draft_model "
                                 "(a local model directory with the same tokenizer)")
            return {"model": self.draft_model,
                    "num_speculative_tokens": self.num_speculative_tokens}
        raise ValueError(f"rollout.speculative_method={self.speculative_method!r}: use ngram, "
                         f"draft, or leave it unset")
