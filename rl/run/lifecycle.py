"""A run's life around its steps: setting up (data, Ray, the placement, the warm-up, trainers and
engines, or a checkpoint's state), restarting from the latest checkpoint after an actor died,
saving checkpoints and the final model, shutting down. rl.run.controller.Controller has these
beside its step."""
from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

from rl.config import ConfigError, grad_accum_steps, to_yaml
from rl.errors import ActorFailure, death_cause, prompt_error, stop_on_sigterm
from rl.observe.metrics import RunLog
from rl.observe.progress import wait_with_progress
from rl.observe.timeline import traced
from rl.run import checkpoint as ckpt
from rl.run.cluster import start_ray
from rl.run.placement import start_placement
from rl.run.rewarding import RewardScorer, checked_rows
from rl.run.tracks import dead_actor
from rl.schema import Config


def check_lora_targets(cfg: Config, model_path: str) -> None:
    """trainer.lora.target_modules match modules of the model (built on the meta device)."""
    if cfg.trainer.lora is None:
        return
    from transformers import AutoConfig

    from update.lora import check_targets

    try:
        check_targets(AutoConfig.from_pretrained(model_path), cfg.trainer.lora)
    except ValueError as e:
        raise ConfigError(f"trainer.lora.{e}; fix the list") from None
    lora = cfg.trainer.lora
    print(f"LoRA: rank {lora.rank}, alpha {lora.alpha:g} on {', '.join(lora.target_modules)}; "
          f"syncs move the {'adapter' if cfg.sync.lora == 'adapters' else 'merged model'}; "
          f"gradient checkpointing {'on' if cfg.trainer.checkpointing() else 'off'}"
          + ("; reference policy: the base model (the adapter switched off), no second copy "
             "loaded" if cfg.algorithm.loss.kl_coef > 0 else ""), flush=True)


def write_plan(cfg: Config, model_path: str, prompts, run_dir: Path) -> dict:
    """plan.json: rl-plan's prediction for this run (its longest prompt, this machine), and
    the plan/* metrics each step logs beside what it measures; {} where the model's shape is
    not one the planner reads."""
    import json

    from rl.data.models import cache_root
    from rl.plan.run import plan_metrics, run_plan

    try:
        plan = run_plan(cfg, model_path, max(map(len, prompts.prompt_ids)), cache_root())
    except ValueError as e:
        print(f"plan: none ({e})", flush=True)
        return {}
    (run_dir / "plan.json").write_text(json.dumps(plan.to_dict(), indent=1, default=str))
    return plan_metrics(plan)


def new_run_dir(cfg: Config) -> Path:
    """runs/<name>, or runs/<name>-2, -3 ... when that exists: never overwrite a past run."""
    base = Path(cfg.run.output_dir) / cfg.run.name
    path, i = base, 1
    while path.exists():
        i += 1
        path = base.with_name(f"{base.name}-{i}")
    path.mkdir(parents=True)
    return path


