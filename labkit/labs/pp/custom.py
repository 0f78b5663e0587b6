"""--part custom of labkit.labs.pp: a pipeline schedule written by hand in torch's CSV notation
(a row per rank; fields like 0F0, 3I1, 3W1, 0B0, empty = idle), checked by
labkit.pipeline_check, run by torch's _PipelineScheduleRuntime on manual PipelineStages of the
same Llama, measured beside labkit.pipeline_check.simulate_schedule.

    labkit run pp -n 4 -- --part custom --schedule my.csv           # a row per rank
    labkit run pp -n 4 -- --part custom --schedule 1f1b-p4-m8 --schedule zbh1-p4-m8
    labkit run pp -n 4 -- --part custom --schedule my.csv --schedules 1f1b,zbv   # beside torch's

Examples from torch's own schedules (tools/make_schedules.py): labkit/data/schedules/. The
format, how stages and ranks are inferred, what is measured: docs/labs.md, ## pp.
"""
from __future__ import annotations

import copy
import re
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from labkit.labs.pp.torch_pp import ALL

SHIPPED = Path(__file__).resolve().parents[2] / "data" / "schedules"
_OP = re.compile(r"(\d+)([FIBW])(\d+)")


@dataclass
class Plan:
    """One --schedule, read and checked: its rows, stages, micro-batches, {stage: rank}."""

    name: str
    path: str
    actions: dict
    stages: int
    microbatches: int
    placement: dict
    split: bool          # an I or a W anywhere: backwards split as zero-bubble's


def shipped() -> dict[str, Path]:
    """{name: path} of the example schedules in labkit/data/schedules."""
    return {p.stem: p for p in sorted(SHIPPED.glob("*.csv"))}


class Refused(Exception):
    """Why the lab cannot run its input: lines of text, a headline each (details indented)."""

    def __init__(self, lines):
        super().__init__("\n".join(lines))
        self.lines = list(lines)


def refuse(lines) -> None:
    raise Refused(lines)


def stop(lines) -> None:
    """Stop the lab because of its input, on every rank at once: rank 0 prints why (once, no
    traceback) and exits with status 2, as a command-line error; the others leave quietly
    first (a barrier: nobody is left waiting, and the launcher has no rank to stop)."""
    import torch.distributed as tdist

    from labkit.runtime import dist

    if tdist.is_initialized() and tdist.get_world_size() > 1:
        tdist.barrier()
    if dist.rank() == 0:
        time.sleep(0.5)                 # the others' exits first: rank 0's is the lab's status
        print("\n".join(line if line.startswith(" ") else "labkit.labs.pp --part custom: "
                        + line for line in lines), file=sys.stderr, flush=True)
        raise SystemExit(2)
    dist.shutdown(wait=False)           # os._exit(0) under torchrun and labkit's launcher
    raise SystemExit(0)


def _resolve(text: str) -> Path:
    path = Path(text)
    if path.is_file():
        return path
    known = shipped()
    name = path.name.removesuffix(".csv")
    if path.parent == Path(".") and name in known:
        return known[name]
    what = "is a folder" if path.is_dir() else "does not exist"
    refuse([f"--schedule {text!r}: {what}; allowed: a CSV file in torch's format (a row per "
            "rank) or the name of an example in labkit/data/schedules: "
            + ", ".join(known)])


def read_plan(text: str, args, world: int) -> Plan:
    """--schedule `text`: read, sized and checked (labkit.pipeline_check), or refused."""
    from labkit.pipeline_check import check_schedule, read_schedule

    path = _resolve(text)
    try:
        actions = read_schedule(path)
    except (ValueError, OSError, UnicodeDecodeError) as exc:
        refuse([f"--schedule {text!r}: {exc}"])
    if len(actions) != world:
        refuse([f"{path} has {len(actions)} row{'s' * (len(actions) != 1)}, one per rank, "
                f"and {world} ranks run it (-n {world}); allowed: -n {len(actions)}, or a "
                f"file with {world} rows"])
    ops = [(int(s), k, int(j)) for row in actions.values() for a in row
           for s, k, j in _OP.findall(a)]
    stages = args.stages or (1 + max((s for s, _, _ in ops), default=0))
    m = args.microbatches or (1 + max((j for _, _, j in ops), default=0))
    try:
        check = check_schedule(actions, stages, m)
    except ValueError as exc:
        refuse([f"--schedule {text!r}: {exc}"])
    if not check.ok:
        refuse([f"{path} is not a schedule torch can run ({check.ranks} ranks, {stages} "
                f"stages, {m} micro-batches):", *(f"  - {p}" for p in check.problems)])
    if args.layers % stages:
        refuse([f"{path} cuts the model into {stages} stages, and --layers {args.layers} does "
                f"not split into {stages} equal ones; allowed: --layers a multiple of {stages}"])
    return Plan(path.stem, str(path), actions, stages, m, dict(check.stage_to_rank),
                any(k in "IW" for _, k, _ in ops))


def prepare(p, args, world: int) -> None:
    """lab.check_sizes for --part custom: args.plans, one per --schedule, read and checked on
    rank 0 (every rank gets its plans: only rank 0 imports torch's pipelining to check a file
    that will not run), or every rank stops with rank 0's words (`stop`)."""
    import torch.distributed as tdist

    from labkit.runtime import dist

    outcome: list = [None]
    if dist.rank() == 0:
        try:
            outcome[0] = ("plans", _plans(args, world))
        except Refused as exc:
            outcome[0] = ("refused", exc.lines)
    if tdist.is_initialized() and tdist.get_world_size() > 1:
        tdist.broadcast_object_list(outcome, src=0)
    kind, what = outcome[0]
    if kind == "refused":
        stop(what)
    args.plans = what


