""""Diagnose this run" (module 09): cases whose evidence comes from running real labs with a fault
or a misconfiguration injected, a question about the cause, and a checked answer.

    python -m labkit.labs.diagnose straggler --seed 0 --answer b     # in a terminal

From Python: `build`, `plan` and `Case` (the calls: labkit.labs.diagnose's docstring). Each case
runs its labs through labkit.runtime.launch.run_lab (2-4 ranks, tiny transformers models), so
every number in it is measured in this run; the evidence's keys: `Case`. What each case runs
and how its numbers are predicted: docs/labs.md, ## diagnose.
"""
from __future__ import annotations

import random
import string
from dataclasses import dataclass, field
from numbers import Integral

from labkit import validate

CASES = ("straggler", "small-buckets", "few-microbatches", "activation-oom",
         "skipped-collective")
# module:function of each case's builder (NAME_plan beside it), imported when first needed
BUILDERS = {"straggler": "cases:straggler",
            "small-buckets": "cases:small_buckets",
            "few-microbatches": "cases:few_microbatches",
            "activation-oom": "failures:activation_oom",
            "skipped-collective": "failures:skipped_collective"}


@dataclass
class Case:
    """One diagnosis case: the evidence of a run, a multiple-choice question about it, and why
    each option is right or wrong (with numbers from the evidence).

    Evidence, only the keys that apply: "log" (the ranks' "[rank R]" output, and for a failed
    run the launcher's failure message), "error" (the exception text a rank raised: gloo's, or
    torch.OutOfMemoryError's), "step_times" ({label: [seconds per step]}, a label per rank or
    per configuration), "timeline" ([{rank, kind, start, end[, lane]}]: seconds on one clock),
    "pipeline" ({run: [pipeline events]}), "memory" ({"budget", "by_batch", "failed"}: bytes)."""

    name: str
    title: str
    question: str
    options: list
    answer: int                   # index of the correct option
    why: list                     # one reason per option, in the options' order
    evidence: dict
    numbers: dict = field(default_factory=dict)
    seed: int = 0

    @property
    def letters(self) -> list[str]:
        return list(string.ascii_lowercase[:len(self.options)])

    def index(self, answer) -> int:
        """The option index of `answer`: a letter ("b", "B", "(b)") or an index (1)."""
        n = len(self.options)
        if isinstance(answer, str):
            key = answer.strip().strip("()").strip().lower()
            if len(key) == 1 and key in self.letters:
                return self.letters.index(key)
        elif isinstance(answer, Integral) and not isinstance(answer, bool):
            if 0 <= answer < n:
                return int(answer)
        raise ValueError(f"answer={validate.describe(answer)} is not one of the options; "
                         f"allowed: a letter {', '.join(self.letters)} or an index 0 to {n - 1}")

    def check(self, answer) -> tuple[bool, str]:
        """(ok, message): the message says why the chosen option is right or wrong."""
        i = self.index(answer)
        ok = i == self.answer
        head = "Right" if ok else "Not"
        return ok, f"{head}: ({self.letters[i]}) {self.why[i]}"

    def text(self) -> str:
        """The question and its lettered options, as the notebook shows them."""
        return "\n".join([self.question] + [f"  ({c}) {o}" for c, o in
                                            zip(self.letters, self.options)])

    def figure(self) -> bytes | None:
        """PNG bytes of the evidence (labkit.plots.diagnose.evidence_figure), or None."""
        from labkit.plots import png_bytes
        from labkit.plots.diagnose import evidence_figure

        fig = evidence_figure(self.evidence)
        return None if fig is None else png_bytes(fig)


def _draw(name: str, seed) -> tuple:
    """(builder, plan, order): the case's builder, its plan drawn from the seed (parameters,
    title, question, options with the correct one first) and the options' shuffled order."""
    import importlib

    validate.choice("name", name, CASES)
    if not isinstance(seed, Integral) or isinstance(seed, bool) or not 0 <= seed < 2**31:
        raise ValueError(f"seed={validate.describe(seed)} must be a whole number from 0 to "
                         f"{2**31 - 1}")
    rng = random.Random(f"labkit.diagnose:{name}:{int(seed)}")
    module, func = BUILDERS[name].split(":")
    mod = importlib.import_module(f"labkit.labs.diagnose.{module}")
    drawn = getattr(mod, f"{func}_plan")(rng)
    order = list(range(len(drawn["options"])))
    rng.shuffle(order)
    return getattr(mod, func), drawn, order


def plan(name: str, seed: int = 0) -> dict:
    """What `build(name, seed)` will ask, without running anything: name, title, question,
    options (in the order build gives them) and answer (the correct option's index)."""
    _, drawn, order = _draw(name, seed)
    return dict(name=name, title=drawn["title"], question=drawn["question"],
                options=[drawn["options"][i] for i in order], answer=order.index(0))


def build(name: str, seed: int = 0, *, timeout: float = 240.0, env: dict | None = None) -> Case:
    """Run case `name`'s lab(s) with its fault injected and return the Case. seed: draws the
    fault's parameters, the labs' seeds and the options' order (the same seed gives the same
    question and options, `plan`; the measured numbers differ from run to run). timeout:
    seconds each lab may take (the first lab of a process also pays the warm pool's imports).
    env: extra environment variables for the ranks (run_lab's env=)."""
    timeout = validate.positive("timeout", timeout, 3600)
    builder, drawn, order = _draw(name, seed)
    made = builder(drawn, int(seed), timeout, env)
    return Case(name=name, title=drawn["title"], question=drawn["question"],
                options=[drawn["options"][i] for i in order], answer=order.index(0),
                why=[made["why"][i] for i in order], evidence=made["evidence"],
                numbers=made["numbers"], seed=int(seed))


def main(argv: list[str] | None = None) -> None:
    """`python -m labkit.labs.diagnose CASE [--seed N] [--answer LETTER]`: build the case, print
    its log, question and options, and check an answer if given."""
    import argparse

    from labkit.runtime import dist

    p = argparse.ArgumentParser(description="Build a 'diagnose this run' case (its labs run "
                                            "on ranks it starts) and print its question")
    p.add_argument("case", choices=CASES)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--answer", help="an answer to check: a letter")
    args = p.parse_args(argv)
    if dist.under_torchrun():
        p.error("this is not a lab program: it starts the labs' ranks itself; run it as "
                "python -m labkit.labs.diagnose CASE")
    try:
        case = build(args.case, args.seed)
        print(case.evidence["log"], case.text(), sep="\n\n")
        if args.answer:
            print(case.check(args.answer)[1])
    except ValueError as exc:
        p.error(str(exc))


if __name__ == "__main__":
    main()
