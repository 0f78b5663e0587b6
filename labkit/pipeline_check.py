"""A pipeline schedule written by hand, in torch's own notation: read it, check it with torch's
checks (torch.distributed.pipelining.schedules, 2.13) and say in words what is wrong, simulate it.

    >>> actions = read_schedule("0F0,0F1,0B0,0B1\\n,1F0,1B0,1F1,1B1")   # a row per rank
    >>> check_schedule(actions, stages=2, microbatches=2).ok            # True
    >>> simulate_schedule(actions, fwd=1.0, bwd=2.0).makespan

Notation (PipelineScheduleMulti._load_csv): row r = rank r; a field is an action "3F1" (stage 3,
forward, micro-batch 1), I input gradient, W weight gradient, B full backward (I + W), "" idle,
"(0F3;7B1)OVERLAP_F_B" a pair DualPipeV runs back to back. torch is imported inside functions.
"""
from __future__ import annotations

import contextlib
import csv
import io
import re
from dataclasses import dataclass, field
from pathlib import Path

from labkit import validate

KINDS = {"F": "forward", "I": "input gradient", "B": "full backward", "W": "weight gradient"}
OVERLAP = "OVERLAP_F_B"
MAX_STEPS = 100_000           # fields on one rank the checker reads (each costs torch some work)
_ONE = re.compile(r"(\d+)([FIBW])(\d+)")
_PAIR = re.compile(r"\(([^()]*)\)" + OVERLAP)
_COMM = re.compile(r"\d+(SEND_F|RECV_F|SEND_B|RECV_B|UNSHARD|RESHARD|REDUCE_GRAD)\d*")


# ---- reading and writing --------------------------------------------------------------------
def read_schedule(path_or_text) -> dict[int, list[str]]:
    """{rank: [action strings]} from a CSV file (a path) or its text: one row per rank (row
    index = rank, as torch's _load_csv), each field an action or "" (idle). A Path, or a str
    with no comma or newline that is not one action ("0F0"), is a file name."""
    if isinstance(path_or_text, Path) or (isinstance(path_or_text, str) and not any(
            ch in path_or_text for ch in ",\n") and isinstance(_parse(path_or_text.strip()), str)):
        path = Path(path_or_text)
        if not path.is_file():
            raise ValueError(f"schedule file {str(path)!r} does not exist; allowed: a CSV file "
                             "(a row per rank) or its text (with commas or newlines)")
        path_or_text = path.read_text()
    if not isinstance(path_or_text, str):
        raise ValueError(f"read_schedule({validate.describe(path_or_text)}): allowed: a path "
                         "or CSV text (as_actions takes dicts and lists)")
    rows = list(csv.reader(io.StringIO(path_or_text.strip("\n"))))
    return {rank: [s.strip() for s in row] for rank, row in enumerate(rows)}


def _row(rank, row) -> list[str]:
    if isinstance(row, str):             # "0F0 0F1 0B0" or "0F0,0F1,,0B0"
        return [s.strip() for s in (row.split(",") if "," in row else row.split())]
    try:                                 # torch's _Action: its bookkeeping (REDUCE_GRAD) is idle
        return ["" if a is None or getattr(a, "is_compute_op", True) is False else str(a).strip()
                for a in row]
    except TypeError:
        raise ValueError(f"rank {rank}'s actions {validate.describe(row)}: allowed: a list of "
                         "action strings or a string of them") from None


