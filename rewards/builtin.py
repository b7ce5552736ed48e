"""Built-in rewards: exact_answer, math, json_field, format, length, code_exec, reasoning_gym."""
from __future__ import annotations

import re
import sys

from rewards.api import StartCheckError, register, start_check

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def last_number(text: str) -> float | None:
    """The last integer/decimal in text (commas between digit groups ignored), or None."""
    found = _NUMBER.findall(text.replace(",", ""))
    return float(found[-1]) if found else None


@register("exact_answer")
def exact_answer(prompt: str, completion: str, answer: str, **row) -> float:
    """1.0 when the completion's last number equals the reference `answer`, else 0.0."""
    got, want = last_number(completion), last_number(str(answer))
    return 1.0 if got is not None and want is not None and abs(got - want) < 1e-9 else 0.0


@register("math")
def math_answer(prompt: str, completion: str, answer: str, **row) -> float:
    """1.0 when the completion's final answer equals `answer` numerically or symbolically.

    The final answer is the last `<answer>...</answer>`, then within it (or the whole text) the
    last `\\boxed{}`, a `#### 42` line, or else the last number/expression; equivalence
    (fractions, decimals, LaTeX, 1,000 = 1000, 50% = 0.5) is decided by HuggingFace's
    `math-verify`.
    """
    from math_verify import parse, verify

    tagged = re.findall(r"<answer>(.*?)</answer>", completion, flags=re.DOTALL)
    text = tagged[-1] if tagged else completion
    marker = re.search(r"####\s*(.+?)\s*$", text, flags=re.MULTILINE)
    if "\\boxed" not in text and marker:
        text = marker.group(1)
    gold = parse(str(answer))
    guess = parse(text)
    if not gold or not guess:
        return 0.0
    return 1.0 if verify(gold, guess) else 0.0


DEFAULT_FORMAT = r"^\s*<think>.*?</think>\s*<answer>.*?</answer>\s*$"


@register("json_field")
def json_field(prompt: str, completion: str, answer: str, field: str = "answer", **row) -> float:
    """1.0 when the completion is a JSON object whose `field` equals `answer` (as text or
    number), else 0.0 (also for invalid JSON)."""
    import json

    try:
        value = json.loads(completion)
    except ValueError:
        return 0.0
    if not isinstance(value, dict) or field not in value:
        return 0.0
    got = value[field]
    if isinstance(got, (int, float)) and not isinstance(got, bool):
        want = last_number(str(answer))
        return 1.0 if want is not None and abs(float(got) - want) < 1e-9 else 0.0
    return 1.0 if str(got).strip() == str(answer).strip() else 0.0


@register("format")
def format_reward(prompt: str, completion: str, pattern: str = DEFAULT_FORMAT,
                  tags: list | None = None, **row) -> float:
    """1.0 when the completion matches `pattern` (whole text, DOTALL) and holds every tag in
    `tags` as an open/close pair, else 0.0."""
    if not re.match(pattern, completion, flags=re.DOTALL):
        return 0.0
    for tag in tags or []:
        if f"<{tag}>" not in completion or f"</{tag}>" not in completion:
            return 0.0
    return 1.0


@register("length")
def length_reward(prompt: str, completion: str, budget: int = 512, buffer: int = 128,
                  penalty: float = 1.0, **row) -> float:
    """0 within `budget - buffer` characters, falling linearly to -penalty at `budget` and
    beyond (an overlong penalty on the text's length in characters)."""
    start = budget - buffer
    if len(completion) <= start:
        return 0.0
    return -penalty * min(len(completion) - start, buffer) / max(buffer, 1)


CODE_EXEC_ARGS = ("timeout_s", "memory_mb", "cpu_s", "python", "unsafe_no_isolation")
_warned_unsafe = False


def _warn_unsafe() -> None:
    """Once per process: the opt-out must never go unnoticed."""
    global _warned_unsafe
    if not _warned_unsafe:
        _warned_unsafe = True
        print("WARNING: code_exec runs model-written programs WITHOUT ISOLATION "
              "(unsafe_no_isolation: true): they can read and change this machine's files, use "
              "its network and leave processes running; limits and verdicts still apply",
              file=sys.stderr, flush=True)


