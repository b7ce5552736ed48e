"""The house's size limits on the package code (STYLE.md): no file over 400 lines, no function
over 60. A file or function past them is split by responsibility, not by count."""
import ast
import pathlib

ROOT = pathlib.Path(__file__).parents[2]
PACKAGES = ("rl", "rollout", "update", "weight_sync", "rewards", "envs")
MAX_FILE_LINES, MAX_FUNCTION_LINES = 400, 60


def oversized(path: str, source: str) -> list[str]:
    """What in one file breaks a limit, one line each."""
    found = []
    lines = source.count("\n")
    if lines > MAX_FILE_LINES:
        found.append(f"{path}: {lines} lines (at most {MAX_FILE_LINES})")
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = node.end_lineno - node.lineno + 1
            if length > MAX_FUNCTION_LINES:
                found.append(f"{path}:{node.lineno} {node.name}: {length} lines "
                             f"(at most {MAX_FUNCTION_LINES})")
    return found


def test_no_package_file_or_function_past_the_limits():
    found = [line for package in PACKAGES for f in sorted((ROOT / package).rglob("*.py"))
             for line in oversized(str(f.relative_to(ROOT)), f.read_text())]
    assert not found, "\n".join(found)


def test_a_long_function_and_a_long_file_are_found():
    body = "".join(f"    x{i} = {i}\n" for i in range(60))
    assert oversized("m.py", f"def f():\n{body}") == ["m.py:1 f: 61 lines (at most 60)"]
    assert oversized("m.py", "x = 1\n" * 401) == ["m.py: 401 lines (at most 400)"]
    assert oversized("m.py", f"def f():\n{body[:-len('    x59 = 59')-1]}") == []