def _plans(args, world: int) -> list[Plan]:
    if not args.schedule:
        refuse(["needs a schedule: --schedule FILE.csv (torch's format, a row per rank); "
                "allowed: a file, or an example of labkit/data/schedules: "
                + ", ".join(shipped())])
    plans, names, problems = [], set(), []
    for text in args.schedule:          # every file's problems, not only the first file's
        try:
            plan = read_plan(text, args, world)
        except Refused as exc:
            problems += exc.lines
            continue
        while plan.name in names or plan.name in ALL:       # a file named zbv.csv: "zbv.csv"
            plan.name += "'" if plan.name.endswith(".csv") else ".csv"
        names.add(plan.name)
        plans.append(plan)
    if problems:
        refuse(problems)
    return plans


def run_plan(plan: Plan, base, args, ctx) -> dict:
    """Run `plan` with torch's _PipelineScheduleRuntime, measured: the row of the others."""
    from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime

    from labkit.labs.common import pipeline as shared
    from labkit.labs.pp import torch_pp
    from labkit.parallel.pipe import causal_lm_loss

    p, m, n = ctx.world_size, plan.microbatches, plan.stages
    sized = copy.copy(args)
    sized.microbatches = m
    ids = shared.batch(sized)
    ref = shared.reference(base, ids)
    held = sorted(s for s, r in plan.placement.items() if r == ctx.rank)
    model = copy.deepcopy(base)
    # each rank's stages together sleep --sleep per micro-batch, as the simulator's fwd is one
    # micro-batch through a rank's whole share
    stages, mods = torch_pp.make_stages(model, held, n, args.sleep, ctx.device)
    schedule = _PipelineScheduleRuntime(stages, m, loss_fn=causal_lm_loss)
    path = plan.path
    if not Path(path).is_file():        # read on rank 0's node only: this node gets a copy
        from labkit.pipeline_check import write_schedule

        path = str(write_schedule(plan.actions, Path(tempfile.mkdtemp()) / Path(path).name))
    try:
        schedule._load_csv(path, format="compute_only")
    except Exception as exc:            # checked already; the same on every rank if not
        stop([f"{plan.path}: torch's _load_csv refused it: {type(exc).__name__}: "
              f"{str(exc).splitlines()[0] if str(exc) else ''}"])
    clock = torch_pp.StageClock(stages, ctx.rank, split=plan.split)
    step = torch_pp.timed_step(schedule, model, mods, clock, ids, sized, len(held))
    v = n / p       # stages per rank: simulate_schedule splits a rank's cost among its stages

    def simulator(row, fwd, bwd, wgrad, p2p):
        from labkit.pipeline_check import simulate_schedule

        return simulate_schedule(plan.actions, fwd=fwd, bwd=bwd, wgrad=wgrad, p2p=p2p)

    step(0.0)                                              # warm-up: shapes inferred
    row, (losses, sends, peak) = shared.least_disturbed_step(
        step, args.repeats, "custom", p, m, v, placement=plan.placement, simulator=simulator,
        actions=plan.actions)
    row.update(torch_pp.step_result(model, mods, ref, losses, sends, peak, 1))
    counts = shared.gather(len(held))
    row["peak_in_flight"] = [k / c for k, c in zip(row["peak_in_flight"], counts)]
    each = shared.predicted_sends(plan.placement, m, shared.message_bytes(args))
    busiest = max(row["sends"])
    row.update(file=plan.path, stages_total=n, placement=plan.placement, held=shared.gather(held),
               reference_loss=ref[0], predicted_sends=max(each), predicted_sends_per_rank=each,
               ratio_sends=[busiest[0] / max(each)[0] if max(each)[0] else float("nan"),
                            busiest[1] / max(each)[1] if max(each)[1] else float("nan")])
    return row


def run_custom(args, ctx) -> dict:
    """Every --schedule file (`run_plan`), then torch's --schedules by name beside them
    (labkit.labs.pp.torch_pp.run_one, at --microbatches or 8)."""
    from labkit.labs.common import pipeline as shared
    from labkit.labs.pp import torch_pp

    base, _ = shared.build(args)
    rows = {plan.name: run_plan(plan, base, args, ctx) for plan in args.plans}
    if args.schedules:
        named = torch_pp.named_args(args)
        ids = shared.batch(named)
        ref = shared.reference(base, ids)
        rows.update({name: torch_pp.run_one(name, base, ids, ref, named, ctx)
                     for name in args.schedules})
    return dict(part="custom", rank=ctx.rank, world_size=ctx.world_size, sleep=args.sleep,
                chunks=args.chunks, schedules=rows)


def print_custom(r: dict) -> None:
    from labkit.labs.pp.byhand import print_rows
    from labkit.labs.pp.torch_pp import print_sends

    print(f"your schedules on torch's _PipelineScheduleRuntime: {r['world_size']} ranks, sleep "
          f"{r['sleep']:g} s forward per rank's share (2x backward)")
    for name, row in r["schedules"].items():
        if "file" not in row:
            print(f"  {name}: torch's {row['torch_class']}, {row['microbatches']} micro-batches,"
                  f" {row['chunks']} stage{'s' * (row['chunks'] > 1)} per rank")
            continue
        held = "; ".join(f"rank {k}: {', '.join(map(str, s))}" for k, s in enumerate(row["held"]))
        print(f"  {name}: {row['file']}, {row['stages_total']} stages, {row['microbatches']} "
              f"micro-batches, loss {row['loss']:.6f} vs one process {row['reference_loss']:.6f}"
              f"; stages {held}")
    print_rows(r["schedules"])
    print_sends(r["schedules"])
