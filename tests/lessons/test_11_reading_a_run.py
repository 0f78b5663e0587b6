"""notebooks/11_reading_a_run.ipynb as a learner runs it (Run All, a busy laptop): see learner_eye.py."""
import pytest

from learner_eye import run_lesson


@pytest.mark.notebook
@pytest.mark.slow
def test_reading_a_run_runs_as_a_learner_sees_it():
    problems = run_lesson("11_reading_a_run.ipynb")
    assert not problems, "\n".join(problems)