def as_actions(obj) -> dict[int, list[str]]:
    """{rank: [action strings]} from what a notebook cell may hold: a dict {rank: "0F0 0F1 ..."}
    (spaces or commas between actions) or {rank: [...]}, a list of rows, CSV text or a path
    (`read_schedule`), or torch's own pipeline_order ({rank: [_Action or None]}: its actions
    other than compute, such as REDUCE_GRAD, become idle fields)."""
    if isinstance(obj, (str, Path)):
        return read_schedule(obj)
    if isinstance(obj, dict):
        items = list(obj.items())
    elif isinstance(obj, (list, tuple)):
        items = list(enumerate(obj))
    else:
        raise ValueError(f"schedule {validate.describe(obj)}: allowed: a dict {{rank: actions}}, "
                         "a list of rows, CSV text or a path")
    out = {}
    for rank, row in items:
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
            raise ValueError(f"rank {rank!r} is not a rank; allowed: whole numbers 0, 1, ...")
        out[rank] = _row(rank, row)
    return dict(sorted(out.items()))


def write_schedule(actions, path) -> Path:
    """Write `actions` (anything `as_actions` takes) as torch's CSV, a row per rank (ranks
    without a row get an empty one); returns the path."""
    rows = as_actions(actions)
    path = Path(path)
    with path.open("w", newline="") as out:
        writer = csv.writer(out)
        for rank in range(max(rows, default=-1) + 1):
            writer.writerow(rows.get(rank, []))
    return path


# ---- parsing --------------------------------------------------------------------------------
def _parse(text: str):
    """An action string -> tuple of (stage, kind, microbatch) (two for an overlapped pair, none
    for idle), or a str saying what is wrong."""
    if text == "":
        return ()
    if m := _ONE.fullmatch(text):
        return ((int(m[1]), m[2], int(m[3])),)
    if m := _PAIR.fullmatch(text):
        subs = [s.strip() for s in m[1].split(";")]
        parts = [_ONE.fullmatch(s) for s in subs]
        if len(subs) >= 2 and all(parts):
            return tuple((int(p[1]), p[2], int(p[3])) for p in parts)
        return (f"is not an overlapped pair: write (forward;backward){OVERLAP}, e.g. "
                f"(0F3;7B1){OVERLAP}")
    if _COMM.fullmatch(text):
        return ("is a communication action: torch adds sends, receives and gradient reductions "
                "itself; write compute actions only (F, I, B, W)")
    if re.fullmatch(r"\d+[FIBW]", text):
        return "has no micro-batch: write stage, kind, micro-batch, e.g. 0F1"
    return ("is not an action: write stage, kind (F forward, I input gradient, W weight "
            "gradient, B full backward), micro-batch, e.g. 0F1, 3I0, 3W0")


def _torch_text(text: str) -> str:
    """What torch's own parser says about a field ('' when it accepts it)."""
    from torch.distributed.pipelining.schedules import _Action

    try:
        got = _Action.from_str(text)
    except Exception as exc:                     # RuntimeError, ValueError (bad enum)
        return f"{type(exc).__name__}: {exc}"
    if got is not None and str(got) != text:
        return f"torch reads {text!r} as {str(got)!r}"
    return ""


def _name(stage, kind, mb) -> str:
    return f"{stage}{kind}{mb}"


# ---- checking -------------------------------------------------------------------------------
@dataclass
class ScheduleCheck:
    """What `check_schedule` found: ok, the problems in words (rank, step, stage, micro-batch
    named; steps count from 0, as ranks and torch do), which rank holds each stage, and
    torch's own text of the first error it raised (None if torch raised nothing)."""
    ok: bool
    problems: list = field(default_factory=list)
    stage_to_rank: dict = field(default_factory=dict)
    ranks: int = 0
    stages: int = 0
    microbatches: int = 0
    torch_error: str | None = None

    def text(self) -> str:
        head = (f"{self.ranks} ranks, {self.stages} stages, {self.microbatches} micro-batches: ")
        if self.ok:
            held = {r: [s for s, k in sorted(self.stage_to_rank.items()) if k == r]
                    for r in range(self.ranks)}
            return head + "the schedule is valid (torch's checks pass); stages per rank: " + \
                "; ".join(f"rank {r}: {', '.join(map(str, s))}" for r, s in held.items())
        out = head + f"{len(self.problems)} problem{'s' * (len(self.problems) != 1)}:\n" + \
            "\n".join(f"- {p}" for p in self.problems)
        return out + (f"\n(torch: {self.torch_error})" if self.torch_error else "")

    __str__ = text


