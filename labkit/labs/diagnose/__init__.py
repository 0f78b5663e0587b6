""""Diagnose this run" (module 09): cases whose evidence comes from running real labs with a fault
or a misconfiguration injected, a question about the cause, and a checked answer.

    from labkit.labs.diagnose import CASES, build, Case
    case = build("slow-steps", seed=0)     # runs the lab(s) now: a few seconds
    case.question, case.options            # the options are lettered a, b, ... in the notebook
    case.evidence                          # what a learner would get (its keys: `Case`)
    case.figure()                          # PNG bytes of the evidence (labkit.plots.diagnose)
    case.check("b")                        # (ok, message): why that option is right or wrong
    case.numbers                           # the figures the explanations quote
    plan("slow-steps", seed=0)             # the question and options alone, nothing run
"""
from labkit.labs.diagnose.lab import main, CASES, Case, build, plan

__all__ = ['main', 'CASES', 'Case', 'build', 'plan']
