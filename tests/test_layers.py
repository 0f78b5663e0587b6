"""labkit's layers: a lower layer never imports a higher one (DESIGN "labkit", docs/labkit.md);
no two modules import each other, however indirectly; a lab imports only its own parts and
labkit.labs.common, never another lab; labkit/labs/ holds one entry per lab.

Every import in the package is checked, including those inside functions (a lazy import still
ties the modules together), and the cost models may not import torch at module level. Each rule
is also applied to a small tree written here that breaks it, so the checker fails when it should.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "labkit"

COST = {"models", "hardware", "memory", "flops", "comm", "pipeline", "validate", "precision", "kernels",
        "placement", "activations", "scaling", "offload", "deepspeed", "fsdp", "fsdp_migrate",
        "resilience", "tp", "planner", "planner_cost", "quiz", "design", "topology", "field",
        "field_bloom", "pipeline_check", "pipeline_events", "pipeline_v", "trace", "trace_drills",
        "fp8"}
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
# The package root (`labkit/__init__.py` re-exports run_lab lazily) and `__main__` sit outside
# the layers.
EXEMPT = {"__init__", "__main__"}
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


# ---------------------------------------------------------------------------------------------
# import cycles, and labs that import each other

def module_name(path: Path, root: Path) -> str:
    parts = (root.name,) + path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path) -> dict[str, set[str]]:
    """{module: the package's modules it imports}, lazy imports included. `from pkg import sub`
    (sub a module) is an edge to sub alone: importing pkg first is Python's doing, not a
    dependency of the importer on pkg's own code."""
    paths = {module_name(p, root): p for p in root.rglob("*.py")}
    graph = {}
    for mod, path in paths.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    bits = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(bits + ([node.module] if node.module else []))
                subs = [f"{base}.{a.name}" for a in node.names]
                names = subs if all(s in paths for s in subs) else [base] + [s for s in subs if s in paths]
            else:
                continue
            edges |= {n for n in names if n in paths and n != mod}
        graph[mod] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def lab_of(module: str) -> str | None:
    """The lab a module belongs to ('ddp' for labkit.labs.ddp.check), 'common', or None."""
    bits = module.split(".")
    return bits[2] if len(bits) > 2 and bits[1] == "labs" else None


def cross_lab_imports(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{m} imports {t}" for m, targets in graph.items() for t in targets
                  if lab_of(m) not in (None, "common") and lab_of(t) not in (None, "common")
                  and lab_of(t) != lab_of(m))


def test_no_module_imports_itself_through_others():
    found = cycles(import_graph(PKG))
    assert not found, "import cycles (each module of a cycle cannot be read or tested alone):\n" + \
        "\n".join(" <-> ".join(c) for c in found)


def test_labs_import_only_their_own_parts_and_common():
    graph = import_graph(PKG)
    assert not cross_lab_imports(graph), "\n".join(cross_lab_imports(graph))
    common = [m for m in graph if lab_of(m) == "common"]
    assert common, "labkit.labs.common is missing"
    up = sorted(f"{m} imports {t}" for m in common for t in graph[m] if lab_of(t) not in (None, "common"))
    assert not up, "labkit.labs.common must not import a lab:\n" + "\n".join(up)


def test_labs_folder_lists_one_entry_per_lab():
    """Each entry of labkit/labs/ is a lab program (a module with main(), or a package that
    `python -m` runs), besides __init__.py and common/."""
    for entry in sorted((PKG / "labs").iterdir()):
        if entry.name in ("__init__.py", "common", "__pycache__"):
            continue
        if entry.is_dir():
            assert (entry / "__main__.py").exists() and (entry / "lab.py").exists(), \
                f"labkit/labs/{entry.name}/ is not a lab: it needs lab.py and __main__.py"
            program = entry / "lab.py"
        else:
            assert entry.suffix == ".py" and not entry.name.startswith("_"), \
                f"labkit/labs/{entry.name}: a part of a lab belongs in that lab's folder"
            program = entry
        tree = ast.parse(program.read_text())
        assert any(isinstance(n, ast.FunctionDef) and n.name == "main" for n in tree.body), \
            f"{program.relative_to(PKG.parent)} has no main(): every lab is a program"


def test_old_module_paths_are_gone():
    """labkit 0.1's paths (labkit.launch, labkit.grading, ...) and the 0.2 flat lab parts are
    not importable: the course uses only the current paths."""
    import importlib

    assert not (PKG / "_moved.py").exists()
    for old in ("labkit.launch", "labkit.grading", "labkit.commands", "labkit.labs._ddp_measure",
                "labkit.labs.ddp_exercise", "labkit.labs._pp_common"):
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(old)


def _tree(tmp_path, files: dict) -> Path:
    root = tmp_path / "labkit"
    for rel, code in files.items():
        (root / Path(rel)).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(code)
    return root


def test_cycle_checker_finds_direct_lazy_and_long_cycles(tmp_path):
    root = _tree(tmp_path, {
        "__init__.py": "", "a.py": "import labkit.b\n", "b.py": "def f():\n    from labkit import a\n",
        "labs/__init__.py": "", "labs/x/__init__.py": "from labkit.labs.x.lab import main\n",
        "labs/x/lab.py": "from labkit.labs.x import part\ndef main(): pass\n",
        "labs/x/part.py": "from labkit.labs.x.other import y\n",
        "labs/x/other.py": "from .part import z\ny = 1\n"})
    assert cycles(import_graph(root)) == [["labkit.a", "labkit.b"],
                                          ["labkit.labs.x.other", "labkit.labs.x.part"]]


def test_cycle_checker_allows_a_package_that_reexports_its_parts(tmp_path):
    root = _tree(tmp_path, {
        "__init__.py": "", "labs/__init__.py": "", "labs/common/__init__.py": "",
        "labs/common/util.py": "x = 1\n",
        "labs/x/__init__.py": "from labkit.labs.x.lab import main\n",
        "labs/x/lab.py": "from labkit.labs.x import part\nfrom labkit.labs.common.util import x\n",
        "labs/x/part.py": "from labkit.labs.common import util\n"})
    graph = import_graph(root)
    assert cycles(graph) == [] and cross_lab_imports(graph) == []


def test_cross_lab_checker_names_the_import(tmp_path):
    root = _tree(tmp_path, {
        "__init__.py": "", "labs/__init__.py": "", "labs/x/__init__.py": "", "labs/y/__init__.py": "",
        "labs/x/lab.py": "def main():\n    from labkit.labs.y.lab import helper\n",
        "labs/y/lab.py": "def helper(): pass\n"})
    assert cross_lab_imports(import_graph(root)) == ["labkit.labs.x.lab imports labkit.labs.y.lab"]


# ---------------------------------------------------------------------------------------------
# module docstrings: what the file is, how to run or call it, its sources (about 10 lines)

MAX_DOCSTRING_LINES = 12


def long_docstrings(root: Path) -> list[str]:
    found = []
    for path in sorted(root.rglob("*.py")):
        doc = ast.get_docstring(ast.parse(path.read_text()), clean=False)
        if doc and doc.count("\n") + 1 > MAX_DOCSTRING_LINES:
            found.append(f"{path.relative_to(root.parent)}: {doc.count(chr(10)) + 1} lines")
    return found


def test_module_docstrings_are_short():
    """The rest of a file's story goes next to the code it explains, or to docs/labkit.md,
    docs/labs.md and docs/runtime.md."""
    found = long_docstrings(PKG)
    assert not found, f"module docstrings over {MAX_DOCSTRING_LINES} lines:\n" + "\n".join(found)


def test_docstring_checker_counts_lines(tmp_path):
    root = _tree(tmp_path, {"ok.py": '"""' + "line\n" * 11 + '"""\n',
                            "long.py": '"""' + "line\n" * 12 + '"""\n'})
    assert long_docstrings(root) == ["labkit/long.py: 13 lines"]