def _subs(row):
    """(step, (stage, kind, mb)) for every compute action of a parsed row, pairs unpacked."""
    return [(t, op) for t, ops in enumerate(row) for op in ops]


def _own_checks(parsed, S, M) -> list[str]:
    """What torch misses or crashes on: stage or micro-batch out of range, an action run
    twice, a rank with nothing to do."""
    problems = []
    for rank, row in parsed.items():
        if not _subs(row):
            problems.append(f"rank {rank} has no action: every rank needs at least one stage")
        seen: dict = {}
        for t, (s, k, j) in _subs(row):
            if s >= S:
                problems.append(f"rank {rank}, step {t}: {_name(s, k, j)} names stage {s}; "
                                f"stages={S} allows 0 to {S - 1} (stages counts every stage, "
                                "e.g. 2 per rank in a V schedule)")
            if j >= M:
                problems.append(f"rank {rank}, step {t}: {_name(s, k, j)} names micro-batch "
                                f"{j}; microbatches={M} allows 0 to {M - 1}")
            if (s, k, j) in seen:
                problems.append(f"rank {rank} runs {_name(s, k, j)} twice (steps {seen[(s, k, j)]}"
                                f" and {t}): each action runs once")
            seen.setdefault((s, k, j), t)
    return problems


def _torch_actions(parsed):
    from torch.distributed.pipelining.schedules import OVERLAP_F_B, _Action, _ComputationType

    def one(s, k, j):
        return _Action(s, _ComputationType(k), j)

    return {rank: [None if not ops else one(*ops[0]) if len(ops) == 1 else
                   _Action(-1, OVERLAP_F_B, None, tuple(one(*op) for op in ops))
                   for ops in row] for rank, row in parsed.items()}


def _where(parsed, stage, kinds, mb):
    """(rank, step) of the first action of `stage`, one of `kinds`, on micro-batch mb."""
    for rank, row in parsed.items():
        for t, (s, k, j) in _subs(row):
            if (s, j) == (stage, mb) and k in kinds:
                return rank, t
    return None


def _missing(parsed, stage, kinds, M) -> list[int]:
    done = {j for row in parsed.values() for _, (s, k, j) in _subs(row)
            if s == stage and k in kinds}
    return [j for j in range(M) if j not in done]


