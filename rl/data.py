"""Prompts for rollout: rows read with `datasets`, rendered with the tokenizer's chat template."""
from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

from rl import tasks
from rl.config import DataConfig


def resolve_rows(cfg: DataConfig, seed: int) -> list[dict]:
    """Rows from data.train_path; builtin:arithmetic is generated and cached as jsonl first."""
    if cfg.train_path == "builtin:arithmetic":
        from rl.models import cache_root

        key = hashlib.sha256(json.dumps([cfg.num_rows, cfg.max_operand, seed, tasks.TEMPLATE])
                             .encode()).hexdigest()[:12]
        path = cache_root() / "data" / f"arithmetic-{key}.jsonl"
        if not path.exists():
            tmp = tasks.write_rows(tasks.arithmetic_rows(cfg.num_rows, cfg.max_operand, seed),
                                   path.with_suffix(".tmp.jsonl"))
            tmp.rename(path)
        return tasks.read_rows(path)
    if cfg.train_path.startswith("builtin:"):
        raise ValueError(f"data.train_path '{cfg.train_path}': the only built-in data set is "
                         f"builtin:arithmetic; otherwise give a .jsonl/.json/.parquet file")
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


class PromptSet:
    """Rendered prompts, served in shuffled epochs of fixed-size batches."""

    def __init__(self, rows: list[dict], tokenizer, cfg: DataConfig, seed: int):
        if not rows:
            raise ValueError(f"data.train_path '{cfg.train_path}' has no rows")
        self.rows = rows
        self.prompt_ids = [render_prompt(tokenizer, r, cfg, i) for i, r in enumerate(rows)]
        self.texts = [tokenizer.decode(p) for p in self.prompt_ids]
        self._rng = random.Random(seed)
        self._order: list[int] = []

    def next_batch(self, size: int) -> list[int]:
        """Row indices of the next `size` prompts (a new shuffled epoch when one runs out)."""
        out = []
        while len(out) < size:
            if not self._order:
                self._order = list(range(len(self.rows)))
                self._rng.shuffle(self._order)
            out.append(self._order.pop())
        return out
