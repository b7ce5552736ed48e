"""Supervised warm-up: turn a random model into a weak "base" model for the task, once, cached.

A random model scores ~0 on the task and GRPO then has no signal. A short SFT on the rows'
answers, run on the same DeepSpeed workers as RL, makes a model that answers some prompts. With
`answer_noise`, that fraction of targets is a near miss (answer +- 1..3), so the base model is
deliberately unsure: its sampled reward starts low but not at zero, and RL has room to climb.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
from dataclasses import asdict, replace
from pathlib import Path

from envs.registry import env_factory
from rl.algo.batch import Sample, collate, split_ranks
from rl.observe.progress import Progress, wait_with_progress
from rl.schema import Config


def warmup_dir(model_path: str, cfg: Config) -> Path:
    from rl.data.models import cache_root

    warmup = {k: v for k, v in asdict(cfg.warmup).items()  # keys as before multi-turn came
              if k != "target_turns" or v}
    ident = [str(Path(model_path).resolve()), warmup, asdict(cfg.data),
             cfg.run.seed, cfg.ray.num_workers, cfg.trainer.micro_batch_size]
    if cfg.env.name is not None:  # the env renders the prompts (and answers scripted turns)
        ident.append(asdict(cfg.env))
    key = hashlib.sha256(json.dumps(ident, default=str).encode()).hexdigest()[:12]
    return cache_root() / "warmup" / f"{Path(model_path).name}-{key}"


def sft_target(answer: str, noise: float, rng: random.Random,
               offsets: tuple[int, ...] = (-3, -2, -1, 1, 2, 3)) -> str:
    if noise > 0 and rng.random() < noise:
        try:
            return str(int(answer) + rng.choice(list(offsets)))
        except ValueError:  # not an integer answer: keep it
            return answer
    return answer


def scripted_trajectory(make_env, row: dict, turns: list[str], tokenizer) -> tuple[list, list]:
    """(token ids, loss mask) of a trajectory whose model turns are `turns` (each closed with
    the end-of-turn token): the environment, reset with `row`, answers each turn but the last,
    its observation rendered as in RL (envs.render); it ends early when the env says done."""
    import asyncio
    import inspect

    from envs.render import observation_ids

    env, eos = make_env(), tokenizer.eos_token_id
    env.reset(row)
    ids: list[int] = []
    mask: list[int] = []
    for k, text in enumerate(turns):
        turn = tokenizer.encode(text, add_special_tokens=False) + [eos]
        ids, mask = ids + turn, mask + [1] * len(turn)
        if k == len(turns) - 1:
            break
        step = env.step(text)
        step = asyncio.run(step) if inspect.isawaitable(step) else step
        if step.done:
            break
        observation = observation_ids(tokenizer, step.observation, env.tools or None, eos)
        ids, mask = ids + observation, mask + [0] * len(observation)
    return ids, mask


def warmup_samples(rows: list[int], prompts, tokenizer, w, rng: random.Random,
                   make_env, script=None) -> list[Sample]:
    """The SFT samples of prompt `rows`: each row's answer (a near miss with probability
    w.answer_noise, drawn from `rng`) in w.target_template, or, multi-turn, the scripted turns
    with the env's replies between them (script(row index, turns) -> (prompt ids, token ids,
    loss mask): an agent program answers them, rl.run.agent_turns)."""
    samples = []
    for i in rows:
        row = prompts.rows[i]
        if "answer" not in row:
            raise KeyError(f"warm-up needs an 'answer' field; row {i} has: {', '.join(row)}")
        answer = sft_target(str(row["answer"]), w.answer_noise, rng, w.noise_offsets)
        fields = {**row, "answer": answer}
        if w.target_turns:  # multi-turn: the env answers the scripted turns
            turns = [t.format(**fields) for t in w.target_turns]
            if script is not None:
                prompt, response, mask = script(i, turns)
            else:
                prompt = prompts.prompt_ids[i]
                response, mask = scripted_trajectory(make_env, prompts.env_rows[i], turns,
                                                     tokenizer)
            samples.append(Sample(i, 0, prompt, response, [], "stop", turns[-1],
                                  loss_mask=mask))
            continue
        target = w.target_template.format(**fields)
        response = tokenizer.encode(target, add_special_tokens=False) + [tokenizer.eos_token_id]
        samples.append(Sample(i, 0, prompts.prompt_ids[i], response, [], "stop", target))
    return samples


def run_warmup(workers, model_path: str, prompts, tokenizer, cfg: Config, script=None) -> str:
    """SFT on the workers' trainers; saves and returns the base model directory (cached).
    script: as warmup_samples takes it (an agent program's scripted trajectories)."""
    import ray

    from rl.data.models import publish

    out = warmup_dir(model_path, cfg)
    if (out / "config.json").exists():
        print(f"warm-up: reusing the cached base model {out}", flush=True)
        return str(out)
    w = cfg.warmup
    world = len(workers)
    per_rank = max(1, w.batch_size // world)
    grad_accum = -(-per_rank // cfg.trainer.micro_batch_size)
    # the warm-up makes the base model, in full, with ZeRO-3 (if used) module by module: the
    # base models of the published seeds (whole gathers differ in the last bits, and a warm-up
    # ends in another model; the cache key leaves the trainer's ZeRO settings out)
    trainer_cfg = replace(cfg.trainer, lr=w.lr, lora=None, zero3_whole_model_max=0,
                          zero3_release_params=False)
    loss_cfg = replace(cfg.algorithm.loss, kl_coef=0.0)
    ray.get([wk.init_trainer.remote(model_path, trainer_cfg, loss_cfg, grad_accum, 1.0)
             for wk in workers])
    rng = random.Random(cfg.run.seed)
    order = prompts.with_order(cfg.run.seed + 1)
    make_env = env_factory(cfg.env) if w.target_turns else None
    print(f"warm-up: {w.sft_steps} SFT steps of {per_rank * world} samples "
          f"(answer_noise={w.answer_noise})", flush=True)
    progress = Progress(w.sft_steps, "warm-up", every=50)
    for step in range(1, w.sft_steps + 1):
        samples = warmup_samples(order.next_batch(per_rank * world), prompts, tokenizer, w,
                                 rng, make_env, script)
        num_tokens = float(sum(s.num_model_tokens for s in samples))
        futures = [wk.sft.remote([collate(m, tokenizer.pad_token_id) for m in micros], num_tokens)
                   for wk, micros in zip(workers, split_ranks(samples, world, grad_accum))]
        loss = sum(m["loss/sft"] for m in ray.get(futures))
        progress.update(step, f"warm-up step {step}/{w.sft_steps} | loss {loss:.4f}",
                        {"loss": f"{loss:.4f}"})
    progress.close()
    # a name of this run's own: two runs that share the cache may warm up the same model at once
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    wait_with_progress([wk.save_hf.remote(str(tmp)) for wk in workers],
                       "warm-up: saving the base model")
    tokenizer.save_pretrained(tmp)
    publish(tmp, out, "config.json")
    print(f"warm-up: saved the base model to {out}", flush=True)
    return str(out)
