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


def _notebooks():
    out = subprocess.run(["git", "ls-files", "*.ipynb"], cwd=ROOT, capture_output=True, text=True)
    tracked = [ROOT / p for p in out.stdout.split()] if out.returncode == 0 else []
    return tracked or sorted(ROOT.glob("*/**/*.ipynb"))


def test_notebooks_are_committed_without_outputs():
    notebooks = [p for p in _notebooks() if ".ipynb_checkpoints" not in p.parts]
    assert notebooks, "no notebooks found"
    # nbstripout --verify exits non-zero when a notebook has outputs or execution counts
    # (--keep-id: cell ids are ours to choose; only outputs and counts matter).
    # One nbstripout for all of them (a start each cost 85 s on a busy 2-core machine); only
    # when it fails, one per notebook to name the culprits.
    verify = [sys.executable, "-m", "nbstripout", "--verify", "--keep-id"]
    r = subprocess.run(verify + [str(p) for p in notebooks], capture_output=True, text=True)
    if r.returncode == 0:
        return
    bad = [str(p.relative_to(ROOT)) for p in notebooks
           if subprocess.run(verify + [str(p)], capture_output=True).returncode != 0]
    assert not bad, f"notebooks with outputs (run `nbstripout` on them): {bad}"
    raise AssertionError(f"nbstripout --verify failed on the set but on no single notebook: "
                         f"{r.stdout}{r.stderr}")


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