def _words(msg: str, parsed, M) -> str:
    """torch's _validate_schedule message (torch 2.13) in plain words, with what it leaves out
    (which micro-batches are missing)."""
    if m := re.search(r"Rank (\d+), step (\d+): Running (Full Backward|Backward Input) for "
                      r"stage (\d+), microbatch (\d+) without first running Forward", msg):
        r, t, what, s, j = m.groups()
        kind = "B" if what == "Full Backward" else "I"
        later = _where(parsed, int(s), "F", int(j))
        fwd = f"rank {later[0]}, step {later[1]}" if later else "missing"
        return (f"rank {r}, step {t}: {s}{kind}{j} ({KINDS[kind]} of stage {s}, micro-batch {j})"
                f" comes before its forward {s}F{j} ({fwd}): a backward needs the activations "
                "its forward saved")
    if m := re.search(r"Rank (\d+), step (\d+): Running Backward Weight for stage (\d+), "
                      r"microbatch (\d+) without first running Backward Input", msg):
        r, t, s, j = m.groups()
        full = _where(parsed, int(s), "B", int(j))
        if full:
            return (f"rank {r}, step {t}: {s}W{j} follows a full backward {s}B{j} (rank "
                    f"{full[0]}, step {full[1]}), which computed the weight gradient already: "
                    f"drop the W, or split the B into {s}I{j} and {s}W{j}")
        later = _where(parsed, int(s), "I", int(j))
        where = f"it runs later, at step {later[1]}" if later else "it is missing"
        return (f"rank {r}, step {t}: the weight gradient {s}W{j} comes before the input "
                f"gradient {s}I{j} ({where}); W uses what I computed, so I comes first")
    if m := re.search(r"Rank (\d+), step (\d+): Stage (\d+) is assigned to both rank (\d+) and "
                      r"rank (\d+)", msg):
        r, t, s, _, other = m.groups()
        return (f"stage {s} is on rank {other} and on rank {r} (step {t}): a stage's weights "
                "live on one rank, so all its actions go in that rank's row")
    if m := re.search(r"Got (\d+) \S+ microbatches for stage (\d+), expected (\d+)", msg):
        s = int(m[2])
        if m[1] == "0":
            return (f"stage {s} has no action at all: each stage 0 to stages - 1 needs its "
                    "actions in one rank's row")
        return (f"stage {s} has no forward of micro-batch "
                f"{', '.join(map(str, _missing(parsed, s, 'F', M)))}: each micro-batch goes "
                "forward once through every stage")
    if m := re.search(r"stage (\d+): I and W must have equal counts.*I=(\d+), W=(\d+)", msg,
                      re.S):
        s, i, w = int(m[1]), int(m[2]), int(m[3])
        lack, has = ("W", "I") if i > w else ("I", "W")
        gone = [j for j in _missing(parsed, s, lack, M) if j not in _missing(parsed, s, has, M)]
        return (f"stage {s} has {i} input gradients (I) and {w} weight gradients (W): micro-batch "
                f"{', '.join(map(str, gone))} has {has} without {lack}; each I needs its W")
    if m := re.search(r"stage (\d+): expected (\d+) total backwards.*B=(\d+), I=(\d+), W=(\d+)",
                      msg, re.S):
        s = int(m[1])
        return (f"stage {s} has no backward of micro-batch "
                f"{', '.join(map(str, _missing(parsed, s, 'BI', M)))} (B, or I and W): each "
                f"micro-batch goes backward once through every stage")
    if m := re.search(r"Schedule is missing actions for rank (\d+)", msg):
        return f"there is no row for rank {m[1]}: ranks 0 to the last need a row each"
    if m := re.search(r"incorrect number of ranks - expected (\d+), actual (\d+)", msg):
        return f"{m[2]} rows for ranks 0 to {int(m[1]) - 1}: each rank needs a row"
    return "torch rejects the schedule: " + msg.split("\n")[0]


def _needs(op, S):
    """(stage, kinds, mb) whose result `op` receives from another stage, or None."""
    s, k, j = op
    if k == "F":
        return None if s == 0 else (s - 1, "F", j)
    if k in "IB":
        return None if s == S - 1 else (s + 1, "IB", j)
    return None


