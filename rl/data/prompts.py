"""Prompts for rollout: rows read with `datasets`, rendered with the tokenizer's chat template."""
from __future__ import annotations

import copy
import hashlib
import json
import os
import random
from dataclasses import dataclass, field
from pathlib import Path

from rl.data import tasks
from rl.schema import DataConfig
from rollout.config import RolloutConfig

BUILTIN_DATA = {"arithmetic": (tasks.arithmetic_rows, tasks.TEMPLATE),
                "fractions": (tasks.fraction_rows, tasks.FRACTION_TEMPLATE),
                "extraction": (tasks.extraction_rows, tasks.EXTRACTION_TEMPLATE),
                "multiplication": (tasks.multiplication_rows, tasks.MULTIPLY_TEMPLATE)}


def resolve_rows(cfg: DataConfig, seed: int) -> list[dict]:
    """Rows from data.train_path; a builtin: or reasoning_gym: data set is generated and cached
    as jsonl first."""
    if cfg.train_path.startswith("reasoning_gym:"):
        from rl.data.models import cache_root

        name = cfg.train_path.removeprefix("reasoning_gym:")
        key = hashlib.sha256(json.dumps([name, cfg.num_rows, seed, cfg.task_config,
                                         cfg.answer_instruction], sort_keys=True, default=str)
                             .encode()).hexdigest()[:12]
        path = cache_root() / "data" / f"reasoning_gym-{name}-{key}.jsonl"
        if not path.exists():
            cache_rows(tasks.reasoning_gym_rows(name, cfg.num_rows, seed, cfg.task_config,
                                                cfg.answer_instruction), path)
        return tasks.read_rows(path)
    if cfg.train_path.startswith("builtin:"):
        from rl.data.models import cache_root

        name = cfg.train_path.removeprefix("builtin:")
        if name not in BUILTIN_DATA:
            raise ValueError(f"data.train_path '{cfg.train_path}': built-in data sets are "
                             + ", ".join(f"builtin:{n}" for n in BUILTIN_DATA)
                             + "; otherwise give a .jsonl/.json/.parquet file")
        make, template = BUILTIN_DATA[name]
        key = hashlib.sha256(json.dumps([cfg.num_rows, cfg.max_operand, seed, template])
                             .encode()).hexdigest()[:12]
        path = cache_root() / "data" / f"{name}-{key}.jsonl"
        if not path.exists():
            cache_rows(make(cfg.num_rows, cfg.max_operand, seed), path)
        return tasks.read_rows(path)
    return tasks.read_rows(Path(cfg.train_path))


def cache_rows(rows: list[dict], path: Path) -> None:
    """Publish generated rows at `path` whole: written under a name of this process's own, then
    renamed (two runs that share the cache may write the same rows at once)."""
    os.replace(tasks.write_rows(rows, path.with_suffix(f".tmp{os.getpid()}.jsonl")), path)


@dataclass
class Rows:
    """The data set: rows RL and the warm-up see, and held-out rows they never see."""
    train: list[dict]
    held_out: list[dict] = field(default_factory=list)
    dropped: int = 0  # training rows dropped because their prompt text is held out


def prompt_text(row: dict, key: str) -> str:
    """A row's prompt as one string (chat messages as JSON): what the held-out split compares."""
    prompt = row.get(key)
    return prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True)


def split_rows(rows: list[dict], cfg: DataConfig, held_out: list[dict] | None = None) -> Rows:
    """Hold out by distinct prompt text, never by row: a text is either held out (with every
    row that has it) or trained on. With `held_out` rows (data.eval_path), training rows whose
    text they have are dropped; with data.eval_fraction, that fraction of the distinct texts is
    held out, picked by a hash of the text (the same set whatever the seed or row order)."""
    key = cfg.prompt_key
    if held_out is None and not cfg.eval_fraction:
        return Rows(rows)
    row_texts = [prompt_text(r, key) for r in rows]
    if held_out is None:
        texts = sorted(set(row_texts), key=lambda t: hashlib.sha256(t.encode()).digest())
        count = round(cfg.eval_fraction * len(texts))
        if count < 1 or count == len(texts):
            raise ValueError(f"data.eval_fraction={cfg.eval_fraction} of {len(texts)} distinct "
                             f"prompts in '{cfg.train_path}' holds out {count}; pick a fraction "
                             f"that leaves prompts on both sides")
        chosen = set(texts[:count])
        held_out = [r for r, t in zip(rows, row_texts) if t in chosen]
    else:
        chosen = {prompt_text(r, key) for r in held_out}
    # each held-out prompt is evaluated once, however many rows repeat it
    unique: dict[str, dict] = {}
    for r in held_out:
        unique.setdefault(prompt_text(r, key), r)
    held_out = list(unique.values())
    train = [r for r, t in zip(rows, row_texts) if t not in chosen]
    if not train:
        raise ValueError(f"every prompt of '{cfg.train_path}' is in the held-out set "
                         f"'{cfg.eval_path}'; give a held-out file with other prompts")
    return Rows(train, held_out, len(rows) - len(train) if cfg.eval_path else 0)


def prompt_messages(row: dict, cfg: DataConfig, index: int) -> list[dict]:
    """The row's prompt as chat messages (a string prompt becomes the user message, after
    data.system_prompt)."""
    if cfg.prompt_key not in row:
        raise KeyError(f"row {index} has no field '{cfg.prompt_key}' (data.prompt_key); "
                       f"its fields: {', '.join(row)}")
    prompt = row[cfg.prompt_key]
    if isinstance(prompt, str):
        messages = [{"role": "user", "content": prompt}]
        if cfg.system_prompt:
            messages.insert(0, {"role": "system", "content": cfg.system_prompt})
        return messages
    if isinstance(prompt, list) and all(isinstance(m, dict) for m in prompt):
        return prompt
    raise TypeError(f"row {index}: field '{cfg.prompt_key}' must be a string or a list of "
                    f"{{role, content}} messages, got {type(prompt).__name__}")


