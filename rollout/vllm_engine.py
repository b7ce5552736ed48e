"""A vLLM engine in the calling process: generate samples, load new weights, score a probe.

On CPU the engine runs in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0) so that weights can be
handed to its worker as tensors; that also turns `torch.set_num_threads` into a no-op for the
whole process, so callers set threads before building the engine.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Iterable

import torch

from rollout.config import RolloutConfig


@dataclass
class Completion:
    token_ids: list[int]
    logprobs: list[float]  # logprob of each sampled token under the engine's weights
    finish_reason: str  # "stop" (eos / stop string) or "length"
    text: str


class VLLMEngine:
    """One `vllm.LLM` with prefix caching; weights are replaced in place after each update."""

    def __init__(self, model_path: str, cfg: RolloutConfig, seed: int, device: str):
        if device == "cpu":
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(cfg.kv_cache_gib)
        from vllm import LLM

        kwargs = dict(model=model_path, tokenizer=model_path, dtype=cfg.dtype, seed=seed,
                      max_model_len=cfg.max_model_len, enforce_eager=True,
                      enable_prefix_caching=cfg.enable_prefix_caching, block_size=cfg.block_size)
        if device != "cpu":
            kwargs["gpu_memory_utilization"] = cfg.gpu_memory_utilization
        self.cfg = cfg
        self.llm = LLM(**kwargs)

    @property
    def _worker(self):
        """The in-process model worker (exists because multiprocessing is off)."""
        core = self.llm.llm_engine.engine_core
        return core.engine_core.model_executor.driver_worker.worker

    def generate(self, prompts: list[list[int]], seeds: list[int] | None = None
                 ) -> list[list[Completion]]:
        """cfg.n samples for each prompt (token ids); returns one list of completions per prompt.

        seeds[i] makes prompt i's samples reproducible (vLLM gives sample j the seed seeds[i] + j).
        """
        from vllm import SamplingParams, TokensPrompt

        seeds = seeds if seeds is not None else [None] * len(prompts)
        params = [SamplingParams(
            n=self.cfg.n, temperature=self.cfg.temperature, top_p=self.cfg.top_p,
            max_tokens=self.cfg.max_new_tokens, logprobs=0, seed=seed, detokenize=True)
            for seed in seeds]
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                                 use_tqdm=False)
        return [[_completion(c) for c in out.outputs] for out in outs]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Stream (HF name, full tensor) pairs into the engine, then drop stale KV blocks.

        `reload_weights` in checkpoint format works on CPU where `model.load_weights` fails
        after start-up (CPU linear weights are repacked); it consumes the iterator lazily, so a
        bucketed generator never holds the whole model.
        """
        self._worker.reload_weights(weights_iterator=iter(weights), is_checkpoint_format=True)
        self.llm.reset_prefix_cache()

    def prompt_logprobs(self, token_ids: list[int]) -> list[float]:
        """Logprob of each token of `token_ids` after the first, under the engine's weights."""
        from vllm import SamplingParams, TokensPrompt

        params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0)
        out = self.llm.generate([TokensPrompt(prompt_token_ids=token_ids)], params,
                                use_tqdm=False)[0]
        lps = out.prompt_logprobs[1:]  # the first token has no logprob
        return [lp[tok].logprob for lp, tok in zip(lps, token_ids[1:])]


def _completion(c) -> Completion:
    lps = [step[tok].logprob for step, tok in zip(c.logprobs, c.token_ids)]
    return Completion(token_ids=list(c.token_ids), logprobs=lps,
                      finish_reason=str(c.finish_reason), text=c.text)