def _deadlock(parsed, left, S) -> str:
    """Words for a schedule torch's _add_send_recv could not finish: `left` is what it had not
    scheduled (it pops each rank's actions from the front as it places them)."""
    stuck = {}
    for rank, rest in left.items():
        step = len(parsed[rank]) - len(rest)
        ops = parsed[rank][step]
        done = {op for t in range(step) for op in parsed[rank][t]}
        for op in ops:
            need = _needs(op, S)
            if need is None:
                continue
            s, kinds, j = need
            if not any((s, k, j) in done for k in kinds) and not any(
                    (s, k, j) in ops for k in kinds):
                stuck[rank] = (step, op, need, _where(parsed, s, kinds, j))
                break
    if not stuck:                    # not a wait on another stage's result: torch's own words
        return ("torch could not place the sends and receives (the ranks wait for each other); "
                "next actions: " + "; ".join(f"rank {r} at step {len(parsed[r]) - len(rest)}"
                                             for r, rest in sorted(left.items())))

    def line(rank):
        step, op, (s, kinds, j), at = stuck[rank]
        what = "activations" if kinds == "F" else "gradient"
        src = f"{s}{kinds[0]}{j}" if kinds == "F" else f"{s}I{j} or {s}B{j}"
        if at is None:
            tail = "which no rank runs"
        elif at[0] == rank:
            tail = f"which this rank runs itself later, at step {at[1]}"
        else:
            tail = f"which rank {at[0]} runs at step {at[1]}"
        return (f"rank {rank} stops at step {step} ({_name(*op)}): it needs the {what} of "
                f"{src}, {tail}")

    # who waits on whom: follow the waits from each rank to the cycle they end in
    waits = {r: v[3][0] for r, v in stuck.items() if v[3] is not None}
    cycle: list = []
    for start in sorted(stuck):
        path, r = [], start
        while r in waits and r not in path:
            path.append(r)
            r = waits[r]
        if r in path:
            cycle = sorted(path[path.index(r):])
            break
    cycle = cycle or sorted(stuck)
    if len(cycle) == 1:
        head = f"deadlock on rank {cycle[0]}: it waits for its own later action"
    else:
        head = (f"deadlock between ranks {' and '.join(map(str, cycle))}: each waits for "
                "another, so no rank can go on")
    others = [r for r in sorted(stuck) if r not in cycle]
    behind = (f". Behind them wait{'s' * (len(others) == 1)} rank"
              f"{'s' * (len(others) > 1)} {', '.join(map(str, others))}" if others else "")
    return head + ". " + "; ".join(line(r) for r in cycle) + behind


def check_schedule(actions, stages, microbatches) -> ScheduleCheck:
    """Check a schedule (anything `as_actions` takes; one row per rank) with torch's own
    checks and say in words what is wrong. stages: every stage of the model (torch's
    num_stages: 2 per rank for ZB-V and DualPipeV); microbatches: m.

    In order: each field parses (torch's notation, read strictly: "0F0x" is an error here,
    where torch would read 0F0); stages and micro-batches in range, no action twice, no
    empty rank (torch misses these or crashes on them); torch's _validate_schedule (each B or
    I after its F, each W after its I, all actions present, a stage on one rank); torch's
    _add_send_recv (places the sends and receives; it fails when ranks wait for each other:
    a deadlock, named with the ranks and steps) and _simulate_comms_compute (its dry run of
    the schedule with communication). The first check that fails stops the others."""
    rows = as_actions(actions)
    S = validate.positive_int("stages", stages, 4096)
    M = validate.positive_int("microbatches", microbatches, 65536)
    n = max(rows, default=-1) + 1
    result = ScheduleCheck(False, [], {}, n, S, M)
    if not rows:
        result.problems.append("the schedule has no row: write one row of actions per rank")
        return result
    parsed = {}
    for rank, row in rows.items():
        if len(row) > MAX_STEPS:
            raise ValueError(f"rank {rank} has {len(row):,} steps; allowed: up to {MAX_STEPS:,}")
        parsed[rank] = []
        for t, text in enumerate(row):
            got = _parse(text)
            if isinstance(got, str):
                said = _torch_text(text)
                result.problems.append(f"rank {rank}, step {t}: {text!r} {got}"
                                       + (f" (torch: {said})" if said else ""))
                result.torch_error = result.torch_error or said or None
                got = ()
            parsed[rank].append(got)
    if result.problems:
        return result
    own = _own_checks(parsed, S, M)
    result.problems += own
    if own:
        return result
    from torch.distributed.pipelining import schedules as T

    acts = _torch_actions(parsed)
    try:
        mapping = T._validate_schedule(acts, n, S, M)
    except (AssertionError, KeyError, ValueError) as exc:
        said = " ".join(str(exc).split("\n\n")[0].split())     # not the schedule it prints
        result.torch_error = f"{type(exc).__name__}: {said}"
        result.problems.append(_words(str(exc), parsed, M))
        return result
    result.stage_to_rank = dict(sorted(mapping.items()))
    left = {r: list(a) for r, a in acts.items()}
    try:
        with_comms = T._add_send_recv(left, lambda s: mapping[s], S)
    except AssertionError as exc:
        result.torch_error = f"AssertionError: {exc}"
        result.problems.append(_deadlock(parsed, left, S))
        return result
    flat = {r: [sub for a in row for sub in (a.sub_actions or (a,))]
            for r, row in with_comms.items()}
    said = io.StringIO()
    try:
        with contextlib.redirect_stdout(said):
            T._simulate_comms_compute(flat, lambda s: mapping[s], S)
    except ValueError as exc:               # "Schedule is not progressing"
        result.torch_error = f"ValueError: {exc}"
        heads = re.findall(r"rank=(\d+) next action= (\S+)", said.getvalue())
        result.problems.append("torch's dry run with communication stops: " + "; ".join(
            f"rank {r} waits at {a}" for r, a in heads))
        return result
    result.ok = True
    return result


