"""The one-way import rule of STYLE.md (between the packages and between rl/'s rooms), no import
circle, and light package imports."""
import ast
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).parents[2]
PACKAGES = ("rl", "rollout", "update", "weight_sync", "rewards", "envs")
# room -> what it must not import. A room is a package or one of rl/'s sub-packages (the most
# specific name wins); envs/ (multi-turn environments) sits beside rewards/, on the same floor.
FORBIDDEN = {
    "rollout": {"rl", "update", "weight_sync", "envs"},
    "update": {"rl", "rollout", "weight_sync", "envs"},
    "rewards": {"rl", "rollout", "update", "weight_sync", "envs"},
    "envs": {"rl", "rollout", "update", "weight_sync"},
    "weight_sync": {"rl", "envs"},
    # rl/: cli and preflight on top; run/ below them; data/ below run/; algo/ and observe/ at
    # the bottom beside schema, config and errors, which import no room.
    "rl": set(),
    "rl.run": {"rl.cli", "rl.preflight"},
    "rl.data": {"rl.cli", "rl.preflight", "rl.run"},
    # the planner: pure arithmetic over the config (rl.data: the built-ins' shapes)
    "rl.plan": {"rl.cli", "rl.preflight", "rl.run", "rl.algo", "rl.observe",
                "rollout", "weight_sync", "rewards", "envs"},
    "rl.algo": {"rl.cli", "rl.preflight", "rl.run", "rl.data", "rl.observe",
                "rollout", "weight_sync", "rewards", "envs"},  # update.losses: a registry
    "rl.observe": {"rl.cli", "rl.preflight", "rl.run", "rl.data", "rl.algo",
                   "rollout", "update", "weight_sync", "rewards", "envs"},
    "rl.schema": {"rl.cli", "rl.preflight", "rl.run", "rl.data", "rl.algo", "rl.observe",
                  "rl.config", "rl.errors"},
    "rl.config": {"rl.cli", "rl.preflight", "rl.run", "rl.data", "rl.algo", "rl.observe"},
    "rl.config_errors": {"rl.cli", "rl.preflight", "rl.run", "rl.data", "rl.algo", "rl.observe",
                         "rl.config"},
    "rl.errors": {"rl.cli", "rl.preflight", "rl.run", "rl.data", "rl.algo", "rl.observe"},
}


def module_name(root: pathlib.Path, path: pathlib.Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(tree: ast.AST) -> list[str]:
    """Every module an absolute import names (`from a import b` names a.b as well: b may be a
    module)."""
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names += [node.module] + [f"{node.module}.{a.name}" for a in node.names]
    return names


def within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def room_of(module: str) -> str:
    return max((r for r in FORBIDDEN if within(module, r)), key=len)


def modules(root: pathlib.Path) -> dict[str, list[str]]:
    """module -> the modules it imports, for every module of the packages under root."""
    return {module_name(root, path): imported(ast.parse(path.read_text()))
            for package in PACKAGES if (root / package).is_dir()
            for path in sorted((root / package).rglob("*.py"))}


def broken_layers(graph: dict[str, list[str]]) -> list[str]:
    return sorted(f"{module} imports {name}" for module, names in graph.items() for name in names
                  if any(within(name, f) for f in FORBIDDEN[room_of(module)]))


def circles(graph: dict[str, list[str]]) -> list[list[str]]:
    """Groups of modules that import each other, directly or around a circle (a package's
    __init__ counts as the package's module)."""
    edges = {m: {n for n in names if n in graph and n != m} for m, names in graph.items()}
    reach = {m: set(e) for m, e in edges.items()}
    changed = True
    while changed:  # transitive closure; a few hundred modules
        changed = False
        for m in reach:
            more = set().union(*(reach[n] for n in reach[m])) - reach[m]
            if more:
                reach[m] |= more
                changed = True
    groups = {frozenset({m} | {n for n in reach[m] if m in reach[n]}) for m in reach if m in reach[m]}
    return sorted(sorted(g) for g in groups)


def test_imports_run_one_way():
    assert not broken_layers(modules(ROOT))


def test_no_import_circle():
    assert not circles(modules(ROOT))


def test_the_check_catches_a_room_importing_upward_and_a_circle(tmp_path):
    files = {"rl/observe/log.py": "from rl.run import controller\n",
             "rl/run/controller.py": "import rl.observe.log\n",
             "envs/tool.py": "from rl.config import Config\n",
             "rewards/a.py": "from rewards import b\n", "rewards/b.py": "import rewards.a\n"}
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    graph = modules(tmp_path)
    assert broken_layers(graph) == ["envs.tool imports rl.config",
                                    "envs.tool imports rl.config.Config",
                                    "rl.observe.log imports rl.run",
                                    "rl.observe.log imports rl.run.controller"]
    assert circles(graph) == [["rewards.a", "rewards.b"],
                              ["rl.observe.log", "rl.run.controller"]]


def test_cli_and_algorithms_import_no_engine():
    code = ("import sys, rl.cli, rl.config, rl.algo.advantages, update.losses, rewards.registry;"
            "rl.cli.parse_args(['recipes/quickstart.yaml']);"
            # rl-plan, the whole plan of a 7B on GPUs: arithmetic only
            "rl.cli.plan_main(['recipes/quickstart.yaml', 'model.path=docs/models/llama-7b',"
            " '--hardware', 'h100-80g', '--json']);"
            "heavy = [m for m in ('vllm', 'deepspeed', 'ray') if m in sys.modules];"
            "assert not heavy, heavy")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
