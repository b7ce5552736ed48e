"""The one-way import rule of STYLE.md, and light package imports."""
import ast
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).parents[2]
FORBIDDEN = {
    "rollout": {"rl", "update", "weight_sync"},
    "update": {"rl", "rollout", "weight_sync"},
    "rewards": {"rl", "rollout", "update", "weight_sync"},
    "weight_sync": {"rl"},
    "rl": set(),
}


def test_imports_run_one_way():
    broken = []
    for package, forbidden in FORBIDDEN.items():
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                    [node.module] if isinstance(node, ast.ImportFrom) and node.module and \
                    node.level == 0 else []
                broken += [f"{path.relative_to(ROOT)} imports {n}" for n in names
                           if n.split(".")[0] in forbidden]
    assert not broken, broken


def test_cli_and_algorithms_import_no_engine():
    code = ("import sys, rl.cli, rl.config, rl.advantages, update.losses, rewards.registry;"
            "rl.cli.parse_args(['recipes/quickstart.yaml']);"
            "heavy = [m for m in ('vllm', 'deepspeed', 'ray') if m in sys.modules];"
            "assert not heavy, heavy")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
