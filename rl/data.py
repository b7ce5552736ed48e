"""Prompts for rollout: rows read with `datasets`, rendered with the tokenizer's chat template."""
from __future__ import annotations

import copy
import hashlib
import json
import random
from pathlib import Path

from rl import tasks
from rl.config import DataConfig
from rollout.config import RolloutConfig


BUILTIN_DATA = {"arithmetic": (tasks.arithmetic_rows, tasks.TEMPLATE),
                "fractions": (tasks.fraction_rows, tasks.FRACTION_TEMPLATE),
                "extraction": (tasks.extraction_rows, tasks.EXTRACTION_TEMPLATE)}


def resolve_rows(cfg: DataConfig, seed: int) -> list[dict]:
    """Rows from data.train_path; a builtin: data set is generated and cached as jsonl first."""
    if cfg.train_path.startswith("builtin:"):
        from rl.models import cache_root

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
            tmp = tasks.write_rows(make(cfg.num_rows, cfg.max_operand, seed),
                                   path.with_suffix(".tmp.jsonl"))
            tmp.rename(path)
        return tasks.read_rows(path)
    return tasks.read_rows(Path(cfg.train_path))


def render_prompt(tokenizer, row: dict, cfg: DataConfig, index: int) -> list[int]:
    """Token ids of the row's prompt in chat form, ending with the assistant's turn opener."""
    if cfg.prompt_key not in row:
        raise KeyError(f"row {index} has no field '{cfg.prompt_key}' (data.prompt_key); "
                       f"its fields: {', '.join(row)}")
    prompt = row[cfg.prompt_key]
    if isinstance(prompt, str):
        messages = [{"role": "user", "content": prompt}]
        if cfg.system_prompt:
            messages.insert(0, {"role": "system", "content": cfg.system_prompt})
    elif isinstance(prompt, list) and all(isinstance(m, dict) for m in prompt):
        messages = prompt
    else:
        raise TypeError(f"row {index}: field '{cfg.prompt_key}' must be a string or a list of "
                        f"{{role, content}} messages, got {type(prompt).__name__}")
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
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
                 rollout: RolloutConfig | None = None):
        rollout = rollout or RolloutConfig()
        if not rows:
            raise ValueError(f"data.train_path '{cfg.train_path}' has no rows")
        limit = rollout.max_model_len - rollout.max_new_tokens
        rendered = [(r, render_prompt(tokenizer, r, cfg, i)) for i, r in enumerate(rows)]
        kept = [(r, p) for r, p in rendered if len(p) <= limit]
        self.num_filtered = len(rendered) - len(kept)
        if self.num_filtered:
            print(f"data: skipped {self.num_filtered} of {len(rows)} prompts longer than "
                  f"{limit} tokens (rollout.max_model_len - rollout.max_new_tokens)", flush=True)
        if not kept:
            raise ValueError(f"every prompt in '{cfg.train_path}' is longer than {limit} tokens; "
                             f"raise rollout.max_model_len or lower rollout.max_new_tokens")
        self.rows = [r for r, _ in kept]
        self.prompt_ids = [p for _, p in kept]
        self.constraints = [output_constraint(r, rollout, i) for i, r in enumerate(self.rows)]
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

    def next_batch(self, size: int) -> list[int]:
        """Row indices of the next `size` prompts (a new shuffled epoch when one runs out)."""
        out = []
        while len(out) < size:
            if not self._order:
                self._order = list(range(len(self.rows)))
                self._rng.shuffle(self._order)
            out.append(self._order.pop())
        return out
