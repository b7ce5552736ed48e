"""The shell scripts' Python lines name the project's code as it is: a `from X import Y` of one of
our packages in scripts/*.sh or .ci/run must find Y defined in X. setup.sh swallows a failed
build step on purpose (no compiler is not fatal), so a renamed function it calls fails silently
there: DeepSpeed's CPU comm op (~35 s of both cores) was then built inside the suite's first
test instead of by setup.sh, for 29 commits."""
import ast
import re

from tests.unit.test_layering import PACKAGES, ROOT

FROM_IMPORT = re.compile(r"\bfrom\s+([\w.]+)\s+import\s+([\w ,]+)")


def defined(module: str) -> set[str]:
    """The top-level names a module of ours defines or imports (read, not imported)."""
    path = ROOT.joinpath(*module.split("."))
    path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
    assert path.exists(), f"{module}: no such module of the project ({path})"
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
    return names


def project_imports(text: str) -> list[tuple[str, str]]:
    """(module, name) of each `from <our package>... import name` in a script's text."""
    found = []
    for module, names in FROM_IMPORT.findall(text):
        if module.split(".")[0] in PACKAGES:
            found += [(module, n.strip()) for n in names.split(",") if n.strip()]
    return found


def test_the_scripts_import_names_that_exist():
    scripts = [*ROOT.glob("scripts/*.sh"), ROOT / ".ci" / "run"]
    checked = 0
    for script in scripts:
        for module, name in project_imports(script.read_text()):
            assert name in defined(module), (
                f"{script.relative_to(ROOT)}: `from {module} import {name}`, but {module} "
                f"defines no {name}: name where it lives now")
            checked += 1
    assert checked, "setup.sh loads DeepSpeed's comm op through a project import"


def test_a_moved_name_is_caught():
    assert project_imports('python -c "from update.trainer import load_shm_comm_op; x()"') == [
        ("update.trainer", "load_shm_comm_op")]
    assert "load_shm_comm_op" in defined("update.distributed")
    assert "load_shm_comm_op" not in defined("update.trainer")
