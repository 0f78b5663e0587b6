"""`labkit quiz`: the interview question bank (`labkit.quiz`) in the terminal: each answer is
checked by the bank, then the worked explanation; at the end the score by topic and difficulty.

    labkit quiz                                  # 10 questions from the whole bank
    labkit quiz --topic pp tp --difficulty 2 --count 5 --seed 7
    labkit quiz --timed 60                       # an answer after 60 s counts as wrong
    labkit quiz --list                           # questions per topic and difficulty
    printf '12.5\\nb\\n' | labkit quiz --count 2 --seed 7    # answers piped in

A line that is no answer (empty, not a number, not an option) is not scored: it says why and
asks again. Exit 0 after a session (or --list), 2 on bad arguments. Piping, seeds: `run`.
"""
from __future__ import annotations

import argparse
import random
import sys
import time

DEFAULT_COUNT = 10
MAX_SECONDS = 3600          # --timed: 1 s to an hour per question
SEED_RANGE = 2**31          # a session's seed when none is given: random below this


def add_arguments(parser):
    parser.add_argument("--topic", nargs="+", action="extend", metavar="T",
                        help="only these topics (one or more; default: all)")
    parser.add_argument("--difficulty", nargs="+", action="extend", metavar="D",
                        help="only these difficulties: 1 easy, 2 medium, 3 hard (default: all)")
    parser.add_argument("--count", default=None,
                        help=f"questions in the session (default {DEFAULT_COUNT}, or all there "
                        "are when fewer)")
    parser.add_argument("--seed", default=None,
                        help="a whole number: the same seed gives the same questions and numbers "
                        "(default: a new one each time, printed)")
    parser.add_argument("--timed", default=None, metavar="SECONDS",
                        help="seconds allowed per question; a later answer counts as wrong")
    parser.add_argument("--list", action="store_true",
                        help="print how many questions the bank has per topic and difficulty")


def _whole(name: str, text, low: int, high: int | None) -> int:
    """`text` as a whole number in [low, high], or ValueError naming the flag and the range."""
    allowed = f"a whole number from {low:,}" + (f" to {high:,}" if high is not None else "")
    try:
        value = int(str(text).strip())
    except ValueError:
        raise ValueError(f"{name}={text!r} is not a whole number; allowed: {allowed}") from None
    if value < low or (high is not None and value > high):
        raise ValueError(f"{name}={value} is out of range; allowed: {allowed}")
    return value


def options(args) -> dict:
    """The session's settings from the parsed arguments: topic, difficulty (lists or None),
    count, seed, allowed seconds (None untimed). ValueError naming the flag and what is allowed."""
    from labkit.quiz import TOPICS, select

    topics = list(dict.fromkeys(args.topic)) if args.topic else None
    for t in topics or []:
        if t not in TOPICS:
            raise ValueError(f"--topic={t!r} is not a topic; allowed: {', '.join(TOPICS)}")
    levels = None
    if args.difficulty:
        levels = list(dict.fromkeys(_whole("--difficulty", d, 1, 3) for d in args.difficulty))
    seed = None if args.seed is None else _whole("--seed", args.seed, 0, None)
    allowed = None if args.timed is None else _whole("--timed", args.timed, 1, MAX_SECONDS)
    available = len(select(topic=topics, difficulty=levels))
    if available == 0:
        raise ValueError(f"no question has --topic {' '.join(topics or ['(any)'])} and "
                         f"--difficulty {' '.join(map(str, levels or ['(any)']))}; pick others")
    if args.count is None:
        count = min(DEFAULT_COUNT, available)
    else:
        count = _whole("--count", args.count, 1, available)
    return dict(topic=topics, difficulty=levels, count=count, seed=seed, allowed=allowed)


def draw_session(topic=None, difficulty=None, count=None, seed=None) -> list:
    """The attempts of one session: `count` questions picked by the bank (seeded), each drawn
    with the same seed (as labkit.widgets.quiz.draw_session: the same quiz for a seed)."""
    from labkit.quiz import select

    return [q.draw(seed=seed) for q in select(topic=topic, difficulty=difficulty, count=count,
                                              seed=seed)]


def _print_question(number: int, total: int, a, allowed, out) -> None:
    q = a.question
    timed = f" · {allowed} s to answer" if allowed is not None else ""
    print(f"\nQuestion {number} of {total} · {q.topic} · difficulty {q.difficulty}{timed}",
          file=out)
    print(a.statement, file=out)
    if a.kind == "choice":
        for i, text in enumerate(a.options):
            print(f"  ({chr(ord('a') + i)}) {text}", file=out)
        print("Answer with a letter.", file=out)
    elif a.unit:
        print(f"Answer in {a.unit}.", file=out)
    print("answer> ", end="", file=out, flush=True)


