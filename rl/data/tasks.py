"""The quickstart task: small integer arithmetic with an exact answer, generated locally.

Rows are {"prompt": str, "answer": str}; the prompt is the user message, rendered later with the
tokenizer's chat template. Files are written with `datasets` (jsonl or parquet by extension).
"""
from __future__ import annotations

import json
import random
from pathlib import Path

TEMPLATE = "What is {a} {op} {b}? Reply with the number only."


def arithmetic_rows(num_rows: int, max_operand: int, seed: int, ops: str = "+-") -> list[dict]:
    """Distinct-as-possible a op b problems with 0 <= a, b <= max_operand (answers may be < 0)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(num_rows):
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        op = rng.choice(ops)
        answer = a + b if op == "+" else a - b
        rows.append({"prompt": TEMPLATE.format(a=a, op=op, b=b), "answer": str(answer)})
    return rows


MULTIPLY_TEMPLATE = "What is {a} * {b}?"


def multiplication_rows(num_rows: int, max_operand: int, seed: int) -> list[dict]:
    """a * b with 10 <= a, b <= max_operand (2-3 digits at max_operand 999): too hard for a tiny
    model to compute, easy with a calculator. Rows keep a and b (a warm-up's tool call uses
    them)."""
    rng = random.Random(seed)
    low = min(10, max_operand)
    rows = []
    for _ in range(num_rows):
        a, b = rng.randint(low, max_operand), rng.randint(low, max_operand)
        rows.append({"prompt": MULTIPLY_TEMPLATE.format(a=a, b=b), "answer": str(a * b),
                     "a": a, "b": b})
    return rows


def tool_call(expression: str) -> str:
    """A Hermes-format call of the calculator tool (envs.tool_calls reads this format)."""
    return ('<tool_call>\n{"name": "calculator", "arguments": {"expression": "'
            + expression + '"}}\n</tool_call>')


def tool_corpus() -> list[str]:
    """corpus() and the text of calculator calls on multiplication problems, so that a
    tokenizer trained on it has tokens for a call's fixed parts (tiny-qwen2-tools)."""
    rng = random.Random(0)
    pairs = [(rng.randint(10, 999), rng.randint(10, 999)) for _ in range(300)]
    lines = corpus()
    lines += [MULTIPLY_TEMPLATE.format(a=a, b=b) for a, b in pairs]
    lines += [tool_call(f"{a} * {b}") for a, b in pairs]
    lines += [str(a * b) for a, b in pairs]
    lines += ["tool\n", "error: "] * 50
    return lines


FRACTION_TEMPLATE = ("What is {a}/{b} {op} {c}/{d}? Think inside <think></think>, then give "
                     "the answer as a fraction inside <answer></answer>.")


def fraction_rows(num_rows: int, max_operand: int, seed: int) -> list[dict]:
    """a/b +- c/d problems; the answer is the exact result as a reduced fraction string."""
    from fractions import Fraction

    rng = random.Random(seed)
    rows = []
    for _ in range(num_rows):
        a, c = rng.randint(1, max_operand), rng.randint(1, max_operand)
        b, d = rng.randint(1, max_operand), rng.randint(1, max_operand)
        op = rng.choice("+-")
        value = Fraction(a, b) + Fraction(c, d) if op == "+" else Fraction(a, b) - Fraction(c, d)
        rows.append({"prompt": FRACTION_TEMPLATE.format(a=a, b=b, c=c, d=d, op=op),
                     "answer": str(value)})
    return rows


EXTRACTION_TEMPLATE = "Reply in JSON with the number of {item} in: {text}"
EXTRACTION_SCHEMA = json.dumps({"type": "object", "properties": {"count": {"type": "integer"}},
                                "required": ["count"], "additionalProperties": False})


def extraction_rows(num_rows: int, max_operand: int, seed: int) -> list[dict]:
    """Count extraction: the completion must be JSON {"count": N}; each row carries the schema
    (as a JSON string) that constrains its generation, and the answer."""
    rng = random.Random(seed)
    items = ["apples", "cats", "books", "coins"]
    rows = []
    for _ in range(num_rows):
        item, count = rng.choice(items), rng.randint(0, max_operand)
        text = rng.choice(["I saw {n} {item} today.", "There are {n} {item} here.",
                           "We counted {n} {item}."]).format(n=count, item=item)
        rows.append({"prompt": EXTRACTION_TEMPLATE.format(item=item, text=text),
                     "answer": str(count), "json_schema": EXTRACTION_SCHEMA})
    return rows


