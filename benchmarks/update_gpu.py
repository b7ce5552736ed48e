"""The update step alone on one accelerator: `update.PolicyTrainer` (DeepSpeed) against a plain
torch AdamW step on the same batch, model and loss.

No Ray, no vLLM: this is the check to run on a GPU machine, where only torch, transformers and
DeepSpeed are needed (see docs/benchmarks.md). It builds a SmolLM2-135M-shaped Llama with random
weights (nothing is downloaded), one batch in the layout `rl.algo.batch.collate` makes (left-padded
prompts, right-padded responses, logits for the response positions only), and times, per ZeRO
stage and precision:

- `deepspeed`: `PolicyTrainer.train_step` in one pass (old logprobs from the training forward,
  the reference model's forward inside the step, as rl-train runs GRPO with a KL loss);
- `raw`: the same forwards, the same `update.losses.policy_loss`, backward, gradient clipping and
  `torch.optim.AdamW` in plain torch, fp32 or under bf16 autocast.

Prints one JSON line per row and a table with deepspeed / raw per precision.

    python benchmarks/update_gpu.py                  # SmolLM2 shape, 64 x (128 + 256) tokens
    python benchmarks/update_gpu.py --small          # 2 layers, 8 x (16 + 16): a CPU dry run
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from rl.algo.batch import Sample, collate  # noqa: E402
from update.config import LossConfig, TrainerConfig  # noqa: E402
from update.losses import BatchCounts, LossInputs, policy_loss  # noqa: E402
from update.forward import response_logits, response_targets, token_logprobs  # noqa: E402
from update.distributed import init_distributed  # noqa: E402
from update.trainer import PolicyTrainer  # noqa: E402

PRECISIONS = {  # name: (trainer dtype, bf16_mode, raw autocast)
    "fp32": ("float32", "weights", False),
    "bf16-weights": ("bfloat16", "weights", True),
    "bf16-autocast": ("bfloat16", "autocast", True),
}


def build_model(path: str, layers: int) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                      num_hidden_layers=layers, num_attention_heads=9, num_key_value_heads=3,
                      max_position_embeddings=2048, tie_word_embeddings=True, rms_norm_eps=1e-5,
                      rope_theta=100000.0)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(path)


def build_batch(n: int, prompt: int, response: int) -> dict:
    rng = random.Random(1)
    samples = []
    for i in range(n):
        p = [rng.randrange(1, 49152) for _ in range(rng.randint(prompt // 2, prompt))]
        r = [rng.randrange(1, 49152) for _ in range(rng.randint(response // 2, response))]
        adv = rng.gauss(0.0, 1.0)
        samples.append(Sample(row=i, group=i // 8, prompt_ids=p, response_ids=r,
                              rollout_logprobs=[-10.0 - rng.random() for _ in r],
                              finish_reason="length", text="", advantages=[adv] * len(r)))
    return collate(samples, pad_id=0)


def median(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2]


def sync(dev: str) -> None:
    if dev == "cuda":
        torch.cuda.synchronize()


def time_deepspeed(path, mb, counts, stage, persistence, precision, steps, dev) -> dict:
    dtype, mode, _ = PRECISIONS[precision]
    tc = TrainerConfig(zero_stage=stage, dtype=dtype, bf16_mode=mode, lr=1e-6,
                       micro_batch_size=mb["input_ids"].shape[0],
                       zero3_persistence_threshold=persistence)
    trainer = PolicyTrainer(path, tc, LossConfig(kl_coef=0.001), grad_accum=1)
    times, metrics = [], {}
    for _ in range(steps):
        sync(dev)
        t0 = time.perf_counter()
        metrics = trainer.train_step([dict(mb)], counts)
        sync(dev)
        times.append(time.perf_counter() - t0)
    finite = all(v == v for v in metrics.values())
    if os.environ.get("UPDATE_GPU_PROFILE"):  # where a slow row's time goes
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev == "cuda" else [])
        with profile(activities=acts) as prof:
            trainer.train_step([dict(mb)], counts)
            sync(dev)
        print(f"profile stage {stage} {precision} persistence {persistence}")
        for key in ["self_cpu_time_total"] + (["self_cuda_time_total"] if dev == "cuda" else []):
            print(prof.key_averages().table(sort_by=key, row_limit=20, max_name_column_width=50))
    del trainer
    return {"s": median(times[1:]), "loss_finite": finite}


def time_raw(path, mb, counts, precision, steps, dev) -> dict:
    from transformers import AutoModelForCausalLM

    autocast = torch.autocast(dev, dtype=torch.bfloat16, enabled=PRECISIONS[precision][2])
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(dev)
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(dev)
    ref.requires_grad_(False).eval()
    model.config.use_cache = False
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.0)
    lc = LossConfig(kl_coef=0.001)
    batch = {k: v.to(dev) for k, v in mb.items()}
    times = []
    for _ in range(steps):
        sync(dev)
        t0 = time.perf_counter()
        with autocast:
            with torch.no_grad():
                ref_lp = token_logprobs(response_logits(ref, batch), response_targets(batch))
            lp = token_logprobs(response_logits(model, batch), response_targets(batch))
        inputs = LossInputs(logprobs=lp, old_logprobs=lp.detach(), advantages=batch["advantages"],
                            response_mask=batch["response_mask"], counts=counts,
                            ref_logprobs=ref_lp, rollout_logprobs=batch["rollout_logprobs"])
        loss, _ = policy_loss(inputs, lc)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync(dev)
        times.append(time.perf_counter() - t0)
    del model, ref, opt
    return {"s": median(times[1:])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="2 layers and a small batch (CPU dry run)")
    ap.add_argument("--stages", default="3,2", help="ZeRO stages to time (default 3,2)")
    ap.add_argument("--precisions", default=",".join(PRECISIONS))
    ap.add_argument("--persistence", default="0",
                    help="ZeRO-3 rows for each of these zero3_persistence_threshold values")
    ap.add_argument("--steps", type=int, default=6, help="timed steps per row; the first is dropped")
    ap.add_argument("--out", help="write the rows as JSON here")
    args = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    precisions = args.precisions.split(",")
    for p in precisions:
        if p not in PRECISIONS:
            sys.exit(f"update_gpu: --precisions {p!r} is not known; use {', '.join(PRECISIONS)}")
    init_distributed(0, 1, "127.0.0.1", 29517)
    path = os.path.join(tempfile.mkdtemp(), "model")
    build_model(path, 2 if args.small else 30)
    n, prompt, response = (8, 16, 16) if args.small else (64, 128, 256)
    mb = build_batch(n, prompt, response)
    mb = {k: v for k, v in mb.items() if isinstance(v, torch.Tensor)}
    mb.pop("old_logprobs", None)  # one pass: the step takes them from its own forward
    counts = BatchCounts(float(mb["response_mask"].sum()), float(n), float(response))
    tokens = int(mb["attention_mask"].sum())
    device = torch.cuda.get_device_name() if dev == "cuda" else "cpu"
    rows = []
    for precision in precisions:
        raw = time_raw(path, mb, counts, precision, args.steps, dev)
        row = {"row": "raw", "precision": precision, "stage": None, "s": raw["s"]}
        print(json.dumps(row), flush=True)
        rows.append(row)
        configs = [(int(s), int(float(p))) for s in args.stages.split(",")
                   for p in (args.persistence.split(",") if s == "3" else ["0"])]
        for stage, persistence in configs:
            if dev == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            ds = time_deepspeed(path, mb, counts, stage, persistence, precision, args.steps, dev)
            row = {"row": "deepspeed", "precision": precision, "stage": stage,
                   "persistence": persistence if stage == 3 else None, "s": ds["s"],
                   "loss_finite": ds["loss_finite"], "over_raw": ds["s"] / raw["s"],
                   "tokens_per_s": tokens / ds["s"],
                   "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if dev == "cuda" else None}
            print(json.dumps(row), flush=True)
            rows.append(row)
    print(f"\nupdate step on {device}: {n} samples, {tokens} tokens, median of {args.steps - 1}")
    print("| precision | ZeRO | ZeRO-3 persistence | DeepSpeed s | raw torch s | DeepSpeed / raw |")
    print("| --- | --- | --- | --- | --- | --- |")
    raw_s = {r["precision"]: r["s"] for r in rows if r["row"] == "raw"}
    for r in rows:
        if r["row"] == "deepspeed":
            print(f"| {r['precision']} | {r['stage']} | {r['persistence'] or ''} | {r['s']:.3f} "
                  f"| {raw_s[r['precision']]:.3f} "
                  f"| {r['over_raw']:.2f}x |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": device, "samples": n, "tokens": tokens, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