def _print_verdict(a, v, out) -> None:
    print(f"[{'right' if v.correct else 'wrong'}] {v.message}", file=out)
    print(f"Answer: {a.expected_text}", file=out)
    print(a.explanation, file=out)
    claim = a.article_claim
    if claim:
        print(f"A popular article, {claim['source']}, says {claim['wrong']}; that is wrong: "
              f"{claim['why']}", file=out)


def _is_tty(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def _read(stdin) -> str | None:
    """One line of `stdin`, or None at the end of the input (or on Ctrl-C)."""
    try:
        line = stdin.readline()
    except KeyboardInterrupt:                          # Ctrl-C: stop here, still score
        return None
    return line or None


def _verdict(a, given: str, elapsed: float, allowed):
    """The bank's verdict on `given`, or "time up" (wrong) past the `allowed` seconds."""
    from labkit.quiz import Verdict

    if allowed is not None and elapsed > allowed:
        return Verdict(correct=False, expected=a.expected, given=given,
                       message=f"time up: answered after {elapsed:,.1f} s; {allowed:,g} s "
                       "allowed")
    return a.check(given)


def ask(session: list, stdin, out, allowed=None, clock=time.monotonic) -> list:
    """Ask each Attempt of `session`, reading a line of `stdin` per answer; returns the
    (Attempt, Verdict) of every question: at the end of the input the rest are unanswered
    (wrong). A line that is no answer (empty, not a number, not an option) is not scored: the
    reason is printed and the question asked again, its answer not shown. With `allowed`
    seconds, an answer read later than that after its question was printed is wrong ("time
    up"); `clock` is read then (a test passes a fake one)."""
    from labkit.quiz import Verdict

    answered = []
    for number, a in enumerate(session, 1):
        _print_question(number, len(session), a, allowed, out)
        shown = clock()
        while True:
            line = _read(stdin)
            if line is None:                           # end of input
                break
            given = line.strip()
            if not _is_tty(stdin):
                print(given, file=out)                 # echo a piped answer after the prompt
            v = _verdict(a, given, clock() - shown, allowed)
            if v.readable:
                break
            print(f"Not an answer yet: {v.message}. Try again.", file=out)
            print("answer> ", end="", file=out, flush=True)
        if line is None:
            print("\n(end of input: this question and the rest are unanswered)", file=out)
            answered += [(b, Verdict(correct=False, expected=b.expected, given=None,
                                     message="unanswered (end of input)"))
                         for b in session[number - 1:]]
            break
        answered.append((a, v))
        _print_verdict(a, v, out)
    return answered


def print_score(answered: list, seed: int, out) -> None:
    """The score ('Score: 7/10 (70 %)', labkit.quiz.Score's summary, by topic and difficulty)
    and the seed that repeats the session."""
    from labkit.quiz import score

    print(f"\n{score(answered)}", file=out)
    print(f"seed {seed}: --seed {seed} asks the same questions again", file=out)


def print_list(topic, difficulty, out) -> None:
    """Questions per topic (rows) and difficulty (columns), with the totals."""
    from labkit.quiz import TOPICS, select

    qs = select(topic=topic, difficulty=difficulty)
    levels = (1, 2, 3)
    width = max(len(t) for t in TOPICS + ("total",))
    print(f"{'topic':<{width}}  " + "  ".join(f"d{d:<3}" for d in levels) + "  total",
          file=out)
    for t in TOPICS:
        n = [sum(q.topic == t and q.difficulty == d for q in qs) for d in levels]
        if sum(n):
            print(f"{t:<{width}}  " + "  ".join(f"{x:<4}" for x in n) + f"  {sum(n)}", file=out)
    n = [sum(q.difficulty == d for q in qs) for d in levels]
    print(f"{'total':<{width}}  " + "  ".join(f"{x:<4}" for x in n) + f"  {len(qs)}", file=out)


def run(args, stdin=None, out=None, clock=time.monotonic) -> int:
    """Ask each question (numbered, with its unit or lettered options), read one answer line
    from `stdin`, print the bank's verdict and the worked explanation; then the score. Answers
    may be piped in: at the end of the input the remaining questions count as unanswered and
    the score is still printed. A seed gives the same questions as the quiz widget with that
    seed (both call the bank as `draw_session` says)."""
    stdin = sys.stdin if stdin is None else stdin
    out = sys.stdout if out is None else out
    try:
        o = options(args)
    except ValueError as exc:
        print(f"labkit quiz: {exc}", file=sys.stderr)
        return 2
    if args.list:
        print_list(o["topic"], o["difficulty"], out)
        return 0
    seed = o["seed"] if o["seed"] is not None else random.randrange(SEED_RANGE)
    session = draw_session(o["topic"], o["difficulty"], o["count"], seed)
    answered = ask(session, stdin, out, o["allowed"], clock)
    print_score(answered, seed, out)
    return 0


def main(argv=None) -> int:
    """`python -m labkit.cli.quiz ...`, the same as `labkit quiz ...`."""
    parser = argparse.ArgumentParser(prog="labkit quiz", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
