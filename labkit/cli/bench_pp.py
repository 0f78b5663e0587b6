"""Pipeline schedules priced: step time and idle share, measured vs simulated, per schedule.

    labkit bench pp                          # 4 ranks: by hand (GPipe, 1F1B) and torch's four
    labkit bench pp -- --nproc 2 --steps 5 --sleep 0.05 --microbatches 16

Runs `labkit.labs.pp --part byhand` and `--part torch` on --nproc ranks (one stage each); each
stage sleeps --sleep s per forward (2x per backward) so that the timeline is the schedule's even
on shared cores. Prints per schedule the measured step, the simulator's at the measured costs
(labkit.pipeline.simulate), and the idle shares measured, simulated and in closed form.
--steps is the lab's --repeats (the median step is reported); every other flag goes to the lab.
"""
from __future__ import annotations

import os


def summary(*reports: dict) -> list[dict]:
    """One row per (implementation, schedule) from the lab's reports (rank 0's, --part byhand
    and/or torch): step_s, step_simulated_s, idle_measured, idle_simulated, idle_formula,
    difference_points."""
    rows = []
    for report in reports:
        if not isinstance(report, dict) or report.get("part") not in ("byhand", "torch"):
            raise ValueError("report must be labkit.labs.pp's --part byhand or torch report "
                             "(result.results[0]); got "
                             + (f"part={report.get('part')!r}" if isinstance(report, dict)
                                else type(report).__name__))
        impl = "by hand" if report["part"] == "byhand" else "torch"
        for name, row in report["schedules"].items():
            rows.append(dict(impl=impl, schedule=name, step_s=row["step_measured"],
                             step_simulated_s=row["step_simulated"],
                             idle_measured=row["idle_measured"],
                             idle_simulated=row["idle_simulated"],
                             idle_formula=row["idle_formula"],
                             difference_points=row["difference_points"]))
    return rows


def main(argv: list[str] | None = None) -> int:
    from labkit.cli._lab_bench import lab_bench_parser, parse, run_bench_lab

    parser = lab_bench_parser("labkit bench pp", __doc__, steps=3, least=1,
                              why="measured steps per schedule, the median one reported")
    args, lab_args = parse(parser, argv)
    if args.nproc is None:
        args.nproc = 4
    if not 2 <= args.nproc <= 64:
        parser.error(f"argument --nproc: {args.nproc} stages; allowed: 2 to 64")
    common = ["--repeats", str(args.steps), *lab_args]
    reports = []
    for part in ("byhand", "torch"):
        result = run_bench_lab(parser.prog, "labkit.labs.pp", args, ["--part", part, *common])
        if result is None:
            return 1
        reports.append(result.results[0])
    print(f"one step per schedule on {args.nproc} ranks; {os.cpu_count()} cores, load "
          f"{os.getloadavg()[0]:.1f}")
    print(f"  {'impl':<8}{'schedule':<18}{'step ms':>9}{'sim ms':>8}{'idle':>7}{'sim':>7}"
          f"{'formula':>8}{'diff pts':>9}")
    for row in summary(*reports):
        print(f"  {row['impl']:<8}{row['schedule']:<18}{1e3 * row['step_s']:>9.0f}"
              f"{1e3 * row['step_simulated_s']:>8.0f}{row['idle_measured']:>7.3f}"
              f"{row['idle_simulated']:>7.3f}{row['idle_formula']:>8.3f}"
              f"{row['difference_points']:>9.1f}")
    return 0
