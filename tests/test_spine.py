"""The project's set-up files agree with each other, and notebooks are committed clean."""
from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib

import pytest
import yaml

from conftest import ROOT


def _name(requirement: str) -> str:
    """'torch>=2.6,<2.14' -> 'torch'; '-e .[dev]' -> '' (not a package name)."""
    if requirement.startswith("-"):
        return ""
    return re.split(r"[<>=!~ \[;]", requirement.strip(), maxsplit=1)[0].lower().replace("_", "-")


@pytest.fixture(scope="module")
def pyproject():
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_environment_yml_names_the_same_packages_as_pyproject(pyproject):
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    deps = env["dependencies"]
    conda = {_name(d) for d in deps if isinstance(d, str)} - {"python", "pip"}
    pip_sections = [d["pip"] for d in deps if isinstance(d, dict) and "pip" in d]
    assert len(pip_sections) == 1, "environment.yml needs exactly one pip: section"
    pip = pip_sections[0]
    assert "-e .[dev]" in pip, "the pip section must install labkit itself: -e .[dev]"
    from_env = conda | {_name(p) for p in pip if _name(p)}
    project = pyproject["project"]
    from_pyproject = {_name(d) for d in project["dependencies"] + project["optional-dependencies"]["dev"]}
    assert from_env == from_pyproject, (
        f"only in environment.yml: {sorted(from_env - from_pyproject)}; "
        f"only in pyproject.toml: {sorted(from_pyproject - from_env)}")
    assert any(p.startswith("python=3.11") for p in deps if isinstance(p, str))


def test_torch_is_never_unpinned(pyproject):
    """An unbounded torch requirement pulls the newest CUDA build (gigabytes) where none is installed."""
    torch_reqs = [d for d in pyproject["project"]["dependencies"] if _name(d) == "torch"]
    assert len(torch_reqs) == 1 and "<" in torch_reqs[0], f"torch needs an upper bound: {torch_reqs}"
    makefile = (ROOT / "Makefile").read_text()
    pin = re.search(r"TORCH_PIN\s*:=\s*torch==([\d.]+)", makefile)
    assert pin, "the Makefile must install torch==X.Y.Z first"
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    pip = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict))
    assert f"torch=={pin.group(1)}" in pip, "environment.yml and the Makefile must pin the same torch"
    upper = re.search(r"<\s*([\d.]+)", torch_reqs[0]).group(1)
    as_tuple = lambda v: tuple(int(x) for x in v.split("."))  # noqa: E731
    assert as_tuple(pin.group(1)) < as_tuple(upper), "the pinned torch must satisfy pyproject's range"


def committed_notebooks(root, into) -> list[tuple[str, object]]:
    """(name, file) of every notebook as committed at HEAD, copied under `into`: JupyterLab
    autosaves the notebooks a learner runs, so the working tree of a used checkout holds
    outputs, and what this test judges is what the course ships. A notebook not committed yet
    (new, staged) is judged as it is in the working tree; outside a git checkout, all are."""
    listed = subprocess.run(["git", "ls-files", "-z", "*.ipynb"], cwd=root, capture_output=True)
    names = [n for n in listed.stdout.decode().split("\0") if n] if listed.returncode == 0 else []
    if not names:
        return [(str(p.relative_to(root)), p) for p in sorted(root.glob("*/**/*.ipynb"))
                if ".ipynb_checkpoints" not in p.parts]
    batch = subprocess.run(["git", "cat-file", "--batch"], cwd=root, check=True,
                           input="".join(f"HEAD:{n}\n" for n in names).encode(),
                           capture_output=True).stdout
    out = []
    for name in names:
        header, _, batch = batch.partition(b"\n")
        if header.endswith(b" missing"):
            out.append((name, root / name))
            continue
        size = int(header.split()[2])
        copy = into / name
        copy.parent.mkdir(parents=True, exist_ok=True)
        copy.write_bytes(batch[:size])
        batch = batch[size + 1:]
        out.append((name, copy))
    return [(n, p) for n, p in out if ".ipynb_checkpoints" not in n.split("/")]


