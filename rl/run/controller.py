"""The RL controller: generate -> score -> prepare -> advantages -> update -> sync, per step
(set-up, recovery and checkpoints: the rl.run.lifecycle.RunLifecycle it holds)."""
from __future__ import annotations

import time
from pathlib import Path

import torch

from rl.algo.advantages import AdvantageInputs, compute_advantages
from rl.algo.batch import (Sample, collate, padded, plan_update, reduce_rank_metrics,
                           response_mask, response_slice, split_ranks)
from rl.errors import get_all
from rl.observe.timeline import Spans, traced
from rl.run.collect import collect, generate_spread, mask_untrained, overlong_penalty
from rl.run.lifecycle import RunLifecycle
from rl.run.step_metrics import (env_metrics, rollout_records, sample_metrics,
                                 staleness_metrics, time_metrics)
from rl.schema import Config
from update.losses import MAX_METRICS, BatchCounts, old_logprob_metrics
from update.losses import kl as kl_estimate


class Controller:
    """One RL step, as the algorithm reads: generate -> score -> prepare -> advantages -> update
    -> sync (and evaluate when due); `run` loops over the steps."""

    def __init__(self, cfg: Config, rows: list[dict] | None = None, resume=None,
                 resume_command=lambda run_dir: f"rl-train RECIPE --resume {run_dir}",
                 placements=None):
        """rows: the data set, already through the rewards' start checks (rl-train does both
        before the heavy imports); None: setup loads and checks it. resume: an
        rl.run.checkpoint.ResumePoint to continue from (checked against cfg by the caller);
        resume_command(run_dir): the command that resumes this run, for error messages.
        placements: an rl.run.pool.PlacementPool to take the actors from and give them back
        to (several runs in one driver); None: this run starts and stops its own."""
        self.cfg = cfg
        self.spans = Spans()  # the driver's track of timeline.json
        self.life = RunLifecycle(cfg, rows, resume, resume_command, placements, self.spans)
        self.producer = None  # rl.run.pipeline.RolloutProducer in the async pipeline modes
        self.policy_version = 0  # bumped by every sync; engines and samples carry it

    def setup(self) -> None:
        """Set the run up (the lifecycle), then start generating."""
        self.policy_version = self.life.setup()
        self.start()

    def start(self) -> None:
        """With the engines at the run's first policy version: a new run scores its base model
        on the held-out set before step 1; the async modes start streaming; the log opens."""
        life = self.life
        first_eval = (self.evaluate(0) if life.evaluator is not None and life.resume is None
                      else None)
        self.producer = None
        if self.cfg.pipeline.mode != "sync":  # the engines stream from here on
            from rl.run.pipeline import RolloutProducer

            self.placement.start_streams(self.cfg.pipeline.interruptible)
            self.producer = RolloutProducer(self.cfg, self.prompts, self.engines, self.score)
        life.open_log(first_eval)

    @property
    def placement(self):
        return self.life.placement

    @property
    def prompts(self):
        """The training prompts (rl.data.prompts.PromptSet)."""
        return self.life.prompts

    @property
    def tokenizer(self):
        return self.life.tokenizer

    @property
    def trainers(self) -> list:
        """The trainer ranks' actors, in rank order."""
        return self.placement.trainers

    @property
    def engines(self) -> list:
        """The rollout engines' actors (the same actors as `trainers` when colocated)."""
        return self.placement.engines

    # ------------------------------------------------------------------ one step
    @traced("generate")
    def generate(self, rows: list[int], step: int, round_index: int = 0
                 ) -> tuple[list[Sample], dict]:
        """(n samples per prompt row, spread over the engines, gathered in order; the engines'
        counters, averaged); each engine first checks it holds the current policy version."""
        n = self.cfg.rollout.n
        base = ((self.cfg.run.seed * 1_000_003 + step) * 64 + round_index) * 100_000
        spread = generate_spread(self.engines, self.prompts, rows,
                                 [base + g * n for g in range(len(rows))],
                                 version=self.policy_version)
        samples = []
        stats = {k: sum(r["stats"][k] for _, r in spread) / len(spread)
                 for k in spread[0][1]["stats"]}
        for part, result in spread:
            for g, completions in zip(part, result["groups"]):
                samples += [Sample.of(rows[g], g, self.prompts.prompt_ids[rows[g]], c,
                                      result["policy_version"]) for c in completions]
        return samples, stats

    @traced("reward")
    def score(self, samples: list[Sample]) -> dict:
        """Reward each sample (multi-turn: its last turn's text, or the env's own reward when
        it gave one); score = reward + overlong shaping (what advantages use), the length being
        the tokens of the budget (rollout.max_new_tokens) spent."""
        algo, max_len = self.cfg.algorithm, self.cfg.rollout.max_new_tokens
        rewards, metrics = self.life.scorer.score(
            [self.prompts.rows[s.row] for s in samples], [s.text for s in samples],
            [s.env_reward for s in samples])
        for s, r in zip(samples, rewards):
            s.reward = r
            s.score = s.reward + overlong_penalty(len(s.response_ids), max_len,
                                                  algo.overlong_buffer, algo.overlong_penalty)
        if self.cfg.env.name is not None:
            metrics["env/untrained"] = float(mask_untrained(samples,
                                                            self.cfg.env.train_truncated))
        return metrics

    @traced("prepare")
    def prepare(self, samples: list[Sample]) -> tuple[dict, torch.Tensor | None]:
        """Old/reference logprobs and values from the trainers, once per batch; (mismatch and
        KL metrics, the KL reward penalty per token [B, R] when the KL is not a loss term, else
        None)."""
        parts = split_ranks(samples, len(self.trainers), self.life.grad_accum)
        pad = self.tokenizer.pad_token_id
        share = self.life.share_prompts
        results = get_all([w.prepare.remote([collate(m, pad, share) for m in micros])
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
        token_rewards = None
        if ref is not None and not loss_cfg.use_kl_loss:
            token_rewards = -loss_cfg.kl_coef * kl_estimate(old, ref, loss_cfg.kl_estimator) * mask
        return metrics, token_rewards

    @traced("advantages")
    def advantages(self, samples: list[Sample], token_rewards: torch.Tensor | None) -> dict:
        mask = response_mask(samples)
        inputs = AdvantageInputs(
            scores=torch.tensor([s.score for s in samples]), response_mask=mask,
            group_size=self.cfg.rollout.n, token_rewards=token_rewards,
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
        algo = self.cfg.algorithm
        totals: dict[str, float] = {}
        num_steps = algo.ppo_epochs * algo.num_mini_batches
        for epoch in range(algo.ppo_epochs):
            plan = plan_update(samples, len(self.trainers), algo.num_mini_batches,
                               self.life.grad_accum, self.tokenizer.pad_token_id,
                               (self.cfg.run.seed + step) * 1000 + epoch,
                               self.life.share_prompts)
            for ranks, counts in zip(plan.mini_batches, plan.counts):
                merged = reduce_rank_metrics(get_all([w.train.remote(mb, counts)
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
            metrics = self.placement.sync(version, self.life.probe)
            metrics["sync/retries"] = 0.0
        except WeightSyncError as e:
            print(f"weight sync failed, retrying once: {e}", flush=True)
            metrics = self.placement.sync(version, self.life.probe)
            metrics["sync/retries"] = 1.0
        self.policy_version = version
        metrics["sync/policy_version"] = float(version)
        return metrics

    @traced("eval")
    def evaluate(self, step: int) -> dict:
        """eval/* on the held-out prompts with the engines' current weights (rl.run.evaluate)."""
        from rl.run.evaluate import console_line

        if self.placement.streaming:  # async: the last step is done
            self.placement.stop_streams()
        metrics = self.life.evaluator.run(self.engines, self.policy_version, step)
        print(console_line(step, metrics), flush=True)
        return {"step": step, **metrics}

    def eval_due(self, step: int) -> bool:
        every = self.cfg.trainer.eval_every
        return self.life.evaluator is not None and (
            step == self.cfg.trainer.total_steps or bool(every) and step % every == 0)

    def step(self, step: int) -> dict:
        t0 = time.perf_counter()
        if self.producer is None:
            batch = collect(self.cfg, self.prompts.next_batch,
                            lambda rows, i: self.generate(rows, step, i), self.score)
        else:  # async: from the producer's buffer; the next batches generate during the update
            batch = self.producer.take(self.policy_version)
            self.producer.fill(self.policy_version + 1, self.policy_version)
        samples, metrics = batch.samples, dict(batch.metrics)
        t1 = time.perf_counter()
        token_rewards = None
        if not self.cfg.algorithm.one_pass():  # else old logprobs come from the update
            prepared, token_rewards = self.prepare(samples)
            metrics.update(prepared)
        metrics.update(self.advantages(samples, token_rewards))
        metrics.update(self.update(samples, step))
        t2 = time.perf_counter()
        metrics.update(self.sync())
        t3 = time.perf_counter()
        metrics.update(sample_metrics(samples))
        multi_turn = self.cfg.env.name is not None
        if multi_turn:
            metrics.update(env_metrics(samples))
        metrics.update(staleness_metrics(samples, self.policy_version))
        metrics.update(batch.engine_stats)
        metrics["data/filtered_overlong"] = float(self.prompts.num_filtered)
        metrics.update(self.life.plan_metrics)  # the plan's figures beside the measured ones
        metrics.update(time_metrics(step, batch, t0, t1, t2, t3, self.producer is not None))
        decode = self.tokenizer.decode if multi_turn else None
        self.life.log.log_rollouts(step, rollout_records(samples, self.prompts.texts,
                                                    self.cfg.run.log_samples, decode))
        return metrics

    def run(self) -> Path:
        """Set up, train cfg.trainer.total_steps steps, save; returns the run directory."""
        life = self.life
        try:
            import ray

            self.setup()
            step = life.start_step
            while step <= self.cfg.trainer.total_steps:
                try:
                    metrics = self.step(step)
                    if self.eval_due(step):
                        metrics.update(self.evaluate(step))
                    # saved before the step's line is logged: a resume restores a line that a
                    # crash between the two left unwritten, and never writes one twice
                    metrics.update(life.checkpoint(
                        step, metrics, self.policy_version,
                        self.producer.unconsumed if self.producer is not None else None))
                    life.log.log_step(metrics)
                    life.recorder.record(self.placement, step)
                    step += 1
                except ray.exceptions.RayActorError as e:
                    self.policy_version = life.recover(e, step)
                    self.start()
                    step = life.start_step
            final = life.finish()
            life.recorder.record(self.placement, self.cfg.trainer.total_steps, final=True)
            print(f"done: metrics {life.log.metrics_path}, model {final}", flush=True)
            return life.run_dir
        finally:
            life.shutdown()