REASONING_GYM_INSTALL = "pip install -e '.[tasks]' (reasoning-gym==0.1.25)"


def reasoning_gym_rows(task: str, size: int, seed: int, config: dict,
                       instruction: str = "") -> list[dict]:
    """`size` problems of a reasoning-gym task (procedural, with its own verifier): rows
    {"prompt": question [+ instruction], "answer", "reasoning_gym": {task, entry}}; the entry
    (question, answer, metadata) is what the task's score_answer needs."""
    try:
        import reasoning_gym
    except ImportError:
        raise ValueError(f"data.train_path 'reasoning_gym:{task}' needs the reasoning-gym "
                         f"package: {REASONING_GYM_INSTALL}") from None
    try:
        dataset = reasoning_gym.create_dataset(task, size=size, seed=seed, **config)
    except Exception as e:  # an unknown task or setting: its own message, one line
        raise ValueError(f"data.train_path 'reasoning_gym:{task}' with data.task_config="
                         f"{config}: {str(e).splitlines()[0]}; check the task name and its "
                         f"settings") from None
    rows = []
    for entry in dataset:
        entry = json.loads(json.dumps(entry, default=str))  # what jsonl keeps
        question = entry["question"] + (f" {instruction}" if instruction else "")
        rows.append({"prompt": question, "answer": str(entry["answer"]),
                     "reasoning_gym": {"task": task, "entry": entry}})
    return rows


def corpus() -> list[str]:
    """Text that a tokenizer for this task must cover (the template and every number it uses)."""
    lines = [TEMPLATE.format(a=a, op=op, b=b) for a in range(0, 100, 7) for b in range(0, 100, 3)
             for op in "+-"]
    lines += [str(n) for n in range(-200, 201)] * 3
    lines += ["The answer is 12.", "Sure! It is 7.", "I do not know."]
    lines += ["user\n", "assistant\n", "system\n"] * 50  # chat-template roles: one token each
    lines += [FRACTION_TEMPLATE.format(a=a, b=b, c=3, d=4, op="+") for a in range(1, 10)
              for b in range(1, 10)]
    lines += ["<think>I add the fractions.</think> <answer>5/4</answer>"] * 20
    return lines


def write_rows(rows: list[dict], path: str | Path) -> Path:
    """Write rows as JSON lines (.jsonl/.json) or parquet (through `datasets`)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".parquet":
        import datasets

        datasets.Dataset.from_list(rows).to_parquet(str(path))
    elif path.suffix in (".jsonl", ".json"):
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    else:
        raise ValueError(f"data file '{path}': use a .jsonl, .json or .parquet suffix")
    return path


def read_rows(path: str | Path) -> list[dict]:
    """Rows of a jsonl file (or .json: JSON lines or one array of objects), or of a parquet
    file (through `datasets`). A bad line, a row that is not an object, or no rows at all is a
    ValueError that names the file and the line."""
    path = Path(path)
    if path.suffix not in (".parquet", ".jsonl", ".json"):
        raise ValueError(f"data file '{path}': use a .jsonl, .json or .parquet suffix")
    if not path.exists():
        raise FileNotFoundError(f"data file '{path}' does not exist; check data.train_path")
    if path.suffix == ".parquet":
        import datasets

        rows = datasets.load_dataset("parquet", data_files=str(path), split="train").to_list()
    else:
        rows = _json_rows(path)
    if not rows:
        raise ValueError(f"data file '{path}' has no rows; give one JSON object per line")
    return rows


def _json_rows(path: Path) -> list[dict]:
    text = path.read_text()
    if path.suffix == ".json" and text.lstrip().startswith("["):
        try:
            items = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"data file '{path}' is not valid JSON at line {e.lineno} "
                             f"({e.msg}); fix it") from None
        numbered = list(enumerate(items, 1))
        where = "item"
    else:
        numbered = []
        for number, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                numbered.append((number, json.loads(line)))
            except json.JSONDecodeError as e:
                raise ValueError(f"data file '{path}' line {number} is not valid JSON ({e.msg} "
                                 f"at column {e.colno}); fix or remove the line") from None
        where = "line"
    for number, row in numbered:
        if not isinstance(row, dict):
            raise ValueError(f"data file '{path}' {where} {number} is a {type(row).__name__}, not "
                             f"an object; each row is one JSON object with the prompt's field")
    return [row for _, row in numbered]