# ---- simulating -----------------------------------------------------------------------------
def simulate_schedule(actions, fwd=1.0, bwd=2.0, wgrad=None, p2p=0.0):
    """The timeline of a valid schedule (anything `as_actions` takes): a
    `labkit.pipeline_events.PipelineResult` with its makespan, bubble, and each rank's peak of
    micro-batch chunks in flight (peak_chunks; peak_in_flight divides by the stages the rank
    holds). Checked first with `check_schedule` (stages and micro-batches: the highest named,
    plus one); ValueError with its problems if it is not valid.

    Costs, as `labkit.pipeline.simulate`: fwd, bwd, wgrad are seconds of one micro-batch
    through one rank's whole share, so a rank holding k stages spends fwd/k on each stage's F.
    I costs bwd/k, W wgrad/k, a full backward B = I + W: (bwd + wgrad)/k, drawn as its B part
    then its W part. wgrad None: bwd if the schedule has an I or a W anywhere (bwd is then the
    input gradient alone, as simulate's split schedules), else 0 (B costs bwd: bwd is the whole
    backward, as for 1F1B). An overlapped pair (DualPipeV) runs its passes one after the other
    and sends both results when it ends, as torch does.
    p2p: seconds a send between ranks takes (none between stages on one rank)."""
    from labkit.pipeline_events import run_orders

    rows = as_actions(actions)
    parsed = {r: [_parse(t) for t in row] for r, row in rows.items()}
    bad = [f"rank {r}, step {t}: {rows[r][t]!r} {ops}" for r, row in parsed.items()
           for t, ops in enumerate(row) if isinstance(ops, str)]
    ops = [op for row in parsed.values() for ops in row if not isinstance(ops, str) for op in ops]
    if bad or not ops:
        raise ValueError("the schedule cannot be simulated: " + ("; ".join(bad) or "no action"))
    S, M = 1 + max(s for s, _, _ in ops), 1 + max(j for _, _, j in ops)
    check = check_schedule(rows, S, M)
    if not check.ok:
        raise ValueError("the schedule is not valid, so it cannot be simulated:\n" + check.text())
    f = validate.positive("fwd", fwd)
    b = validate.positive("bwd", bwd)
    c = validate.non_negative("p2p", p2p)
    split = any(k in "IW" for _, k, _ in ops)
    w = validate.non_negative("wgrad", (b if split else 0.0) if wgrad is None else wgrad)
    held = {r: sorted(s for s, k in check.stage_to_rank.items() if k == r) for r in rows}
    place = {s: (r, held[r].index(s)) for s, r in check.stage_to_rank.items()}
    cost = [{"F": f / len(held[r]), "B": b / len(held[r]), "W": w / len(held[r])}
            for r in range(len(rows))]
    kind = {"F": "F", "I": "B", "W": "W", "B": "BW" if w > 0 else "B"}
    orders = [[tuple((kind[k], j, s) for s, k, j in step) for step in parsed[r] if step]
              for r in range(len(rows))]
    return run_orders("custom", orders, place, cost, c, M * (f + b + w), M)
