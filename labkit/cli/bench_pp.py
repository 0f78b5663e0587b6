"""Pipeline schedules priced: step time and idle share, measured vs simulated, per schedule.

    labkit bench pp                          # 4 ranks: by hand (GPipe, 1F1B) and torch's six
    labkit bench pp -- --nproc 2 --steps 5 --sleep 0.05 --microbatches 16
    labkit bench pp -- --schedules 1f1b,zbv  # torch's: these only

Runs `labkit.labs.pp --part byhand` and `--part torch --schedules all` (--schedules picks) on
--nproc ranks; a rank's stages sleep --sleep s per forward (2x per backward), so the timeline is
the schedule's even on shared cores. Prints per schedule the measured step, the simulator's at
the measured costs, the idle shares measured, simulated (their ratio) and in closed form where
there is one. --steps is the lab's --repeats (the shortest step is reported).
"""
from __future__ import annotations

import argparse
import os


def summary(*reports: dict) -> list[dict]:
    """One row per (implementation, schedule) from the lab's reports (rank 0's, --part byhand,
    torch and/or custom): step_s, step_simulated_s, idle_measured, idle_simulated, idle_ratio,
    idle_formula (None where there is no closed form), difference_points. impl: "by hand",
    "torch" (torch's schedules by name) or "csv" (a --part custom file)."""
    rows = []
    for report in reports:
        if not isinstance(report, dict) or report.get("part") not in ("byhand", "torch",
                                                                       "custom"):
            raise ValueError("report must be labkit.labs.pp's --part byhand, torch or custom "
                             "report (result.results[0]); got "
                             + (f"part={report.get('part')!r}" if isinstance(report, dict)
                                else type(report).__name__))
        for name, row in report["schedules"].items():
            impl = ("by hand" if report["part"] == "byhand" else
                    "csv" if "file" in row else "torch")
            ratio = (row["idle_measured"] / row["idle_simulated"] if row["idle_simulated"] > 0
                     else float("nan"))
            rows.append(dict(impl=impl, schedule=name, step_s=row["step_measured"],
                             step_simulated_s=row["step_simulated"],
                             idle_measured=row["idle_measured"],
                             idle_simulated=row["idle_simulated"], idle_ratio=ratio,
                             idle_formula=row["idle_formula"],
                             difference_points=row["difference_points"]))
    return rows


def main(argv: list[str] | None = None) -> int:
    from labkit.cli._lab_bench import lab_bench_parser, parse, run_bench_lab

    parser = lab_bench_parser("labkit bench pp", __doc__, steps=3, least=1,
                              why="measured steps per schedule, the shortest one reported")
    args, lab_args = parse(parser, argv)
    if args.nproc is None:
        args.nproc = 4
    if not 2 <= args.nproc <= 64:
        parser.error(f"argument --nproc: {args.nproc} stages; allowed: 2 to 64")
    # --schedules is --part torch's alone (all of torch's unless it picks some)
    named = argparse.ArgumentParser(add_help=False)
    named.add_argument("--schedules", default="all")
    picked, rest = named.parse_known_args(lab_args)
    common = ["--repeats", str(args.steps), *rest]
    reports = []
    for part in ("byhand", "torch"):
        extra = ["--schedules", picked.schedules] if part == "torch" else []
        result = run_bench_lab(parser.prog, "labkit.labs.pp", args,
                               ["--part", part, *common, *extra])
        if result is None:
            return 1
        reports.append(result.results[0])
    print(f"one step per schedule on {args.nproc} ranks; {os.cpu_count()} cores, load "
          f"{os.getloadavg()[0]:.1f}")
    print(f"  {'impl':<8}{'schedule':<18}{'step ms':>9}{'sim ms':>8}{'idle':>7}{'sim':>7}"
          f"{'ratio':>7}{'formula':>8}{'diff pts':>9}")
    for row in summary(*reports):
        form = "-" if row["idle_formula"] is None else f"{row['idle_formula']:.3f}"
        print(f"  {row['impl']:<8}{row['schedule']:<18}{1e3 * row['step_s']:>9.0f}"
              f"{1e3 * row['step_simulated_s']:>8.0f}{row['idle_measured']:>7.3f}"
              f"{row['idle_simulated']:>7.3f}{row['idle_ratio']:>7.2f}{form:>8}"
              f"{row['difference_points']:>9.1f}")
    return 0
