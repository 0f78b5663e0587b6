"""Tensor parallelism priced: step time and bytes of the hand-built block and DTensor at tp 1, 2, 4.

    labkit bench tp                          # tp 1, 2 and 4, 3 timed steps each
    labkit bench tp -- --degrees 2 4 --steps 5 --layers 4 --hidden 128

Runs `labkit.labs.tp --part block` (labkit.parallel.tensor's Megatron layers) and `--part dtensor
--plan fused` (transformers' Llama under parallelize_module) once per degree. Prints per degree
the median step time, the collectives' payload S per step and the bytes a ring puts on the wire
per rank, beside step_communication("tp")'s. On CPU the ranks share the cores, so the bytes are
the figures to read, not the times. Every other flag goes to the lab.
"""
from __future__ import annotations

import os

DEGREES = (1, 2, 4)


def summary(block: dict, dtensor: dict) -> dict:
    """{impl: {"step_s", "payload", "wire", "predicted"}} from one degree's reports (rank 0's):
    payload S and ring wire bytes of one step's collectives (the layers' for DTensor),
    step_communication("tp")'s payload."""
    from labkit.comm import bytes_sent_per_rank

    n = block["world_size"]
    plan = dtensor["plans"]["fused"]
    rows = {"block": (block["step_s"], block["collectives"], block["predicted_collectives"]),
            "dtensor": (plan["step_s"], plan["layer_total"], plan["predicted_megatron"])}
    return {k: dict(step_s=t, payload=sum(b for _, b in got.values()),
                    wire=sum(bytes_sent_per_rank(op, b, n) for op, (_, b) in got.items()),
                    predicted=sum(p["bytes"] for p in want.values()))
            for k, (t, got, want) in rows.items()}


def main(argv: list[str] | None = None) -> int:
    from labkit.cli._lab_bench import lab_bench_parser, parse, run_bench_lab

    parser = lab_bench_parser("labkit bench tp", __doc__, steps=3, least=2,
                              why="block: 1 counted then the timed ones; dtensor: the first "
                                  "counted, the rest timed")
    parser.add_argument("--degrees", type=int, nargs="+", default=list(DEGREES),
                        help="tensor-parallel degrees (ranks) to run (default 1 2 4)")
    args, lab_args = parse(parser, argv)
    if args.nproc is not None:
        parser.error("argument --nproc: not used here; allowed: --degrees (one run per degree)")
    bad = [d for d in args.degrees if not 1 <= d <= 64]
    if bad:
        parser.error(f"argument --degrees: {bad} out of range; allowed: 1 to 64")
    print(f"step time (median) and bytes per step per rank; {os.cpu_count()} cores, load "
          f"{os.getloadavg()[0]:.1f}")
    print(f"  {'tp':>3} {'impl':<8}{'step ms':>9}{'S bytes':>12}{'wire bytes':>12}"
          f"{'predicted S':>13}{'ratio':>7}")
    for degree in args.degrees:
        args.nproc = degree
        common = ["--steps", str(args.steps), *lab_args]
        block = run_bench_lab(parser.prog, "labkit.labs.tp", args, ["--part", "block", *common])
        dtensor = run_bench_lab(parser.prog, "labkit.labs.tp", args,
                                ["--part", "dtensor", "--plan", "fused", *common])
        if block is None or dtensor is None:
            return 1
        for impl, row in summary(block.results[0], dtensor.results[0]).items():
            ratio = row["payload"] / row["predicted"] if row["predicted"] else float("nan")
            print(f"  {degree:>3} {impl:<8}{1e3 * row['step_s']:>9.1f}{row['payload']:>12,}"
                  f"{row['wire']:>12,.0f}{row['predicted']:>13,.0f}{ratio:>7.3f}")
    return 0
