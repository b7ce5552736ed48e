"""Rollout throughput: our rollout path vs a bare `vllm.LLM.generate`, and ngram speculation.

    .venv/bin/python benchmarks/rollout_throughput.py [--model builtin:tiny-qwen2] [--prompts 64]

Prints ratios measured in the same process on the same requests:
  wrapper / bare: tokens/s of VLLMEngine.generate (our sampling params, seeds, logprobs and
                  conversion to Completions) over LLM.generate with the same SamplingParams
                  (target >= 0.95);
  ngram / plain:  tokens/s with ngram speculation over without, greedy, on a repetitive task
                  (prompts that the answer copies from); both engines eager, as speculation
                  runs.
"""
from __future__ import annotations

import argparse
import os
import time


def timed(fn, repeats: int):
    best = float("inf")
    out = None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="builtin:tiny-qwen2")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    from vllm import TokensPrompt
    from transformers import AutoTokenizer

    from rl.data.models import resolve_model_path
    from rollout.config import RolloutConfig
    from rollout.vllm_engine import VLLMEngine

    path = resolve_model_path(args.model)
    tok = AutoTokenizer.from_pretrained(path)
    prompts = [tok.apply_chat_template(
        [{"role": "user", "content": f"What is {i} + {i + 3}? Reply with the number only."}],
        add_generation_prompt=True, tokenize=True)["input_ids"] for i in range(args.prompts)]
    cfg = RolloutConfig(n=args.n, max_new_tokens=args.max_new_tokens, temperature=1.0)
    engine = VLLMEngine(path, cfg, seed=0, device="cpu")
    seeds = list(range(len(prompts)))
    params = [engine.sampling_params(s, None) for s in seeds]
    requests = [TokensPrompt(prompt_token_ids=q) for q in prompts]

    def bare():
        return engine.llm.generate(requests, params, use_tqdm=False)

    def wrapped():
        return engine.generate(prompts, seeds=seeds)

    bare()  # warm-up
    t_bare, outs = timed(bare, args.repeats)
    t_wrap, groups = timed(wrapped, args.repeats)
    tokens_bare = sum(len(c.token_ids) for o in outs for c in o.outputs)
    tokens_wrap = sum(len(c.token_ids) for g in groups for c in g)
    print(f"bare vllm.LLM.generate : {tokens_bare / t_bare:9.1f} tok/s")
    print(f"rollout VLLMEngine     : {tokens_wrap / t_wrap:9.1f} tok/s")
    print(f"ratio wrapper / bare   : {(tokens_wrap / t_wrap) / (tokens_bare / t_bare):9.3f}"
          f"   (target >= 0.95)")

    # ngram speculation on a repetitive task: the prompt holds the text the answer repeats.
    text = " ".join(str(i % 10) for i in range(40))
    rep = [tok.apply_chat_template([{"role": "user", "content": f"Repeat: {text} {text}"}],
                                   add_generation_prompt=True, tokenize=True)["input_ids"]] * 16
    # eager, as speculation runs (rollout.vllm_engine.eager_mode): speculation's worth alone
    greedy = RolloutConfig(n=1, max_new_tokens=args.max_new_tokens, temperature=0.0,
                           enforce_eager=True)
    plain = VLLMEngine(path, greedy, seed=0, device="cpu")
    spec = VLLMEngine(path, RolloutConfig(n=1, max_new_tokens=args.max_new_tokens,
                                          temperature=0.0, speculative_method="ngram",
                                          num_speculative_tokens=4), seed=0, device="cpu")
    results = {}
    for name, eng in (("plain", plain), ("ngram", spec)):
        eng.generate(rep[:2])
        eng.take_stats()
        t, g = timed(lambda: eng.generate(rep), args.repeats)
        results[name] = sum(len(c.token_ids) for grp in g for c in grp) / t
        stats = eng.take_stats()
        accept = stats.get("rollout/spec_accept_rate")
        extra = f", acceptance {accept:.2f}" if accept is not None else ""
        print(f"{name:6s} greedy          : {results[name]:9.1f} tok/s{extra}")
    print(f"ratio ngram / plain    : {results['ngram'] / results['plain']:9.3f}")


if __name__ == "__main__":
    main()
