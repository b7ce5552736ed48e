"""The RL controller: generate -> score -> advantages -> update -> sync, once per step."""
from __future__ import annotations

import math
import os
import time
from pathlib import Path

import torch

from rl.advantages import compute_advantages
from rl.batch import Sample, chunk, plan_update
from rl.config import Config, grad_accum_steps, to_yaml
from rl.metrics import RunLog
from rl.rewarding import RewardScorer


def new_run_dir(cfg: Config) -> Path:
    """runs/<name>, or runs/<name>-2, -3 ... when that exists: never overwrite a past run."""
    base = Path(cfg.run.output_dir) / cfg.run.name
    path, i = base, 1
    while path.exists():
        i += 1
        path = base.with_name(f"{base.name}-{i}")
    path.mkdir(parents=True)
    return path


def start_ray(cfg: Config) -> None:
    import ray

    from rl.models import cache_root

    if ray.is_initialized():
        return
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_LOGGING_LEVEL": "WARNING",
           "TOKENIZERS_PARALLELISM": "false", "PYTHONWARNINGS": "ignore::FutureWarning",
           "RL_CACHE_DIR": str(cache_root())}
    if cfg.ray.address:
        ray.init(address=cfg.ray.address, runtime_env={"env_vars": env})
    else:
        need = math.ceil(cfg.ray.num_workers * cfg.ray.num_cpus_per_worker)
        ray.init(num_cpus=max(os.cpu_count() or 1, need), include_dashboard=False,
                 runtime_env={"env_vars": env})


def start_workers(cfg: Config) -> list:
    """One colocated worker per rank, placed by a Ray placement group, joined in one group."""
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from rl.worker import ColocatedWorker

    bundle = {"CPU": cfg.ray.num_cpus_per_worker}
    if cfg.ray.num_gpus_per_worker:
        bundle["GPU"] = cfg.ray.num_gpus_per_worker
    pg = placement_group([bundle] * cfg.ray.num_workers, strategy="PACK")
    ray.get(pg.ready(), timeout=300)
    actor = ray.remote(ColocatedWorker)
    workers = [actor.options(
        num_cpus=cfg.ray.num_cpus_per_worker, num_gpus=cfg.ray.num_gpus_per_worker,
        scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=r),
    ).remote(r, cfg.ray.num_workers) for r in range(cfg.ray.num_workers)]
    addr, port = ray.get(workers[0].rendezvous_address.remote())
    ray.get([w.init_distributed.remote(addr, port) for w in workers])
    return workers


