"""Write the example schedules of `labkit run pp -- --part custom` (labkit/data/schedules/) from
torch.distributed.pipelining's own schedules' pipeline_order, in torch's CSV format.

    python tools/make_schedules.py            # writes 1f1b-p4-m8.csv and zbh1-p4-m8.csv
    python tools/make_schedules.py --check    # exit 1 if the files differ from what it writes

- 1f1b-p4-m8: Schedule1F1B (p = 4 ranks, m = 8). Its pipeline_order (a drawing: the schedule
  runs its own loop) numbers the last rank's forwards 1 to m instead of 0 to m - 1 in torch
  2.13, and ends each row with REDUCE_GRAD, which torch adds itself when it loads a CSV: the
  forwards are renumbered and REDUCE_GRAD dropped; the order is labkit.pipeline's "1f1b"
  (checked). Empty fields line the ranks up in time steps of one action.
- zbh1-p4-m8: ScheduleInterleavedZeroBubble with one stage per rank (ZB-H1, Qi et al. 2024;
  labkit.pipeline's "zero-bubble"), its pipeline_order as torch aligns it.

Both pass labkit.pipeline_check.check_schedule. Needs no process group of real ranks: torch's
fake backend stands in for the 4 ranks while the schedules are built.
"""
from __future__ import annotations

import argparse
import csv
import io
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "labkit" / "data" / "schedules"
P, M = 4, 8


def _stage(rank: int):
    import torch
    from torch.distributed import pipelining

    return pipelining.PipelineStage(torch.nn.Linear(4, 4), rank, P, torch.device("cpu"),
                                    group=None)


def _rows(order: dict) -> list[list[str]]:
    return [["" if a is None else str(a) for a in order[r]] for r in range(P)]


def _aligned(rows: list[list[str]]) -> list[list[str]]:
    """Each rank's actions at their time step when every action takes one step and a message
    one more (torch's drawings): empty fields where a rank waits."""
    import re

    ops = [[re.fullmatch(r"(\d+)([FIBW])(\d+)", a).groups() for a in row if a] for row in rows]
    done: dict = {}
    slot = [[None] * len(o) for o in ops]
    last = P - 1
    while any(None in s for s in slot):
        for r in range(P):
            for i, (s, k, j) in enumerate(ops[r]):
                if slot[r][i] is not None:
                    continue
                s, j = int(s), int(j)
                dep = (None if k == "F" and s == 0 else ("F", s - 1, j) if k == "F" else
                       ("B", s, j) if k == "W" else ("F", s, j) if s == last else
                       ("B", s + 1, j))
                if dep is not None and dep not in done:
                    break
                t = max(slot[r][i - 1] + 1 if i else 0, done[dep] + 1 if dep else 0)
                slot[r][i] = t
                done[("B" if k in "BI" else k, s, j)] = t
    return [[next((f"{s}{k}{j}" for (s, k, j), t in zip(ops[r], slot[r]) if t == c), "")
             for c in range(max(slot[r]) + 1)] for r in range(P)]


def one_f_one_b() -> list[list[str]]:
    from torch.distributed import pipelining

    from labkit.pipeline import _order

    order = pipelining.Schedule1F1B(_stage(0), M).pipeline_order
    rows = []
    for r in range(P):
        acts = [a for a in order[r] if a is not None and a.computation_type.value in "FB"]
        fwd = iter(range(M))           # the forwards in order, numbered 0 to m - 1
        rows.append([f"{r}F{next(fwd)}" if a.computation_type.value == "F" else str(a)
                     for a in acts])
    want = [[f"{r}{k}{j}" for k, j, _ in ops] for r, ops in enumerate(_order("1f1b", P, M, 1))]
    assert rows == want, f"torch's Schedule1F1B order is not labkit's 1f1b: {rows} != {want}"
    return _aligned(rows)


def zb_h1() -> list[list[str]]:
    from torch.distributed import pipelining

    order = pipelining.ScheduleInterleavedZeroBubble([_stage(0)], M).pipeline_order
    rows = _rows(order)
    while all(row and row[-1] == "" for row in rows):
        for row in rows:
            row.pop()
    return rows


def text(rows: list[list[str]]) -> str:
    out = io.StringIO()
    csv.writer(out, lineterminator="\n").writerows(rows)
    return out.getvalue()


def main(argv=None) -> int:
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from labkit.pipeline_check import check_schedule

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="compare with the files instead of writing them")
    args = parser.parse_args(argv)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=P)
    try:
        files = {"1f1b-p4-m8.csv": one_f_one_b(), "zbh1-p4-m8.csv": zb_h1()}
    finally:
        dist.destroy_process_group()
    differ = []
    for name, rows in files.items():
        check = check_schedule(rows, P, M)
        assert check.ok, f"{name}: {check.text()}"
        path = OUT / name
        if args.check:
            if not path.is_file() or path.read_text() != text(rows):
                differ.append(name)
            continue
        OUT.mkdir(parents=True, exist_ok=True)
        path.write_text(text(rows))
        print(f"wrote {path} ({P} ranks, {M} micro-batches, {max(map(len, rows))} steps)")
    if differ:
        print(f"differ from what {sys.argv[0]} writes: {', '.join(differ)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
