"""labkit.quiz: the interview question bank (module 09). Questions are YAML data in
`labkit/quiz/data/`; each names a labkit function in `labkit/quiz/answers_*.py` that computes its
answer at draw time, so no answer is typed in.

    from labkit.quiz import load_bank, get, select, score
    a = get("zero-states-per-gpu").draw(seed=7); a.statement; a.check("12.5 GB")

Layer 1 (cost): pure Python. May import only the cost models (labkit.memory, labkit.comm, ...)
and pyyaml; never torch, ipywidgets or matplotlib.
"""
from labkit.quiz.bank import (TOPICS, Attempt, Question, Score, Verdict, get, load_bank, score,
                              select)

__all__ = ["TOPICS", "Attempt", "Question", "Score", "Verdict", "get", "load_bank", "score",
           "select"]