def test_notebooks_are_committed_without_outputs(tmp_path):
    notebooks = committed_notebooks(ROOT, tmp_path)
    assert notebooks, "no notebooks found"
    # nbstripout --verify exits non-zero when a notebook has outputs or execution counts
    # (--keep-id: cell ids are ours to choose; only outputs and counts matter).
    # One nbstripout for all of them (a start each cost 85 s on a busy 2-core machine); only
    # when it fails, one per notebook to name the culprits.
    verify = [sys.executable, "-m", "nbstripout", "--verify", "--keep-id"]
    r = subprocess.run(verify + [str(p) for _, p in notebooks], capture_output=True, text=True,
                       cwd=ROOT)
    if r.returncode == 0:
        return
    bad = [name for name, p in notebooks
           if subprocess.run(verify + [str(p)], capture_output=True, cwd=ROOT).returncode != 0]
    assert not bad, f"notebooks committed with outputs (run `nbstripout` on them): {bad}"
    raise AssertionError(f"nbstripout --verify failed on the set but on no single notebook: "
                         f"{r.stdout}{r.stderr}")


def _git(repo, *args):
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@example.com", *args],
                   cwd=repo, check=True, capture_output=True)


def _nb(outputs: list) -> str:
    cell = {"cell_type": "code", "execution_count": 1 if outputs else None, "id": "a",
            "metadata": {}, "outputs": outputs, "source": "print(2 + 2)"}
    return json.dumps({"cells": [cell], "metadata": {}, "nbformat": 4, "nbformat_minor": 5})


def test_a_learners_run_notebooks_do_not_count_but_committed_outputs_do(tmp_path):
    """Issue 28, item 13: a notebook run (and autosaved) in a learner's checkout is judged as
    committed; one committed with outputs is still caught; new ones are judged as they are."""
    repo, into = tmp_path / "repo", tmp_path / "copies"
    (repo / "notebooks").mkdir(parents=True)
    shown = [{"output_type": "stream", "name": "stdout", "text": "4\n"}]
    (repo / "notebooks" / "run by me.ipynb").write_text(_nb([]))
    (repo / "notebooks" / "shipped dirty.ipynb").write_text(_nb(shown))
    _git(repo, "init", "-q")
    _git(repo, "add", ".")
    _git(repo, "commit", "-qm", "course")
    (repo / "notebooks" / "run by me.ipynb").write_text(_nb(shown))       # JupyterLab autosave
    (repo / "notebooks" / "new.ipynb").write_text(_nb(shown))
    _git(repo, "add", "notebooks/new.ipynb")
    got = {name: json.loads(path.read_text())["cells"][0]["outputs"]
           for name, path in committed_notebooks(repo, into)}
    assert got == {"notebooks/run by me.ipynb": [], "notebooks/shipped dirty.ipynb": shown,
                   "notebooks/new.ipynb": shown}
    assert (repo / "notebooks" / "run by me.ipynb").read_text() == _nb(shown)   # untouched