class Controller:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.workers: list = []

    # ------------------------------------------------------------------ set-up
    def setup(self) -> None:
        import ray
        from transformers import AutoTokenizer

        from rl.data import PromptSet, resolve_rows
        from rl.models import resolve_model_path
        from rl.warmup import run_warmup

        cfg = self.cfg
        self.scorer = RewardScorer(cfg.reward, cfg.data.prompt_key)  # fails early on a bad name
        self.run_dir = new_run_dir(cfg)
        (self.run_dir / "config.yaml").write_text(to_yaml(cfg))
        print(f"run directory: {self.run_dir}", flush=True)
        model_path = resolve_model_path(cfg.model.path, cfg.run.seed)
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.prompts = PromptSet(resolve_rows(cfg.data, cfg.run.seed), self.tokenizer, cfg.data,
                                 cfg.run.seed)
        start_ray(cfg)
        self.workers = start_workers(cfg)
        if cfg.warmup.sft_steps > 0:
            model_path = run_warmup(self.workers, model_path, self.prompts, self.tokenizer, cfg)
        self.model_path = model_path
        self.grad_accum = grad_accum_steps(cfg)
        ray.get([w.init_trainer.remote(model_path, cfg.trainer, cfg.algorithm.loss,
                                       self.grad_accum, cfg.rollout.temperature)
                 for w in self.workers])
        ray.get([w.init_rollout.remote(model_path, cfg.rollout, cfg.run.seed)
                 for w in self.workers])
        first = self.prompts.rows[0]
        answer = self.tokenizer.encode(str(first.get("answer", "")), add_special_tokens=False)
        self.probe = self.prompts.prompt_ids[0] + answer + [self.tokenizer.eos_token_id]
        self.log = RunLog(self.run_dir, cfg.trainer.total_steps)

    # ------------------------------------------------------------------ one step
    def generate(self, rows: list[int], step: int) -> list[Sample]:
        import ray

        n = self.cfg.rollout.n
        base = (self.cfg.run.seed * 1_000_003 + step) * 100_000
        parts = chunk(list(enumerate(rows)), len(self.workers))
        futures = [w.generate.remote([self.prompts.prompt_ids[r] for _, r in part],
                                     [base + g * n for g, _ in part])
                   for w, part in zip(self.workers, parts)]
        samples = []
        for part, groups in zip(parts, ray.get(futures)):
            for (g, r), completions in zip(part, groups):
                for c in completions:
                    samples.append(Sample(r, g, self.prompts.prompt_ids[r], c["token_ids"],
                                          c["logprobs"], c["finish_reason"], c["text"]))
        return samples

    def score(self, samples: list[Sample]) -> dict:
        rewards, metrics = self.scorer.score(
            [self.prompts.rows[s.row] for s in samples], [s.text for s in samples])
        for s, r in zip(samples, rewards):
            s.reward = r
        return metrics

    def advantages(self, samples: list[Sample]) -> None:
        n = self.cfg.rollout.n
        rewards = torch.tensor([s.reward for s in samples]).view(-1, n)  # [P, G]
        adv = compute_advantages(rewards, self.cfg.algorithm).view(-1)
        for s, a in zip(samples, adv.tolist()):
            s.advantage = a

    def update(self, samples: list[Sample], step: int) -> dict:
        import ray

        plan = plan_update(samples, len(self.workers), self.cfg.algorithm.num_mini_batches,
                           self.grad_accum, self.tokenizer.pad_token_id, self.cfg.run.seed + step)
        totals: dict[str, float] = {}
        for ranks, tokens, seqs in zip(plan.mini_batches, plan.num_tokens, plan.num_seqs):
            results = ray.get([w.train.remote(mb, tokens, seqs)
                               for w, mb in zip(self.workers, ranks)])
            for key in results[0]:
                # every rank returns its share of a global mean; grad_norm is global already
                value = results[0][key] if key == "grad_norm" else sum(r[key] for r in results)
                totals[key] = totals.get(key, 0.0) + value / len(plan.mini_batches)
        totals["grad/norm"] = totals.pop("grad_norm")
        return totals

    def sync(self) -> dict:
        import ray

        bucket = int(self.cfg.sync.bucket_mb * 2**20)
        results = ray.get([w.sync_weights.remote(bucket, self.probe, self.cfg.sync.tolerance)
                           for w in self.workers])
        out = {k: max(r[k] for r in results) for k in results[0]}
        return out

    def step(self, step: int) -> dict:
        t0 = time.perf_counter()
        rows = self.prompts.next_batch(self.cfg.rollout.prompts_per_step)
        samples = self.generate(rows, step)
        t1 = time.perf_counter()
        metrics = self.score(samples)
        t2 = time.perf_counter()
        self.advantages(samples)
        metrics.update(self.update(samples, step))
        t3 = time.perf_counter()
        metrics.update(self.sync())
        t4 = time.perf_counter()
        metrics.update(self.sample_metrics(samples))
        tokens = sum(len(s.prompt_ids) + len(s.response_ids) for s in samples)
        metrics.update({"step": step, "time/rollout": t1 - t0, "time/reward": t2 - t1,
                        "time/update": t3 - t2, "time/sync": t4 - t3, "time/step": t4 - t0,
                        "throughput/tokens_per_s": tokens / (t4 - t0),
                        "rollout/tokens_per_s": sum(len(s.response_ids) for s in samples)
                        / (t1 - t0)})
        self.log.log_step(metrics)
        self.log.log_rollouts(step, self.rollout_records(samples))
        return metrics

    def sample_metrics(self, samples: list[Sample]) -> dict:
        lengths = torch.tensor([float(len(s.response_ids)) for s in samples])
        return {"response/length_mean": float(lengths.mean()),
                "response/clip_ratio": sum(s.finish_reason == "length" for s in samples)
                / len(samples)}

    def rollout_records(self, samples: list[Sample]) -> list[dict]:
        keep = samples if self.cfg.run.log_samples < 0 else samples[:self.cfg.run.log_samples]
        return [{"prompt": self.prompts.texts[s.row], "completion": s.text, "reward": s.reward,
                 "advantage": s.advantage, "finish_reason": s.finish_reason} for s in keep]

    # ------------------------------------------------------------------ outputs
    def checkpoint(self, step: int) -> None:
        import ray

        every = self.cfg.trainer.checkpoint_every
        if every and step % every == 0:
            directory = str((self.run_dir / "checkpoints").resolve())
            ray.get([w.save_checkpoint.remote(directory, f"step_{step}") for w in self.workers])

    def finish(self) -> Path:
        import ray

        final = self.run_dir / "final_model"
        ray.get([w.save_hf.remote(str(final.resolve())) for w in self.workers])
        self.tokenizer.save_pretrained(final)
        self.log.plot()
        return final

    def shutdown(self) -> None:
        import ray

        for w in self.workers:
            ray.kill(w)
        self.workers = []

    def run(self) -> Path:
        """Set up, train cfg.trainer.total_steps steps, save; returns the run directory."""
        try:
            self.setup()
            for step in range(1, self.cfg.trainer.total_steps + 1):
                self.step(step)
                self.checkpoint(step)
            final = self.finish()
            print(f"done: metrics {self.log.metrics_path}, model {final}", flush=True)
            return self.run_dir
        finally:
            self.shutdown()