class RunLifecycle:
    """Set-up, recovery, checkpoints and shutdown of a Controller (which holds the state)."""

    # ------------------------------------------------------------------ set-up
    def setup(self) -> None:
        from rl.data.models import resolve_model_path

        cfg = self.cfg
        # bad rewards or tests fail before Ray starts
        rows = self.rows if self.rows is not None else checked_rows(cfg)
        resume = self.resume
        # a resumed run starts from the base model its checkpoint was trained from (checked)
        model_path = (resume.driver.model_path if resume
                      else resolve_model_path(cfg.model.path, cfg.run.seed))
        self.load_prompts(rows, model_path)
        self.run_dir = resume.run_dir if resume else new_run_dir(cfg)
        (self.run_dir / "config.yaml").write_text(to_yaml(cfg))
        self.plan_metrics = write_plan(cfg, model_path, self.prompts, self.run_dir)
        print(f"run directory: {self.run_dir}" + (f" (resuming from {resume.checkpoint})"
                                                  if resume else ""), flush=True)
        self.recorder.start(self.run_dir / "timeline.json", cfg.run.timeline_steps,
                            keep_until=resume.step if resume else None)
        span = self.spans.span
        with span("start ray"):
            start_ray(cfg)
        stop_on_sigterm()  # ray.init put its own handler in place
        self.scorer = RewardScorer(cfg.reward, cfg.data.prompt_key)  # fails early on a bad name
        if self.held_out is not None:
            from rl.run.evaluate import Evaluator

            self.evaluator = Evaluator(self.held_out, self.scorer, cfg.trainer.eval_k,
                                       cfg.trainer.eval_threshold, self.run_dir / "eval",
                                       self.tokenizer.decode)
        self.grad_accum = grad_accum_steps(cfg)
        # n samples of each prompt: the trainers run each prompt once (update.forward)
        self.share_prompts = cfg.trainer.enable_prompt_sharing and cfg.rollout.n > 1
        first = self.prompts.rows[0]
        answer = self.tokenizer.encode(str(first.get("answer", "")), add_special_tokens=False)
        self.probe = self.prompts.prompt_ids[0] + answer + [self.tokenizer.eos_token_id]
        self.start_workers(model_path, resume)

    def load_prompts(self, rows, model_path: str) -> None:
        """The tokenizer, and the training and held-out prompts rendered with it: what cannot
        be rendered or does not fit (or a model the adapters or the env cannot use) is refused
        here, before Ray starts."""
        from transformers import AutoTokenizer

        from envs.registry import env_factory
        from rl.data.prompts import PromptSet
        from rl.run.turns import check_env

        cfg = self.cfg
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        check_lora_targets(cfg, model_path)
        make_env = env_factory(cfg.env)  # multi-turn: prompts are what the env resets to
        if make_env is not None:
            try:  # the model's chat template must render observations after a model turn
                check_env(make_env, self.tokenizer)
            except (ValueError, TypeError) as e:
                raise ConfigError(f"env.name={cfg.env.name!r} with model.path="
                                  f"{cfg.model.path!r}: {e}") from None
        try:  # prompts that cannot be rendered or do not fit: refused before Ray starts
            self.prompts = PromptSet(rows.train, self.tokenizer, cfg.data, cfg.run.seed,
                                     cfg.rollout, make_env)
            self.held_out = (PromptSet(rows.held_out, self.tokenizer, cfg.data, cfg.run.seed,
                                       cfg.rollout, make_env) if rows.held_out else None)
        except (ValueError, KeyError, TypeError) as e:
            raise ConfigError(prompt_error(e, cfg)) from None
        if self.held_out is not None:
            print(f"data: {len(self.prompts.rows)} training rows, {len(self.held_out.rows)} "
                  f"held-out prompts (never trained on"
                  + (f"; {rows.dropped} training rows with a held-out prompt dropped)"
                     if rows.dropped else ")"), flush=True)

    def start_workers(self, model_path: str, resume) -> None:
        """The placement, the warm-up (a new run), the trainers, the engines at the policy
        version (a new run's base model, or the checkpoint's policy), the logs."""
        import ray

        from rl.data.warmup import run_warmup
        from rl.observe.loggers import open_loggers

        cfg, span = self.cfg, self.spans.span
        with span("start placement"):
            self.placement = (self.placements.start(cfg) if self.placements is not None
                              else start_placement(cfg))
        if cfg.warmup.sft_steps > 0 and not resume:
            from rl.run.agent_turns import warmup_script

            with span("warm-up"), warmup_script(cfg, self.tokenizer, self.prompts) as script:
                model_path = run_warmup(self.trainers, model_path, self.prompts, self.tokenizer,
                                        cfg, script)
        self.model_path = model_path
        # the base model's content hash goes into checkpoints: a resume refuses a changed one
        self.model_sha256 = (resume.driver.model_sha256 if resume else
                             ckpt.model_digest(model_path) if cfg.trainer.checkpoint_every else None)
        # a resumed run's engines hold the base model until the checkpoint's policy is synced
        version = resume.driver.policy_version if resume else self.policy_version
        with span("init trainer"):
            inits = [w.init_trainer.remote(model_path, cfg.trainer, cfg.algorithm.loss,
                                           self.grad_accum, cfg.rollout.temperature,
                                           float(cfg.rollout.max_new_tokens), cfg.algorithm.critic,
                                           cfg.run.seed)
                     for w in self.trainers]
            # engines apart from the trainers build meanwhile (colocated: after, same actors)
            engines = self.placement.start_rollout(model_path, int(version))
            ray.get(inits)
        start = resume.step + 1 if resume else 1
        if resume:
            with span("load checkpoint"):
                # trainers, engines (synced), data, RNG
                self.policy_version = ckpt.restore(resume, self.placement, model_path,
                                                   self.probe, self.prompts, engines)
        else:
            with span("init engines"):
                self.placement.init_rollout(model_path, self.policy_version, engines)
            self.placement.measure_probe_noise(self.probe)
        # a new run scores its base model on the held-out set before step 1
        first_eval = self.evaluate(0) if self.evaluator is not None and not resume else None
        self.producer = None
        if cfg.pipeline.mode != "sync":  # the engines stream from here on
            from rl.run.pipeline import RolloutProducer

            self.placement.start_streams(cfg.pipeline.interruptible)
            self.producer = RolloutProducer(cfg, self.prompts, self.engines, self.score)
        loggers = open_loggers(cfg.run.loggers, self.run_dir, asdict(cfg), cfg.run.wandb_project,
                               start)
        self.log = RunLog(self.run_dir, cfg.trainer.total_steps, loggers,
                          resume=(resume.step, resume.state["metrics"]) if resume else None)
        if first_eval is not None:
            self.log.log_step(first_eval)
        self.start_step = start
        self.recorder.record(self.placement, start - 1)

    def recover(self, error, step: int) -> int:
        """An actor died during `step`: one line naming it and the cause; with restarts left,
        restart the placement from the latest checkpoint and return the step to go on from;
        else raise ActorFailure with the command that resumes the run."""
        from rl.run.checkpoint import latest_checkpoint

        line = (f"{dead_actor(self.placement, error)} died during step {step}: "
                f"{death_cause(error)}")
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
        point = ckpt.find_resume_point(self.cfg, str(last))
        self.recorder.start(self.run_dir / "timeline.json", self.cfg.run.timeline_steps,
                            keep_until=point.step)
        self.start_workers(self.model_path, point)
        return point.step + 1

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
        state = ckpt.DriverState(self.policy_version, self.prompts.state(), self.model_path,
                                 self.model_sha256)
        return ckpt.save(self.run_dir, step, metrics, self.cfg, self.placement, state,
                         self.resume_command(self.run_dir))

    @traced("save")
    def finish(self) -> Path:
        final = self.run_dir / "final_model"
        wait_with_progress([w.save_hf.remote(str(final.resolve())) for w in self.trainers],
                           "saving the final model")
        self.tokenizer.save_pretrained(final)
        if self.cfg.trainer.lora is not None:  # final_model is the adapter; beside it, merged
            self.tokenizer.save_pretrained(final.with_name(final.name + "_merged"))
        self.log.plot()
        return final

    def shutdown(self) -> None:
        if self.log is not None:
            self.log.close()
        if self.scorer is not None:
            self.scorer.close()
            self.scorer = None
        if self.placement is not None:
            self.placement.release()
            self.placement = None
