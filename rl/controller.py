"""The RL controller: generate -> score -> prepare -> advantages -> update -> sync, per step."""
from __future__ import annotations

import time
from dataclasses import asdict
from pathlib import Path

import torch

from rl import checkpoint as ckpt
from rl.advantages import AdvantageInputs, compute_advantages
from rl.batch import (Sample, chunk, collate, padded, plan_update, reduce_rank_metrics,
                      response_mask, response_slice, split_ranks)
from rl.collect import collect, overlong_penalty
from rl.config import Config, ConfigError, grad_accum_steps, to_yaml
from rl.errors import ActorFailure, death_cause, prompt_error, stop_on_sigterm
from rl.metrics import RunLog
from rl.placement import start_placement, start_ray
from rl.progress import wait_with_progress
from rl.rewarding import RewardScorer, checked_rows
from rl.timeline import Spans, Timeline, traced
from update.losses import MAX_METRICS, BatchCounts, old_logprob_metrics
from update.losses import kl as kl_estimate


def new_run_dir(cfg: Config) -> Path:
    """runs/<name>, or runs/<name>-2, -3 ... when that exists: never overwrite a past run."""
    base = Path(cfg.run.output_dir) / cfg.run.name
    path, i = base, 1
    while path.exists():
        i += 1
        path = base.with_name(f"{base.name}-{i}")
    path.mkdir(parents=True)
    return path


