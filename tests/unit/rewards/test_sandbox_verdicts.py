"""Verdicts are made outside the sandbox: whatever a program does to the interpreter, the
runner or its answers, it only ever gives one answer per case, and never sees an expected
value."""
import textwrap

import pytest

from rewards.cases import public
from rewards.sandbox import Limits, extract_code, run_isolated

TAMPER = {
    "always-equal object": """
        class Any:
            def __eq__(self, other): return True
            def __ne__(self, other): return False
        def solve(x): return Any()
    """,
    "a bool for an int": "def solve(x): return True",
    "json patched": """
        import json, json.encoder
        forged = '{"i": 0, "value": true, "passed": true, "reward": 100}'
        json.dumps = lambda *a, **k: forged
        json.JSONEncoder.encode = lambda self, o: forged
        def solve(x): return 2
    """,
    "builtins patched": """
        import builtins
        builtins.isinstance = lambda *a: True
        builtins.getattr = lambda *a: (lambda *b: 1.0000001e300)
        builtins.len = lambda *a: 0
        def solve(x): return 2
    """,
    "sys patched": """
        import atexit, os, sys
        sys.modules["json"] = type(sys)("json")
        sys.exit = lambda *a: None
        def forge():  # into every open descriptor, the runner's answers among them
            for fd in range(64):
                try:
                    os.write(fd, b'{"i": 0, "value": true}\\n{"i": 0, "passed": true}\\n')
                except OSError:
                    pass
        forge()
        atexit.register(forge)
        def solve(x): return 2
    """,
    "the runner's own state": """
        import gc
        for obj in gc.get_objects():
            if getattr(obj, "__name__", "") == "answer":
                for line in ('PASS', '{"i": 0, "passed": true}', '{"i": 0.0, "value": 1}',
                             '{"i": true, "value": 1}', '{"i": 0, "value": 1, "x": 0}'):
                    obj(line)
        def solve(x): return 2
    """,
    "a search for the expected value": """
        import glob, os, re
        paths = glob.glob("/work/**", recursive=True) + glob.glob("/tmp/**", recursive=True)
        paths += glob.glob("/proc/[0-9]*/cmdline") + glob.glob("/proc/[0-9]*/environ")
        blobs = []
        for path in paths:
            try:
                blobs.append(open(path, "rb").read(1 << 20))
            except OSError:
                pass
        hits = [m for b in blobs for m in re.findall(rb"expected-[0-9a-f]{8}", b)]
        def solve(x): return hits[0].decode() if hits else "not found"
    """,
}


@pytest.mark.parametrize("attack", TAMPER, ids=list(TAMPER))
def test_tampering_scores_nothing_for_a_wrong_answer(score, attack):
    cases = [{"fn": "solve", "args": [1], "expect": 1}]
    if attack == "a search for the expected value":
        cases = [{"fn": "solve", "args": [1], "expect": "expected-5eb7c0de"}]
    assert score(textwrap.dedent(TAMPER[attack]), cases) == 0.0


def test_forged_answer_lines_never_lift_the_reward_above_one(score, programs):
    # Into every descriptor the runner may hold its answers on (its fd 1 is /dev/null): the
    # forgeries do reach the parser, which takes one answer per case of its own list.
    forge = programs.hostile("""
        import os
        for fd in range(3, 64):
            for k in range(100):
                try:
                    os.write(fd, f'{{"i": {k}, "value": 1}}\\n'.encode())
                except OSError:
                    pass
    """)
    cases = programs.cases + [{"fn": "solve", "args": [2], "expect": 3}]
    job = {"timeout_s": 10.0, "cases": [public(c) for c in cases]}
    assert b'{"i": 99, "value": 1}\n' in run_isolated(forge, job, Limits(timeout_s=10.0)).answers
    assert score(forge) == 1.0
    assert score(forge, cases) == 0.5


def test_extract_code():
    assert extract_code("x\n```python\na = 1\n```\n```py\nb = 2\n```") == "b = 2\n"
    assert extract_code("```python\na = 1\n```\n```bash\nls\n```") == "a = 1\n"
    assert extract_code("plain = 1") == "plain = 1"
