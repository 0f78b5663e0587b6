""""Diagnose this run" (module 09): cases whose evidence comes from running real labs with a fault
or a misconfiguration injected, a question about the cause, and a checked answer.

    python -m labkit.labs.diagnose slow-steps --seed 0        # asks for the answer on a terminal
    python -m labkit.labs.diagnose slow-steps --seed 0 --answer b

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

# Named by what the run shows, never by its cause (the cause is the question's answer).
CASES = ("slow-steps", "bucket-slowdown", "idle-pipeline", "out-of-memory", "hang-then-timeout")
# module:function of each case's builder (NAME_plan beside it), imported when first needed
BUILDERS = {"slow-steps": "cases:straggler",
            "bucket-slowdown": "cases:small_buckets",
            "idle-pipeline": "cases:few_microbatches",
            "out-of-memory": "failures:activation_oom",
            "hang-then-timeout": "failures:skipped_collective"}
# The cases' first names, which named the answer: still accepted (module 09's exercise and the
# README use them), never listed.
ALIASES = {"straggler": "slow-steps", "small-buckets": "bucket-slowdown",
           "few-microbatches": "idle-pipeline", "activation-oom": "out-of-memory",
           "skipped-collective": "hang-then-timeout"}


def case_name(name) -> str:
    """The case `name` stands for (a name of CASES, or a first name in ALIASES); ValueError
    listing CASES for anything else."""
    if isinstance(name, str) and name in ALIASES:
        return ALIASES[name]
    return validate.choice("name", name, CASES)


def option_index(answer, count: int) -> int:
    """The index of `answer` among `count` lettered options: a letter ("b", "B", "(b)") or an
    index (1); ValueError saying what is allowed."""
    letters = string.ascii_lowercase[:count]
    if isinstance(answer, str):
        key = answer.strip().strip("()").strip().lower()
        if len(key) == 1 and key in letters:
            return letters.index(key)
    elif isinstance(answer, Integral) and not isinstance(answer, bool):
        if 0 <= answer < count:
            return int(answer)
    raise ValueError(f"answer={validate.describe(answer)} is not one of the options; "
                     f"allowed: a letter {', '.join(letters)} or an index 0 to {count - 1}")


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
        return option_index(answer, len(self.options))

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

    name = case_name(name)
    if not isinstance(seed, Integral) or isinstance(seed, bool) or not 0 <= seed < 2**31:
        raise ValueError(f"seed={validate.describe(seed)} must be a whole number from 0 to "
                         f"{2**31 - 1}")
    # keyed by the case's first name, so a seed draws the same case as it did before the rename
    first = next(old for old, new in ALIASES.items() if new == name)
    rng = random.Random(f"labkit.diagnose:{first}:{int(seed)}")
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
    from labkit.runtime import progress

    timeout = validate.positive("timeout", timeout, 3600)
    builder, drawn, order = _draw(name, seed)
    with progress.task(f"diagnosis case {name!r}"):     # one live line for the case's labs
        made = builder(drawn, int(seed), timeout, env)
    return Case(name=name, title=drawn["title"], question=drawn["question"],
                options=[drawn["options"][i] for i in order], answer=order.index(0),
                why=[made["why"][i] for i in order], evidence=made["evidence"],
                numbers=made["numbers"], seed=int(seed))


def _is_tty(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def ask(case: Case, stdin, out) -> str | None:
    """Read an answer to `case` from `stdin` (a terminal), asking again until it is one of the
    letters; None at the end of the input (Ctrl-D) or on Ctrl-C."""
    letters = ", ".join(case.letters)
    while True:
        print(f"your answer ({letters})> ", end="", file=out, flush=True)
        try:
            line = stdin.readline()
        except KeyboardInterrupt:
            return None
        if not line:
            return None
        try:
            case.index(line.strip())
        except ValueError:
            print(f"{line.strip()!r} is not one of the options; answer with a letter: "
                  f"{letters}", file=out)
            continue
        return line.strip()


def main(argv: list[str] | None = None, stdin=None, out=None) -> None:
    """`python -m labkit.labs.diagnose CASE [--seed N] [--answer LETTER]`: check the case, the
    seed and the answer (before any lab runs), build the case, print its log, question and
    options, then check the answer: --answer's, else one asked for on a terminal; with no
    terminal (output piped), it says how to give one."""
    import argparse
    import sys

    from labkit.runtime import dist

    stdin = sys.stdin if stdin is None else stdin
    out = sys.stdout if out is None else out
    p = argparse.ArgumentParser(description="Build a 'diagnose this run' case (its labs run "
                                            "on ranks it starts), print its evidence and "
                                            "question, and check your answer")
    p.add_argument("case", metavar="CASE", help=f"the case: {', '.join(CASES)}")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--answer", help="your answer, a letter (default: asked for on a terminal, "
                                    "after the evidence)")
    args = p.parse_args(argv)
    if dist.under_torchrun():
        p.error("this is not a lab program: it starts the labs' ranks itself; run it as "
                "python -m labkit.labs.diagnose CASE")
    try:
        asked = plan(args.case, args.seed)            # runs nothing: the name and the seed
    except ValueError as exc:
        p.error(str(exc))
    letters = list(string.ascii_lowercase[:len(asked["options"])])
    if args.answer is not None and args.answer.strip().strip("()").strip().lower() not in letters:
        p.error(f"--answer={args.answer!r} is not one of the options; allowed: a letter "
                f"{', '.join(letters)}")                # refused now, not after the labs ran
    case = build(args.case, args.seed)
    print(case.evidence["log"], case.text(), sep="\n\n", file=out)
    answer = args.answer
    if answer is None and _is_tty(stdin):
        answer = ask(case, stdin, out)
    if answer is None:
        print(f"\nTo check an answer: python -m labkit.labs.diagnose {case_name(args.case)} "
              f"--seed {args.seed} --answer LETTER (one of {', '.join(case.letters)})",
              file=out)
        return
    print(case.check(answer)[1], file=out)


if __name__ == "__main__":
    main()