def _check_code_exec(rows: list, args: dict) -> None:
    from rewards.cases import check_tests
    from rewards.sandbox import Limits, check_isolation, interpreter
    from rewards.sandbox_limits import cgroup_bases

    unknown = sorted(set(args) - set(CODE_EXEC_ARGS))
    if unknown:
        raise ValueError(f"code_exec args {unknown} are unknown; allowed: "
                         f"{', '.join(CODE_EXEC_ARGS)}")
    unsafe = args.get("unsafe_no_isolation", False)
    if not isinstance(unsafe, bool):
        raise ValueError(f"code_exec unsafe_no_isolation={unsafe!r}: give true or false")
    Limits(**{k: v for k, v in args.items() if k not in ("unsafe_no_isolation", "python")})
    for k, row in enumerate(rows):
        if "tests" not in row:
            raise ValueError(f"row {k} has no field 'tests' (fields: {', '.join(row)}); "
                             f"code_exec needs each row's test cases there")
        # A row's fields reach the reward as keyword arguments, next to the term's args: a row
        # must not set its own limits, nor turn isolation off.
        own = [key for key in CODE_EXEC_ARGS if key in row]
        if own:
            raise ValueError(f"row {k} has the field '{own[0]}', which is a code_exec arg; "
                             f"set it in the reward term's args and drop it from the data")
        check_tests(row["tests"], f"row {k}")
    python = interpreter(args.get("python"))
    where = ("with a per-call cgroup (memory_mb and processes are totals)" if cgroup_bases()
             else "without a cgroup (memory_mb per process, 8 processes unless set)")
    print(f"code_exec: programs run on {python.path} (Python {python.version}), "
          f"{'WITHOUT ISOLATION' if unsafe else 'isolated ' + where}", flush=True)
    if unsafe:
        _warn_unsafe()
    else:
        check_isolation(args.get("python"))


def check_code_exec(rows: list, args: dict) -> None:
    """At start: known args, no row that sets them, every row's tests in the case form, the
    interpreter (its version printed), isolation available."""
    from rewards.sandbox import SandboxError

    try:
        _check_code_exec(rows, args)
    except (ValueError, SandboxError) as e:
        raise StartCheckError(str(e)) from None


@register("code_exec")
@start_check(check_code_exec)
def code_exec(prompt: str, completion: str, tests: list, timeout_s: float = 5.0,
              memory_mb: int = 512, cpu_s: float | None = None, python: str | None = None,
              unsafe_no_isolation: bool = False, **row) -> float:
    """Fraction of the row's `tests` that the completion's last ```python block passes, in
    [0, 1]. Cases: {"fn": "solve", "args": [1, 2], "expect": 3} (optional "tol") or
    {"stdin": "1 2\\n", "stdout": "3\\n"}. The program runs isolated (rewards.sandbox) on
    `python` (default /usr/bin/python3); the verdicts are made outside it.
    unsafe_no_isolation: the opt-out, loudly warned."""
    from rewards.sandbox import Limits, check_isolation, extract_code, run_cases

    limits = Limits(timeout_s=timeout_s, memory_mb=memory_mb, cpu_s=cpu_s)
    if unsafe_no_isolation:
        _warn_unsafe()
    else:
        check_isolation(python)
    passed = run_cases(extract_code(completion), tests, limits, isolated=not unsafe_no_isolation,
                       python=python)
    return sum(passed) / len(tests)  # our count of cases: whatever the program wrote, <= 1


REASONING_GYM_FALLBACKS = ("response", "last_number")


def _check_reasoning_gym(rows: list, args: dict) -> None:
    fallback = args.get("fallback", "response")
    if fallback not in REASONING_GYM_FALLBACKS:
        raise StartCheckError(f"reward reasoning_gym: args.fallback is {fallback!r}; use one of "
                              f"{', '.join(REASONING_GYM_FALLBACKS)}")
    bad = next((i for i, r in enumerate(rows) if not isinstance(r.get("reasoning_gym"), dict)),
               None)
    if bad is not None:
        raise StartCheckError(f"row {bad} has no 'reasoning_gym' field; this reward scores rows "
                              f"from data.train_path: reasoning_gym:<task>")
    try:
        import reasoning_gym  # noqa: F401
    except ImportError:
        raise StartCheckError("the reasoning-gym package is not installed: pip install -e "
                              "'.[tasks]'") from None


@register("reasoning_gym")
@start_check(_check_reasoning_gym)
def reasoning_gym_answer(prompt: str, completion: str, answer: str, reasoning_gym: dict,
                         fallback: str = "response", **row) -> float:
    """The reasoning-gym task's own verifier (`score_answer`, 0.0-1.0; partial credit where the
    task gives it) on the last <answer>...</answer> of the completion. Without such a block (or
    with an empty one, as when the model echoes the instruction) it scores, by `fallback`, the whole response ("response") or the response's last number
    ("last_number": for tasks with numeric answers and models too small to follow the tag
    format, like verl's "flexible" GSM8K extraction)."""
    import reasoning_gym as gym
    from reasoning_gym.utils import extract_answer

    tagged = extract_answer(completion)
    if not (tagged or "").strip() and fallback == "last_number":  # no block, or an empty one
        found = _NUMBER.findall(completion.replace(",", ""))
        tagged = found[-1] if found else ""
    score = gym.get_score_answer_fn(reasoning_gym["task"])
    return float(score(tagged if tagged is not None else completion.strip(),
                       reasoning_gym["entry"]))