class Controller:
    def __init__(self, cfg: Config, rows: list[dict] | None = None, resume=None,
                 resume_command=lambda run_dir: f"rl-train RECIPE --resume {run_dir}",
                 placements=None):
        """rows: the data set, already through the rewards' start checks (rl-train does both
        before the heavy imports); None: setup loads and checks it. resume: an
        rl.checkpoint.ResumePoint to continue from (checked against cfg by the caller);
        resume_command(run_dir): the command that resumes this run, for error messages.
        placements: an rl.placement.PlacementPool to take the actors from and give them back
        to (several runs in one driver); None: this run starts and stops its own."""
        self.cfg = cfg
        self.placements = placements
        self.rows = rows
        self.resume = resume
        self.resume_command = resume_command
        self.restarts = 0
        self.quiet_placement = None  # the placement whose actors stopped recording spans
        self.placement = None
        self.producer = None  # rl.pipeline.RolloutProducer in the async pipeline modes
        self.scorer = None
        self.policy_version = 0  # bumped by every sync; engines and samples carry it
        self.spans = Spans()  # the driver's track of timeline.json
        self.timeline = None
        self.log = None
        self.evaluator = None  # rl.evaluate.Evaluator when there is a held-out set

    @property
    def trainers(self) -> list:
        """The trainer ranks' actors, in rank order."""
        return self.placement.trainers

    @property
    def engines(self) -> list:
        """The rollout engines' actors (the same actors as `trainers` when colocated)."""
        return self.placement.engines

    # ------------------------------------------------------------------ set-up
    def setup(self) -> None:
        from transformers import AutoTokenizer

        from rl.data import PromptSet
        from rl.models import resolve_model_path

        cfg = self.cfg
        # bad rewards or tests fail before Ray starts
        rows = self.rows if self.rows is not None else checked_rows(cfg)
        resume = self.resume
        # a resumed run starts from the base model its checkpoint was trained from (checked)
        model_path = (resume.state["model_path"] if resume
                      else resolve_model_path(cfg.model.path, cfg.run.seed))
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        try:  # prompts that cannot be rendered or do not fit: refused before Ray starts
            self.prompts = PromptSet(rows.train, self.tokenizer, cfg.data, cfg.run.seed,
                                     cfg.rollout)
            self.held_out = (PromptSet(rows.held_out, self.tokenizer, cfg.data, cfg.run.seed,
                                       cfg.rollout) if rows.held_out else None)
        except (ValueError, KeyError, TypeError) as e:
            raise ConfigError(prompt_error(e, cfg)) from None
        if self.held_out is not None:
            print(f"data: {len(self.prompts.rows)} training rows, {len(self.held_out.rows)} "
                  f"held-out prompts (never trained on"
                  + (f"; {rows.dropped} training rows with a held-out prompt dropped)"
                     if rows.dropped else ")"), flush=True)
        self.run_dir = resume.run_dir if resume else new_run_dir(cfg)
        (self.run_dir / "config.yaml").write_text(to_yaml(cfg))
        print(f"run directory: {self.run_dir}" + (f" (resuming from {resume.checkpoint})"
                                                  if resume else ""), flush=True)
        if cfg.run.timeline_steps > 0:
            self.timeline = Timeline(self.run_dir / "timeline.json", cfg.run.timeline_steps,
                                     keep_until=resume.step if resume else None)
        span = self.spans.span
        with span("start ray"):
            start_ray(cfg)
        stop_on_sigterm()  # ray.init put its own handler in place
        self.scorer = RewardScorer(cfg.reward, cfg.data.prompt_key)  # fails early on a bad name
        if self.held_out is not None:
            from rl.evaluate import Evaluator

            self.evaluator = Evaluator(self.held_out, self.scorer, cfg.trainer.eval_k,
                                       cfg.trainer.eval_threshold, self.run_dir / "eval")
        self.grad_accum = grad_accum_steps(cfg)
        # n samples of each prompt: the trainers run each prompt once (update.forward)
        self.share_prompts = cfg.trainer.enable_prompt_sharing and cfg.rollout.n > 1
        first = self.prompts.rows[0]
        answer = self.tokenizer.encode(str(first.get("answer", "")), add_special_tokens=False)
        self.probe = self.prompts.prompt_ids[0] + answer + [self.tokenizer.eos_token_id]
        self.start_workers(model_path, resume)

    def start_workers(self, model_path: str, resume) -> None:
        """The placement, the warm-up (a new run), the trainers, the engines at the policy
        version (a new run's base model, or the checkpoint's policy), the logs."""
        import ray

        from rl.loggers import open_loggers
        from rl.warmup import run_warmup

        cfg, span = self.cfg, self.spans.span
        with span("start placement"):
            self.placement = (self.placements.start(cfg) if self.placements is not None
                              else start_placement(cfg))
        if cfg.warmup.sft_steps > 0 and not resume:
            with span("warm-up"):
                model_path = run_warmup(self.trainers, model_path, self.prompts, self.tokenizer,
                                        cfg)
        self.model_path = model_path
        # the base model's content hash goes into checkpoints: a resume refuses a changed one
        self.model_sha256 = (resume.state["model_sha256"] if resume else
                             ckpt.model_digest(model_path) if cfg.trainer.checkpoint_every else None)
        with span("init trainer"):
            ray.get([w.init_trainer.remote(model_path, cfg.trainer, cfg.algorithm.loss,
                                           self.grad_accum, cfg.rollout.temperature,
                                           float(cfg.rollout.max_new_tokens), cfg.algorithm.critic)
                     for w in self.trainers])
        start = resume.step + 1 if resume else 1
        if resume:
            with span("load checkpoint"):
                ckpt.restore(self, resume)  # trainers, engines (synced), data, RNG
        else:
            with span("init engines"):
                self.placement.init_rollout(model_path, self.policy_version)
            self.placement.measure_probe_noise(self.probe)
        # a new run scores its base model on the held-out set before step 1
        first_eval = self.evaluate(0) if self.evaluator is not None and not resume else None
        self.producer = None
        if cfg.pipeline.mode != "sync":  # the engines stream from here on
            from rl.pipeline import RolloutProducer

            self.placement.start_streams(cfg.pipeline.interruptible)
            self.producer = RolloutProducer(self)
        loggers = open_loggers(cfg.run.loggers, self.run_dir, asdict(cfg), cfg.run.wandb_project,
                               start)
        self.log = RunLog(self.run_dir, cfg.trainer.total_steps, loggers,
                          resume=(resume.step, resume.state["metrics"]) if resume else None)
        if first_eval is not None:
            self.log.log_step(first_eval)
        self.start_step = start
        self.record_timeline(start - 1)

    def recover(self, error, step: int) -> int:
        """An actor died during `step`: one line naming it and the cause; with restarts left,
        restart the placement from the latest checkpoint and return the step to go on from;
        else raise ActorFailure with the command that resumes the run."""
        from rl.checkpoint import latest_checkpoint

        line = f"{self.dead_actor(error)} died during step {step}: {death_cause(error)}"
        print(f"rl-train: {line}", flush=True)
        last = latest_checkpoint(self.run_dir)
        if self.restarts >= self.cfg.trainer.max_restarts or last is None:
            why = ("no checkpoint to restart from" if last is None and
                   self.cfg.trainer.max_restarts else "trainer.max_restarts is spent")
            raise ActorFailure(f"{line}; {why}; resume with: "
                               f"{self.resume_command(self.run_dir)}")
        self.restarts += 1
        print(f"restarting the placement from {last.name} (restart {self.restarts} of "
              f"{self.cfg.trainer.max_restarts})", flush=True)
        self.log.close()
        self.placement.stop()
        self.spans.enabled = True  # the timeline decides again for the new placement
        point = ckpt.find_resume_point(self.cfg, str(last))
        if self.timeline is not None:
            self.timeline = Timeline(self.timeline.path, self.cfg.run.timeline_steps,
                                     keep_until=point.step)
        self.start_workers(self.model_path, point)
        return point.step + 1

    def dead_actor(self, error) -> str:
        """'trainer rank 1' (or the engine, or colocated worker) whose process died."""
        dead = getattr(error, "actor_id", None)
        for name, actor in (self.actor_tracks() if self.placement is not None else []):
            if dead is not None and actor._actor_id.hex() == dead:
                return name
        return "an actor"

    # ------------------------------------------------------------------ one step
    @traced("generate")
    def generate(self, rows: list[int], step: int, round_index: int = 0) -> list[Sample]:
        """n samples per prompt row, spread over the engines, gathered in order; each engine
        first checks it holds the current policy version."""
        import ray

        n = self.cfg.rollout.n
        base = ((self.cfg.run.seed * 1_000_003 + step) * 64 + round_index) * 100_000
        # empty chunks come last: with more engines than prompts the last engines sit out
        parts = [p for p in chunk(list(enumerate(rows)), len(self.engines)) if p]
        futures = [e.generate.remote([self.prompts.prompt_ids[r] for _, r in part],
                                     [base + g * n for g, _ in part],
                                     [self.prompts.constraints[r] for _, r in part],
                                     version=self.policy_version)
                   for e, part in zip(self.engines, parts)]
        samples = []
        results = ray.get(futures)
        self.rollout_stats = {k: sum(r["stats"][k] for r in results) / len(results)
                              for k in results[0]["stats"]}
        for part, result in zip(parts, results):
            for (g, r), completions in zip(part, result["groups"]):
                for c in completions:
                    samples.append(Sample(r, g, self.prompts.prompt_ids[r], c["token_ids"],
                                          c["logprobs"], c["finish_reason"], c["text"],
                                          policy_version=result["policy_version"]))
        return samples

    @traced("reward")
    def score(self, samples: list[Sample]) -> dict:
        """Reward each sample; score = reward + overlong shaping (what advantages use)."""
        algo, max_len = self.cfg.algorithm, self.cfg.rollout.max_new_tokens
        rewards, metrics = self.scorer.score(
            [self.prompts.rows[s.row] for s in samples], [s.text for s in samples])
        for s, r in zip(samples, rewards):
            s.reward = r
            s.score = r + overlong_penalty(len(s.response_ids), max_len, algo.overlong_buffer,
                                           algo.overlong_penalty)
        return metrics

    @traced("prepare")
    def prepare(self, samples: list[Sample]) -> dict:
        """Old/reference logprobs and values from the trainers, once per batch; mismatch and KL
        metrics; the KL reward penalty when the KL is not a loss term."""
        import ray

        parts = split_ranks(samples, len(self.trainers), self.grad_accum)
        pad = self.tokenizer.pad_token_id
        results = ray.get([w.prepare.remote([collate(m, pad, self.share_prompts) for m in micros])
                           for w, micros in zip(self.trainers, parts)])
        for micros, outs in zip(parts, results):
            for micro, out in zip(micros, outs):
                for i, s in enumerate(micro):
                    for name, tensor in out.items():
                        setattr(s, name, response_slice(s, tensor[i]))
        mask = response_mask(samples)
        old, rollout = padded(samples, "old_logprobs"), padded(samples, "rollout_logprobs")
        ref = padded(samples, "ref_logprobs") if samples[0].ref_logprobs else None
        loss_cfg = self.cfg.algorithm.loss
        metrics = old_logprob_metrics(old, rollout, ref, mask,
                                      BatchCounts(float(mask.sum()), float(len(samples))),
                                      loss_cfg.kl_estimator)
        self.token_rewards = None
        if ref is not None and not loss_cfg.use_kl_loss:
            self.token_rewards = -loss_cfg.kl_coef * kl_estimate(old, ref,
                                                                 loss_cfg.kl_estimator) * mask
        return metrics

    @traced("advantages")
    def advantages(self, samples: list[Sample]) -> dict:
        mask = response_mask(samples)
        inputs = AdvantageInputs(
            scores=torch.tensor([s.score for s in samples]), response_mask=mask,
            group_size=self.cfg.rollout.n, token_rewards=self.token_rewards,
            values=padded(samples, "values") if samples[0].values else None)
        adv, returns = compute_advantages(inputs, self.cfg.algorithm)
        for i, s in enumerate(samples):
            r = len(s.response_ids)
            s.advantages, s.returns = adv[i, :r].tolist(), returns[i, :r].tolist()
        n = mask.sum()
        return {"advantages/mean": float((adv * mask).sum() / n),
                "advantages/abs_mean": float((adv.abs() * mask).sum() / n)}

    @traced("update")
    def update(self, samples: list[Sample], step: int) -> dict:
        """ppo_epochs passes, each num_mini_batches optimizer steps (policy, and critic)."""
        import ray

        algo = self.cfg.algorithm
        totals: dict[str, float] = {}
        num_steps = algo.ppo_epochs * algo.num_mini_batches
        for epoch in range(algo.ppo_epochs):
            plan = plan_update(samples, len(self.trainers), algo.num_mini_batches,
                               self.grad_accum, self.tokenizer.pad_token_id,
                               (self.cfg.run.seed + step) * 1000 + epoch, self.share_prompts)
            for ranks, counts in zip(plan.mini_batches, plan.counts):
                merged = reduce_rank_metrics(ray.get([w.train.remote(mb, counts)
                                                      for w, mb in zip(self.trainers, ranks)]))
                for k, v in merged.items():
                    totals[k] = (max(totals.get(k, v), v) if k in MAX_METRICS
                                 else totals.get(k, 0.0) + v / num_steps)
        totals["grad/norm"] = totals.pop("grad_norm")
        return totals

    @traced("sync")
    def sync(self) -> dict:
        """Make every engine the next policy version, verified. A sync that failed its checks
        (e.g. a corrupted bucket) is reported and retried once; a second failure stops the run."""
        from weight_sync.transport import WeightSyncError

        version = self.policy_version + 1
        try:
            metrics = self.placement.sync(version, self.probe)
            metrics["sync/retries"] = 0.0
        except WeightSyncError as e:
            print(f"weight sync failed, retrying once: {e}", flush=True)
            metrics = self.placement.sync(version, self.probe)
            metrics["sync/retries"] = 1.0
        self.policy_version = version
        metrics["sync/policy_version"] = float(version)
        return metrics

    @traced("eval")
    def evaluate(self, step: int) -> dict:
        """eval/* on the held-out prompts with the engines' current weights (rl.evaluate)."""
        from rl.evaluate import console_line

        if self.placement.streaming:  # async: the last step is done
            self.placement.stop_streams()
        metrics = self.evaluator.run(self.engines, self.policy_version, step)
        print(console_line(step, metrics), flush=True)
        return {"step": step, **metrics}

    def eval_due(self, step: int) -> bool:
        every = self.cfg.trainer.eval_every
        return self.evaluator is not None and (
            step == self.cfg.trainer.total_steps or bool(every) and step % every == 0)

    def step(self, step: int) -> dict:
        t0 = time.perf_counter()
        if self.producer is None:
            batch = collect(self, step)
        else:  # async: from the producer's buffer; the next batches generate during the update
            batch = self.producer.take(step)
            self.producer.fill(self.policy_version + 1)
            self.rollout_stats = {"time/trainer_wait": batch.seconds_generate}
        samples, metrics = batch.samples, dict(batch.metrics)
        t1 = time.perf_counter()
        if self.cfg.algorithm.one_pass():  # old logprobs and mismatch metrics come from update
            self.token_rewards = None
        else:
            metrics.update(self.prepare(samples))
        metrics.update(self.advantages(samples))
        metrics.update(self.update(samples, step))
        t2 = time.perf_counter()
        metrics.update(self.sync())
        t3 = time.perf_counter()
        metrics.update(self.sample_metrics(samples))
        # staleness of each trained sample: the update's starting version - its first token's
        versions = [s.policy_version for s in samples]
        lags = [self.policy_version - 1 - v for v in versions]
        metrics["rollout/policy_version"] = float(min(versions))
        metrics["rollout/staleness"] = sum(lags) / len(lags)
        metrics["rollout/staleness_max"] = float(max(lags))
        metrics.update(self.rollout_stats)
        metrics["data/filtered_overlong"] = float(self.prompts.num_filtered)
        tokens = sum(len(s.prompt_ids) + len(s.response_ids) for s in batch.all_samples)
        metrics.update({
            "step": step, "time/rollout": batch.seconds_generate,
            "time/reward": batch.seconds_reward, "time/update": t2 - t1, "time/sync": t3 - t2,
            "time/step": t3 - t0, "throughput/tokens_per_s": tokens / (t3 - t0)})
        if self.producer is None:  # async, the rollout ran beside earlier steps: no rate here
            metrics["rollout/tokens_per_s"] = (sum(len(s.response_ids) for s in batch.all_samples)
                                               / batch.seconds_generate)
        self.log.log_rollouts(step, self.rollout_records(samples))
        return metrics

    def sample_metrics(self, samples: list[Sample]) -> dict:
        lengths = [len(s.response_ids) for s in samples]
        return {"response/length_mean": sum(lengths) / len(lengths),
                "response/clip_ratio": sum(s.finish_reason == "length" for s in samples)
                / len(samples)}

    def rollout_records(self, samples: list[Sample]) -> list[dict]:
        keep = samples if self.cfg.run.log_samples < 0 else samples[:self.cfg.run.log_samples]
        return [{"prompt": self.prompts.texts[s.row], "completion": s.text, "reward": s.reward,
                 "advantage": s.advantages[0] if s.advantages else 0.0,
                 "finish_reason": s.finish_reason, "policy_version": s.policy_version}
                for s in keep]

    # ------------------------------------------------------------------ outputs
    def checkpoint(self, step: int, metrics: dict) -> dict:
        """Save checkpoint `step` when it is due (its size and save time are metrics)."""
        every = self.cfg.trainer.checkpoint_every
        if every and step % every == 0:
            if self.producer is not None:
                print(f"checkpoint step_{step}: {self.producer.unconsumed} groups handed out or "
                      f"buffered and not trained are not in it; a resume drops them and "
                      f"generates from the prompts after them", flush=True)
            return self.save_checkpoint(step, metrics)
        return {}

    @traced("checkpoint")
    def save_checkpoint(self, step: int, metrics: dict) -> dict:
        return ckpt.save(self, step, metrics)

    @traced("save")
    def finish(self) -> Path:
        final = self.run_dir / "final_model"
        wait_with_progress([w.save_hf.remote(str(final.resolve())) for w in self.trainers],
                           "saving the final model")
        self.tokenizer.save_pretrained(final)
        self.log.plot()
        return final

    def actor_tracks(self) -> list[tuple[str, object]]:
        """(track name, actor) for every actor of the placement, trainers first."""
        if self.engines is self.trainers:
            return [(f"worker {i} (trainer rank {i} + engine {i})", w)
                    for i, w in enumerate(self.trainers)]
        return ([(f"trainer rank {i}", w) for i, w in enumerate(self.trainers)]
                + [(f"rollout engine {i}", e) for i, e in enumerate(self.engines)])

    def record_timeline(self, step: int, final: bool = False) -> None:
        """Add the spans every process recorded since the last call to timeline.json (steps up
        to run.timeline_steps, the set-up as step 0, the final save)."""
        import ray

        if self.timeline is None or not (self.timeline.recording(step) or final):
            if self.placement is not None and self.quiet_placement is not self.placement:
                # once per placement: no process keeps recording spans nobody reads
                ray.get([a.drain_spans.remote(False) for _, a in self.actor_tracks()])
                self.spans.enabled = False
                self.quiet_placement = self.placement
            return
        keep = not final and self.timeline.recording(step + 1)
        tracks = self.actor_tracks() if self.placement is not None else []
        spans = ray.get([a.drain_spans.remote(keep) for _, a in tracks])
        self.timeline.add("driver (controller)", self.spans.drain(), step)
        for (name, _), items in zip(tracks, spans):
            self.timeline.add(name, items, step)
        self.timeline.write()
        self.spans.enabled = keep

    def shutdown(self) -> None:
        if self.log is not None:
            self.log.close()
        if self.scorer is not None:
            self.scorer.close()
            self.scorer = None
        if self.placement is not None:
            self.placement.release()
            self.placement = None

    def run(self) -> Path:
        """Set up, train cfg.trainer.total_steps steps, save; returns the run directory."""
        try:
            import ray

            self.setup()
            step = self.start_step
            while step <= self.cfg.trainer.total_steps:
                try:
                    metrics = self.step(step)
                    if self.eval_due(step):
                        metrics.update(self.evaluate(step))
                    # saved before the step's line is logged: a resume restores a line that a
                    # crash between the two left unwritten, and never writes one twice
                    metrics.update(self.checkpoint(step, metrics))
                    self.log.log_step(metrics)
                    self.record_timeline(step)
                    step += 1
                except ray.exceptions.RayActorError as e:
                    step = self.recover(e, step)
            final = self.finish()
            self.record_timeline(self.cfg.trainer.total_steps, final=True)
            print(f"done: metrics {self.log.metrics_path}, model {final}", flush=True)
            return self.run_dir
        finally:
            self.shutdown()