def test_nbstripout_verify_catches_an_output(tmp_path):
    """The check above can fail: a notebook with an output is flagged."""
    nb = {"cells": [{"cell_type": "code", "execution_count": 1, "id": "a", "metadata": {},
                     "outputs": [{"output_type": "stream", "name": "stdout", "text": "4\n"}],
                     "source": "print(2 + 2)"}],
          "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
    path = tmp_path / "dirty.ipynb"
    path.write_text(json.dumps(nb))
    r = subprocess.run([sys.executable, "-m", "nbstripout", "--verify", "--keep-id", str(path)], capture_output=True)
    assert r.returncode != 0


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    assert "make test" in readme and "make lab" in readme
    assert "make test" in (ROOT / ".ci" / "run").read_text()


def test_readme_course_map_matches_labkit():
    from labkit.course.outline import MODULES

    readme = (ROOT / "README.md").read_text()
    for m in MODULES:
        assert re.search(rf"\|\s*{m.number}\s*\|.*{re.escape(m.outcome)}", readme), \
            f"README's course map lacks module {m.number} as labkit.course.outline describes it"


def test_cli_rejects_unknown_command_with_the_allowed_list():
    r = subprocess.run([sys.executable, "-m", "labkit", "frobnicate"], capture_output=True, text=True)
    assert r.returncode == 2
    assert "unknown command 'frobnicate'" in r.stderr and "doctor" in r.stderr


def test_importing_labkit_does_not_import_torch():
    code = "import labkit, labkit.cli, labkit.course.outline, labkit.validate, sys; print('torch' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert r.stdout.strip() == "False"


def test_second_setup_is_a_no_op():
    """`make lab` / `make test` install only when pyproject.toml or the Makefile changed."""
    stamp = ROOT / ".venv" / ".labkit-installed"
    if not stamp.exists():
        pytest.skip("this environment was not set up by the Makefile")
    r = subprocess.run(["make", "-q", ".venv/.labkit-installed"], cwd=ROOT)
    assert r.returncode == 0, "make would reinstall although nothing changed"
    r = subprocess.run(["make", "-n", "setup"], cwd=ROOT, capture_output=True, text=True)
    assert "pip install" not in r.stdout


@pytest.mark.slow
def test_pip_install_in_an_env_with_torch_installs_nothing_else():
    """`pip install -e .` where torch 2.13 is present resolves without touching torch."""
    r = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--no-build-isolation",
                        "--disable-pip-version-check", "-e", str(ROOT)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    would = [line for line in r.stdout.splitlines() if line.startswith("Would install")]
    assert would and "torch" not in would[0], would


def test_cpu_index_is_the_same_in_the_set_up_script_environment_yml_and_readme():
    """A conda user and a README reader get the CPU build from the index `make lab` uses."""
    script = (ROOT / "tools" / "torch_install.py").read_text()
    index = re.search(r'^CPU_INDEX = "(\S+)"', script, re.M).group(1)
    env = (ROOT / "environment.yml").read_text()
    assert f"PIP_EXTRA_INDEX_URL={index} conda env create -f environment.yml" in env
    readme = (ROOT / "README.md").read_text()
    assert f"PIP_EXTRA_INDEX_URL={index}" in readme and f"--index-url {index} torch==" in readme
    assert "tools/torch_install.py" in (ROOT / "Makefile").read_text()


@pytest.mark.parametrize("code, make_fails", [(0, False), (1, False), (2, True), (130, True)])
def test_make_grade_ends_a_partial_grade_on_its_score_not_a_make_error(tmp_path, code,
                                                                      make_fails):
    """Issue 28, item 12: a partial grade (labkit grade's exit 1) ended on `make: *** [Makefile:52:
    grade] Error 1`. It ends on the score now; a notebook that cannot be graded (2) or an
    interrupt (128 + signal) still fails. labkit grade is replaced by a script with that exit."""
    import shutil

    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    fake = tmp_path / "python"
    fake.write_text(f"#!/bin/sh\necho \"Score: 3 of 5 checks pass ($*)\"\nexit {code}\n")
    fake.chmod(0o755)
    stamp = tmp_path / "installed"            # newer than the Makefile: no set-up runs
    stamp.touch()
    r = subprocess.run(["make", "grade", "NB=exercises/01_memory_math.ipynb", f"PY={fake}",
                        f"STAMP={stamp}"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert "Score: 3 of 5 checks pass (-m labkit grade exercises/01_memory_math.ipynb)" in r.stdout
    assert (r.returncode != 0) == make_fails, r.stdout + r.stderr
    if not make_fails:
        assert "Error" not in r.stdout + r.stderr, r.stdout + r.stderr


# ---------------------------------------------------------------------------------------------
# What a learner sees when opening a notebook in JupyterLab

COURSE_DIRS = ("notebooks/", "solutions/", "exercises/")
LINK = re.compile(r"\]\(([^)\s#]+\.ipynb)(?:#[^)]*)?\)")


def _metadata_problem(path) -> str:
    """'' when the notebook at `path` is in the form JupyterLab leaves untouched on opening,
    else what differs."""
    from labkit.course.exercises import NOTEBOOK_METADATA

    nb = json.loads(path.read_text(encoding="utf-8"))
    if (nb.get("nbformat"), nb.get("nbformat_minor")) != (4, 5):
        return f"nbformat {nb.get('nbformat')}.{nb.get('nbformat_minor')}, JupyterLab writes 4.5"
    if nb.get("metadata") != NOTEBOOK_METADATA:
        return f"metadata {nb.get('metadata')}, JupyterLab writes {NOTEBOOK_METADATA}"
    if any("id" not in cell for cell in nb.get("cells", [])):
        return "cells without an id (JupyterLab adds them)"
    return ""


def test_notebooks_carry_the_metadata_jupyterlab_writes_when_they_open(tmp_path):
    """Once a notebook's kernel starts, JupyterLab writes the kernel's kernelspec and
    language_info into it and, if that changed anything, marks the tab modified and autosaves
    it: a notebook committed with `language_info: {name: python}` showed the dot about 3 s after
    opening (tests/course/test_browser_run_all.py sees it in a browser). Every course notebook
    carries what ipykernel reports. A notebook passes when its committed copy or its working copy
    does: a learner's JupyterLab under another Python rewrites "version" in the working copy,
    and a maintainer's edit is judged before it is committed."""
    from ipykernel.ipkernel import IPythonKernel

    from labkit.course.exercises import NOTEBOOK_METADATA

    reported = {k: v for k, v in IPythonKernel.language_info.items() if k != "version"}
    ours = {k: v for k, v in NOTEBOOK_METADATA["language_info"].items() if k != "version"}
    assert ours == reported, (f"ipykernel now reports language_info {IPythonKernel.language_info}: "
                              "update labkit.course.exercises.LANGUAGE_INFO and the notebooks")
    bad = {}
    for name, committed in committed_notebooks(ROOT, tmp_path):
        if not name.startswith(COURSE_DIRS):
            continue
        problems = [_metadata_problem(p) for p in dict.fromkeys((committed, ROOT / name))
                    if p.exists()]
        if problems and all(problems):
            bad[name] = problems[0]
    assert not bad, f"notebooks JupyterLab would mark modified on opening: {bad}"


def test_the_metadata_check_catches_jupyter_s_minimal_language_info(tmp_path):
    path = tmp_path / "minimal.ipynb"
    path.write_text(json.dumps({"cells": [], "nbformat": 4, "nbformat_minor": 5, "metadata": {
        "kernelspec": {"display_name": "Python 3 (ipykernel)", "language": "python",
                       "name": "python3"}, "language_info": {"name": "python"}}}))
    assert "JupyterLab writes" in _metadata_problem(path)


def _lessons():
    return sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))


def _markdown(path) -> list[str]:
    nb = json.loads(path.read_text(encoding="utf-8"))
    return ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "markdown"]


