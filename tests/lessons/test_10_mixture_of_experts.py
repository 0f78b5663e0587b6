"""notebooks/10_mixture_of_experts.ipynb as a learner runs it (Run All, a busy laptop): see learner_eye.py."""
import pytest

from learner_eye import run_lesson


@pytest.mark.notebook
@pytest.mark.slow
def test_mixture_of_experts_runs_as_a_learner_sees_it():
    problems = run_lesson("10_mixture_of_experts.ipynb")
    assert not problems, "\n".join(problems)
