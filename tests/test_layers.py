"""labkit's layers: a lower layer never imports a higher one (DESIGN "labkit", docs/labkit.md).

Every import in the package is checked, including those inside functions (a lazy import still
ties the layers together), and the cost models may not import torch at module level. The rules
are also applied to a small tree written here that breaks each of them, so the checker is shown
to fail when it should.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "labkit"

COST = {"models", "hardware", "memory", "flops", "comm", "pipeline", "validate", "precision",
        "placement", "activations", "scaling", "offload", "deepspeed", "fsdp", "fsdp_migrate",
        "resilience", "tp", "planner", "planner_cost", "quiz", "design", "topology"}
# layer of each top-level part of the package, and what each layer may import
LAYER_OF = {**{m: "cost" for m in COST}, "plots": "plots", "widgets": "widgets",
            "runtime": "runtime", "parallel": "parallel", "labs": "labs", "course": "course",
            "app": "app", "cli": "cli"}
ALLOWED = {
    "cost": {"cost"},
    "plots": {"cost", "plots"},
    "widgets": {"cost", "plots", "widgets"},
    "app": {"cost", "plots", "widgets", "app"},     # the calculators' web app: views only
    "runtime": {"cost", "runtime"},
    "parallel": {"cost", "runtime", "parallel"},
    "labs": {"cost", "plots", "runtime", "parallel", "labs"},
    "course": {"cost", "plots", "widgets", "runtime", "parallel", "labs", "course"},
    "cli": set(LAYER_OF.values()),
}
# The package root (`labkit/__init__.py` re-exports run_lab lazily; `_moved.py` aliases the 0.1
# paths for one release) and `__main__` sit outside the layers.
EXEMPT = {"__init__", "__main__", "_moved"}
HEAVY = ("torch", "transformers", "matplotlib", "ipywidgets")


def part_of(path: Path, root: Path) -> str:
    rel = path.relative_to(root)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def imports(path: Path, root: Path):
    """(imported module, line, at module level?) for every import statement in the file."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = ".".join(("labkit",) + path.relative_to(root).with_suffix("").parts[:-1])
    top_level = {id(node) for node in tree.body}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno, id(node) in top_level
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            names = [f"{mod}.{a.name}" for a in node.names] if mod == "labkit" else [mod]
            for name in names:
                yield name, node.lineno, id(node) in top_level


def violations(root: Path) -> list[str]:
    found = []
    for path in sorted(root.rglob("*.py")):
        part = part_of(path, root)
        if part in EXEMPT:
            continue
        if part not in LAYER_OF:
            found.append(f"{path.relative_to(root)}: not in any layer; add it to LAYER_OF")
            continue
        layer = LAYER_OF[part]
        for name, line, module_level in imports(path, root):
            where = f"{path.relative_to(root)}:{line}"
            bits = name.split(".")
            if bits[0] == "labkit" and len(bits) > 1:
                target = bits[1]
                if target in EXEMPT:
                    if target == "_moved":
                        found.append(f"{where}: imports labkit._moved (old paths are for learners)")
                    continue
                other = LAYER_OF.get(target)
                if other is not None and other not in ALLOWED[layer]:
                    found.append(f"{where}: {layer} layer imports {name} ({other} layer)")
            elif layer == "cost" and bits[0] in HEAVY and module_level:
                found.append(f"{where}: cost model imports {bits[0]} at module level")
    return found


def test_labkit_respects_its_layers():
    problems = violations(PKG)
    assert not problems, "layering broken:\n" + "\n".join(problems)


def test_every_folder_says_what_it_may_import():
    for init in sorted(PKG.glob("*/__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        assert "May import" in doc, f"{init.relative_to(PKG.parent)}: its docstring must say what it may import"


@pytest.mark.parametrize("rel, code, expected", [
    ("memory.py", "from labkit.runtime import launch\n", "cost layer imports labkit.runtime"),
    ("memory.py", "import torch\n", "cost model imports torch at module level"),
    ("comm.py", "def f():\n    from labkit.widgets import table_html\n", "cost layer imports labkit.widgets"),
    ("runtime/launch.py", "from labkit.course import grading\n", "runtime layer imports labkit.course"),
    ("runtime/dist.py", "from labkit import cli\n", "runtime layer imports labkit.cli"),
    ("runtime/x.py", "from ..labs import hello\n", "runtime layer imports labkit.labs"),
    ("plots/x.py", "import labkit.widgets.memory\n", "plots layer imports labkit.widgets"),
    ("labs/x.py", "from labkit.course.grader import grade_notebook\n", "labs layer imports labkit.course"),
    ("course/grader.py", "from labkit.cli.grade import main\n", "course layer imports labkit.cli"),
    ("parallel/ddp.py", "from labkit.labs import hello\n", "parallel layer imports labkit.labs"),
    ("app/__init__.py", "from labkit.runtime import launch\n", "app layer imports labkit.runtime"),
    ("widgets/x.py", "from labkit.app import CalculatorsApp\n", "widgets layer imports labkit.app"),
    ("newthing.py", "x = 1\n", "not in any layer"),
])
def test_checker_fails_when_a_rule_is_broken(tmp_path, rel, code, expected):
    root = tmp_path / "labkit"
    (root / Path(rel)).parent.mkdir(parents=True, exist_ok=True)
    (root / "__init__.py").write_text("")
    (root / rel).write_text(code)
    problems = violations(root)
    assert any(expected in p for p in problems), problems


def test_checker_allows_what_the_rules_allow(tmp_path):
    root = tmp_path / "labkit"
    files = {"memory.py": "from labkit.models import get_model\ndef f():\n    import torch\n",
             "labs/x.py": "from labkit.runtime import dist\nfrom labkit.plots import png_bytes\n",
             "course/x.py": "from labkit.runtime.launch import run_lab\n",
             "cli/x.py": "from labkit.course import grader\n"}
    for rel, code in files.items():
        (root / Path(rel)).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(code)
    assert violations(root) == []


def test_old_module_paths_still_import_for_one_release():
    """0.1 paths resolve to the very same module objects, each with a DeprecationWarning naming
    the new path; `import labkit` itself stays free of torch."""
    import subprocess
    import sys
    code = r'''
import sys, warnings
warnings.simplefilter("always")
with warnings.catch_warnings(record=True) as caught:
    import labkit
    assert "torch" not in sys.modules
    from labkit import run_lab, LabError
    assert "torch" not in sys.modules, "from labkit import run_lab must stay lazy"
    import labkit.runtime.launch as new_launch
    from labkit.launch import run_lab as old_run_lab
    from labkit import grading
    import labkit.commands.grade as old_grade
    import labkit.cli.grade as new_grade
    from labkit._moved import MOVED
    import importlib
    for old, new in MOVED.items():
        assert importlib.import_module(old) is importlib.import_module(new), old
assert run_lab is old_run_lab is new_launch.run_lab and LabError is new_launch.LabError
assert grading.__name__ == "labkit.course.grading" and old_grade is new_grade
messages = {str(w.message) for w in caught if w.category is DeprecationWarning}
assert "labkit.launch moved to labkit.runtime.launch in labkit 0.2; the old name goes in 0.3" in messages, messages
assert any(m.startswith("labkit.grading moved to labkit.course.grading") for m in messages), messages
print("ok")
'''
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]