def _broken(links, base) -> list[str]:
    return [link for link in links if not (base / link).resolve().exists()]


def test_welcome_map_links_every_lesson_and_its_exercises():
    """The course map in 00_welcome is markdown (shown before anything runs), with a working
    relative link to every lesson in notebooks/ and to its exercises file, and each module's
    outcome as labkit.course.outline says it."""
    from labkit.course.outline import MODULES

    welcome = ROOT / "notebooks" / "00_welcome.ipynb"
    maps = [text for text in _markdown(welcome) if "The map" in text and "| # |" in text]
    assert len(maps) == 1, "00_welcome needs one markdown cell with the course map (a table)"
    links = LINK.findall(maps[0])
    missing = []
    for lesson in _lessons():
        if lesson.name not in links:
            missing.append(lesson.name)
        if (ROOT / "exercises" / lesson.name).exists() and f"../exercises/{lesson.name}" not in links:
            missing.append(f"../exercises/{lesson.name}")
    assert not missing, f"the course map in 00_welcome does not link {missing}"
    assert not _broken(links, welcome.parent), f"broken links in the map: {_broken(links, welcome.parent)}"
    for m in MODULES:
        assert m.outcome in maps[0], f"the map lacks module {m.number}'s outcome as outline says it"
    nb = json.loads(welcome.read_text(encoding="utf-8"))
    assert not any("markdown_table" in "".join(c["source"]) for c in nb["cells"]
                   if c["cell_type"] == "code"), "the map is markdown, not the output of a code cell"


def test_every_lesson_says_how_long_it_runs_and_ends_with_links_and_the_shutdown_note():
    """A lesson's first cell says how long Run All takes; its last cell links its exercises, the
    previous and the next lesson, and says to shut the kernel down (and why)."""
    lessons = _lessons()
    problems = {}
    for i, lesson in enumerate(lessons):
        cells = json.loads(lesson.read_text(encoding="utf-8"))["cells"]
        first, last = "".join(cells[0]["source"]), "".join(cells[-1]["source"])
        want = {lessons[j].name for j in (i - 1, i + 1) if 0 <= j < len(lessons)}
        if (ROOT / "exercises" / lesson.name).exists():
            want.add(f"../exercises/{lesson.name}")
        links = LINK.findall(last) if cells[-1]["cell_type"] == "markdown" else []
        wrong = [f"no link to {w}" for w in sorted(want - set(links))]
        wrong += [f"broken link {b}" for b in _broken(links, lesson.parent)]
        if "Run All: about" not in first:
            wrong.append("the first cell does not say how long Run All takes")
        if "Kernel > Shut Down Kernel" not in last or "memory" not in last:
            wrong.append("the last cell does not say to shut the kernel down, and why")
        if wrong:
            problems[lesson.name] = wrong
    assert not problems, problems