def env_row(row: dict, cfg: DataConfig, index: int) -> dict:
    """What a multi-turn environment's reset gets: the row, its "prompt" the chat messages."""
    return {**row, "prompt": prompt_messages(row, cfg, index)}


def render_prompt(tokenizer, row: dict, cfg: DataConfig, index: int, env=None) -> list[int]:
    """Token ids of the row's prompt in chat form, ending with the assistant's turn opener.
    With `env` (multi-turn: an envs.api.Env), the messages are what env.reset makes of the
    row's env_row, and its tools go to the template (`tools=`)."""
    messages, tools = prompt_messages(row, cfg, index), None
    if env is not None:
        messages = env.reset(env_row(row, cfg, index))
        tools = env.tools or None
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                        **({"tools": tools} if tools else {}))
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


def output_constraint(row: dict, cfg: RolloutConfig, index: int) -> dict | None:
    """The row's structured-output constraint for vLLM, if it carries one."""
    found = {}
    if row.get(cfg.json_schema_key) is not None:
        schema = row[cfg.json_schema_key]
        found["json"] = json.loads(schema) if isinstance(schema, str) else schema
    if row.get(cfg.regex_key) is not None:
        found["regex"] = str(row[cfg.regex_key])
    if row.get(cfg.choices_key) is not None:
        found["choice"] = [str(c) for c in row[cfg.choices_key]]
    if len(found) > 1:
        raise ValueError(f"row {index} has {' and '.join(found)} constraints; give at most one")
    return found or None


class PromptSet:
    """Rendered prompts (those that fit the engine), served in shuffled epochs."""

    def __init__(self, rows: list[dict], tokenizer, cfg: DataConfig, seed: int,
                 rollout: RolloutConfig | None = None, make_env=None):
        """make_env: multi-turn, a callable making the run's environment (render_prompt)."""
        rollout = rollout or RolloutConfig()
        if not rows:
            raise ValueError(f"data.train_path '{cfg.train_path}' has no rows")
        limit = rollout.max_model_len - rollout.max_new_tokens
        rendered = [(r, render_prompt(tokenizer, r, cfg, i, make_env and make_env()))
                    for i, r in enumerate(rows)]
        kept = [(r, p) for r, p in rendered if len(p) <= limit]
        self.num_filtered = len(rendered) - len(kept)
        if self.num_filtered:
            print(f"data: skipped {self.num_filtered} of {len(rows)} prompts longer than "
                  f"{limit} tokens (rollout.max_model_len - rollout.max_new_tokens)", flush=True)
        if not kept:
            shortest = min(len(p) for _, p in rendered)
            room = rollout.max_model_len - shortest  # what a response may take beside it
            lower = f" or lower rollout.max_new_tokens to {room}" if room >= 1 else ""
            raise ValueError(
                f"every prompt in '{cfg.train_path}' is longer than rollout.max_model_len="
                f"{rollout.max_model_len} leaves beside rollout.max_new_tokens="
                f"{rollout.max_new_tokens} (the shortest has {shortest} tokens): raise "
                f"rollout.max_model_len to {shortest + rollout.max_new_tokens}{lower}")
        self.rows = [r for r, _ in kept]
        self.prompt_ids = [p for _, p in kept]
        self.constraints = [output_constraint(r, rollout, i) for i, r in enumerate(self.rows)]
        # multi-turn: what each trajectory's environment is reset with, on the engines' side
        self.env_rows = ([env_row(r, cfg, i) for i, r in enumerate(self.rows)] if make_env
                         else None)
        self.texts = [tokenizer.decode(p) for p in self.prompt_ids]
        self._rng = random.Random(seed)
        self._order: list[int] = []

    def with_order(self, seed: int) -> "PromptSet":
        """The same prompts with an order of their own: a consumer (the warm-up) that must not
        shift what RL sees, whether or not that consumer ran (its result may be cached)."""
        other = copy.copy(self)
        other._rng, other._order = random.Random(seed), []
        return other

    def state(self) -> dict:
        """Where the prompt order stands (for a checkpoint): the shuffler and this epoch's rest."""
        version, internal, gauss = self._rng.getstate()
        return {"rng": [version, list(internal), gauss], "order": list(self._order)}

    def load_state(self, state: dict) -> None:
        version, internal, gauss = state["rng"]
        self._rng.setstate((version, tuple(internal), gauss))
        self._order = list(state["order"])

    def request(self, rows: list[int], seeds: list[int]) -> dict:
        """What a rollout engine is given to generate for prompt `rows` (one seed each): the
        prompts' tokens, their seeds and output constraints and, multi-turn, what each
        trajectory's environment is reset with (the keyword arguments of RolloutWorker's
        `generate` and `submit`)."""
        return {"prompts": [self.prompt_ids[r] for r in rows], "seeds": list(seeds),
                "constraints": [self.constraints[r] for r in rows],
                "rows": self.env_rows and [self.env_rows[r] for r in rows]}

    def next_batch(self, size: int) -> list[int]:
        """Row indices of the next `size` prompts (a new shuffled epoch when one runs out)."""
        out = []
        while len(out) < size:
            if not self._order:
                self._order = list(range(len(self.rows)))
                self._rng.shuffle(self._order)
            out.append(self._order.pop())
        return out
