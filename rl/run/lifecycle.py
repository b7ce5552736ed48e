"""A run's life around its steps: setting up (data, Ray, the placement, the warm-up, trainers and
engines, or a checkpoint's state), restarting from the latest checkpoint after an actor died,
saving checkpoints and the final model, shutting down. rl.run.controller.Controller holds one
and reads what it set up; the lifecycle is told the policy version and returns what it makes."""
from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

from rl.config import ConfigError, grad_accum_steps, to_yaml
from rl.errors import ActorFailure, death_cause, prompt_error, stop_on_sigterm
from rl.observe.metrics import RunLog
from rl.observe.progress import wait_with_progress
from rl.observe.timeline import Spans, traced
from rl.run import checkpoint as ckpt
from rl.run.cluster import start_ray
from rl.run.placement import start_placement
from rl.run.rewarding import RewardScorer, checked_rows
from rl.run.tracks import TimelineRecorder, dead_actor
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
    """Set-up, recovery, checkpoints and shutdown of one run, and what they made: the tokenizer,
    the training and held-out prompts, the run directory, the placement, the scorer, the
    evaluator, the log."""

    def __init__(self, cfg: Config, rows=None, resume=None,
                 resume_command=lambda run_dir: f"rl-train RECIPE --resume {run_dir}",
                 placements=None, spans=None):
        """As rl.run.controller.Controller's arguments; spans: the driver's timeline track."""
        self.cfg, self.rows, self.resume = cfg, rows, resume
        self.resume_command, self.placements = resume_command, placements
        self.spans = spans if spans is not None else Spans()
        self.recorder = TimelineRecorder(self.spans)
        self.restarts = 0
        self.placement = self.scorer = self.log = self.evaluator = None
        self.plan_metrics: dict = {}

    # ------------------------------------------------------------------ set-up
    def setup(self) -> int:
        """Everything up to the first step; returns the policy version the engines hold (0, or
        a checkpoint's)."""
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
        return self.start_workers(model_path, resume)

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

    def start_workers(self, model_path: str, resume) -> int:
        """The placement, the warm-up (a new run), the trainers, the engines at the policy
        version (a new run's base model, or the checkpoint's policy); returns that version."""
        import ray

        from rl.data.warmup import run_warmup

        cfg, span = self.cfg, self.spans.span
        with span("start placement"):
            self.placement = (self.placements.start(cfg) if self.placements is not None
                              else start_placement(cfg))
        trainers = self.placement.trainers
        if cfg.warmup.sft_steps > 0 and not resume:
            from rl.run.agent_turns import warmup_script

            with span("warm-up"), warmup_script(cfg, self.tokenizer, self.prompts) as script:
                model_path = run_warmup(trainers, model_path, self.prompts, self.tokenizer,
                                        cfg, script)
        self.model_path = model_path
        # the base model's content hash goes into checkpoints: a resume refuses a changed one
        self.model_sha256 = (resume.driver.model_sha256 if resume else
                             ckpt.model_digest(model_path) if cfg.trainer.checkpoint_every else None)
        # a resumed run's engines hold the base model until the checkpoint's policy is synced
        version = resume.driver.policy_version if resume else 0
        with span("init trainer"):
            inits = [w.init_trainer.remote(model_path, cfg.trainer, cfg.algorithm.loss,
                                           self.grad_accum, cfg.rollout.temperature,
                                           float(cfg.rollout.max_new_tokens), cfg.algorithm.critic,
                                           cfg.run.seed)
                     for w in trainers]
            # engines apart from the trainers build meanwhile (colocated: after, same actors)
            engines = self.placement.start_rollout(model_path, int(version))
            ray.get(inits)
        self.start_step = resume.step + 1 if resume else 1
        if resume:
            with span("load checkpoint"):
                # trainers, engines (synced), data, RNG
                return ckpt.restore(resume, self.placement, model_path, self.probe,
                                    self.prompts, engines)
        with span("init engines"):
            self.placement.init_rollout(model_path, version, engines)
        self.placement.measure_probe_noise(self.probe)
        return version

    def open_log(self, first_eval: dict | None) -> None:
        """The run's metrics log and loggers, from the first step on (a resumed run's keeps
        its earlier lines); first_eval: the base model's held-out scores, logged first."""
        from rl.observe.loggers import open_loggers

        cfg, start = self.cfg, self.start_step
        loggers = open_loggers(cfg.run.loggers, self.run_dir, asdict(cfg), cfg.run.wandb_project,
                               start)
        resume = self.resume
        self.log = RunLog(self.run_dir, cfg.trainer.total_steps, loggers,
                          resume=(resume.step, resume.state["metrics"]) if resume else None)
        if first_eval is not None:
            self.log.log_step(first_eval)
        self.recorder.record(self.placement, start - 1)

    def recover(self, error, step: int) -> int:
        """An actor died during `step`: one line naming it and the cause; with restarts left,
        restart the placement from the latest checkpoint (`start_workers`: `resume` and
        `start_step` are then the checkpoint's) and return the policy version it holds; else
        raise ActorFailure with the command that resumes the run."""
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
        self.resume = ckpt.find_resume_point(self.cfg, str(last))
        self.recorder.start(self.run_dir / "timeline.json", self.cfg.run.timeline_steps,
                            keep_until=self.resume.step)
        return self.start_workers(self.model_path, self.resume)

    # ------------------------------------------------------------------ outputs
    def checkpoint(self, step: int, metrics: dict, version: int, unconsumed: int | None) -> dict:
        """Save checkpoint `step` of policy `version` when it is due (its size and save time
        are metrics); unconsumed: the async producer's groups not trained yet (None: sync)."""
        every = self.cfg.trainer.checkpoint_every
        if every and step % every == 0:
            if unconsumed is not None:
                print(f"checkpoint step_{step}: {unconsumed} groups handed out or "
                      f"buffered and not trained are not in it; a resume drops them and "
                      f"generates from the prompts after them", flush=True)
            return self.save_checkpoint(step, metrics, version)
        return {}

    @traced("checkpoint")
    def save_checkpoint(self, step: int, metrics: dict, version: int) -> dict:
        state = ckpt.DriverState(version, self.prompts.state(), self.model_path,
                                 self.model_sha256)
        return ckpt.save(self.run_dir, step, metrics, self.cfg, self.placement, state,
                         self.resume_command(self.run_dir))

    @traced("save")
    def finish(self) -> Path:
        final = self.run_dir / "final_model"
        wait_with_progress([w.save_hf.remote(str(final.resolve()))
                            for w in self.placement.trainers],
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
