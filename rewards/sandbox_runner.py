"""The untrusted side of a code_exec run: it runs the program on each case and writes what the
program answered, one JSON line per case, on fd 1; the parent decides what passed.

Started as `PY -I -S -c <this source>` (empty environment, unprivileged) in the work directory,
which holds solution.py and cases.json: {"timeout_s": float, "cases": [{"fn": name, "args": [...]}
or {"stdin": text}]}. Expected values are never here. The program runs in this same process for
function cases and may rewrite anything in it, this code included: what comes out is only ever
taken as the program's answers. Lines: {"i": k, "value": v}, {"i": k, "stdout": text} or
{"i": k, "error": text}, after one empty line, written at once: the start that the parent's
timeout runs from (the sandbox's set-up is not the program's time). Standard library only (it
runs on the sandbox's interpreter).
"""
import json
import os
import sys
import time

START = time.monotonic()
EXIT = os._exit  # taken before the program runs, which may replace os._exit
STDOUT_CAP = 1 << 20  # bytes of a stdin case's output read back; more fails the case


def run_script(i, stdin, deadline):
    """Case i, stdin form: solution.py as a script, its stdin given, its stdout read back."""
    import subprocess

    left = deadline - time.monotonic()
    if left <= 0:
        return {"i": i, "error": "no time left"}
    with open(f"stdin{i}.txt", "w", encoding="utf-8") as f:
        f.write(stdin)
    with open(f"stdin{i}.txt", "rb") as fin, open(f"stdout{i}.txt", "wb") as fout:
        try:
            proc = subprocess.Popen([sys.executable, "-I", "-S", "solution.py"], stdin=fin,
                                    stdout=fout, stderr=subprocess.DEVNULL)
        except OSError as e:  # e.g. no process left under the limit: this case fails, not all
            return {"i": i, "error": f"could not start: {e.strerror}"}
        try:
            code = proc.wait(timeout=left)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            return {"i": i, "error": "timeout"}
    if code != 0:
        return {"i": i, "error": f"exit status {code}"}
    with open(f"stdout{i}.txt", "rb") as f:
        out = f.read(STDOUT_CAP + 1)
    if len(out) > STDOUT_CAP:
        return {"i": i, "error": f"more than {STDOUT_CAP} bytes of output"}
    return {"i": i, "stdout": out.decode("utf-8", "replace")}


def _name(error):
    try:
        return str(type(error).__name__)[:200]
    except Exception:  # the program can make even this raise; the case fails either way
        return "error"


def call_functions(cases, deadline, answer):
    """Function cases: load solution.py in this process, once, then fn(*args) per case."""
    import types

    dumps = json.dumps
    module = types.ModuleType("solution")
    module.__file__ = os.path.abspath("solution.py")
    sys.modules["solution"] = module  # dataclasses, pickle and the like look the module up
    try:
        with open("solution.py", encoding="utf-8") as f:
            source = f.read()
        exec(compile(source, "solution.py", "exec"), module.__dict__)
    except BaseException as e:  # SystemExit too: whatever the program does, it did not load
        for i, _ in cases:
            answer(dumps({"i": i, "error": "did not load: " + _name(e)}))
        return
    for i, case in cases:
        if time.monotonic() >= deadline:
            return
        try:
            value = getattr(module, case["fn"])(*case["args"])
            # Serialized here, inside the try: a value JSON cannot hold (always-equal objects,
            # sets, NaN) is an error for this case, never a pass.
            line = dumps({"i": i, "value": value}, allow_nan=False)
        except BaseException as e:
            line = dumps({"i": i, "error": _name(e)})
        answer(line)


def main():
    """Answer every case (stdin cases first, in a child each), then exit at once."""
    os.write(1, b"\n")  # started: the parent's clock for the program runs from here
    with open("cases.json", encoding="utf-8") as f:
        job = json.load(f)
    deadline = START + job["timeout_s"]
    answers = os.fdopen(os.dup(1), "w", encoding="utf-8")
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 1)  # the program's own prints go nowhere, not among the answers

    def answer(line):
        answers.write(line + "\n")
        answers.flush()  # one line per finished case: a later hang loses only later cases

    cases = job["cases"]
    for i, case in enumerate(cases):
        if "stdin" in case:
            answer(json.dumps(run_script(i, case["stdin"], deadline)))
    functions = [(i, case) for i, case in enumerate(cases) if "fn" in case]
    if functions:
        call_functions(functions, deadline, answer)
    answers.flush()
    # Now, not at interpreter exit: the program's non-daemon threads and atexit hooks would
    # hold the call open until its timeout.
    EXIT(0)


if __name__ == "__main__":
    main()
