"""The learner's-eye tier is shown to fail where a learner would see a problem, and every lesson
has its test file."""
from pathlib import Path

import nbformat
import pytest

from learner_eye import ROOT, drawing_functions, figure_calls, run_lesson


def test_every_lesson_has_its_learner_eye_test():
    here = Path(__file__).parent
    for nb in sorted((ROOT / "notebooks").glob("*.ipynb")):
        test = here / f"test_{nb.stem}.py"
        assert test.exists(), f"{nb.name} has no {test.relative_to(ROOT)}"
        assert f'run_lesson("{nb.name}")' in test.read_text(), test


def test_figure_calls_are_found_by_what_labkit_plots_imports():
    names, modules = {}, {}
    assert figure_calls("from labkit.plots import png_bytes, fmt_bytes\nx = png_bytes(f)",
                        names, modules) == []
    assert figure_calls("from labkit.plots import pipeline as pipe_plots\npipe_plots.gantt(r);",
                        names, modules) == ["pipe_plots.gantt"]
    assert figure_calls("fig = pipe_plots.side_by_side(a, b)", names, modules) == \
        ["pipe_plots.side_by_side"]
    assert figure_calls("from labkit.plots.mesh import mesh_figure\nmesh_figure(d)", names,
                        modules) == ["mesh_figure"]
    assert figure_calls("case.figure()", names, modules) == [".figure()"]
    # a labkit.plots function that returns data, not a figure (lesson 02's ring steps)
    assert figure_calls("from labkit.plots import comm as pc\nsteps = pc.ring_all_reduce_steps(4)",
                        names, modules) == []
    assert figure_calls("pc.ring_steps_figure(steps)", names, modules) == ["pc.ring_steps_figure"]
    assert "labkit.plots.pipeline.gantt" in drawing_functions()      # through a helper too
    assert figure_calls("%%torchrun -n 2\nprint(1)", names, modules) == []


@pytest.mark.notebook
def test_the_tier_names_a_raise_a_hidden_figure_a_stray_warning_and_a_silence(tmp_path):
    cells = [
        "import warnings\nwarnings.warn('the frobnicator is deprecated')",
        "from matplotlib.figure import Figure\nFigure()",
        "from labkit.plots.pipeline import gantt\nfrom labkit.pipeline import simulate\n"
        "fig = gantt(simulate('1f1b', stages=2, microbatches=2)); print('drawn')",
        "import time\ntime.sleep(3)",
        "raise ValueError('learner sees a traceback')",
    ]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    path = tmp_path / "bad.ipynb"
    nbformat.write(nb, str(path))
    problems = "\n".join(run_lesson(path, silence_s=2.0, burners=0))
    assert "cell 0" in problems and "UserWarning" in problems and "frobnicator" in problems
    assert "cell 1" in problems and "<Figure size" in problems
    assert "cell 3" in problems and "silent for 3 s" in problems
    # labkit.plots figures display themselves (issue 28): an assigned one is shown
    assert "cell 2" not in problems
    assert "a cell raised" in problems and "learner sees a traceback" in problems


@pytest.mark.notebook
def test_a_warning_the_lesson_discusses_passes(tmp_path):
    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_markdown_cell("torch will say *The frobnicator is deprecated here*: why."),
        nbformat.v4.new_code_cell("import warnings\nwarnings.warn('The frobnicator is deprecated here')")])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    path = tmp_path / "ok.ipynb"
    nbformat.write(nb, str(path))
    assert run_lesson(path, burners=0) == []
