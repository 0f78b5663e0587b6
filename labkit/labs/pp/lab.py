"""Pipeline-parallel lab: GPipe and 1F1B by hand, torch.distributed.pipelining's schedules and
yours (torch's CSV), PP x DP, each measured beside labkit.pipeline.simulate.

    labkit run pp -n 4 -- --trace traces/                # --part byhand: GPipe, 1F1B by hand
    labkit run pp -n 4 -- --part torch                   # torch's schedules (--schedules all)
    labkit run pp -n 4 -- --part custom --schedule FILE.csv        # your schedule, torch's CSV
    labkit run pp -n 4 -- --part ppdp                    # pp 2 x dp 2: DDP, FSDP2 on the dp axis

From a notebook: `run_lab("labkit.labs.pp", nproc=4, args=["--part", "torch"])`;
`labkit.plots.pp` draws the timelines. Sources (GPipe, 1F1B, ZB-H1, ZB-V, DualPipe), the model,
the sleep and what each part measures: docs/labs.md, ## pp.
"""
from __future__ import annotations

import argparse

from torch.distributed.elastic.multiprocessing.errors import record

from labkit.labs.pp import byhand as byhand
from labkit.labs.pp.torch_pp import ALL, SCHEDULES, V_SHAPED, chunks_of, named_args
from labkit.labs.common.flags import between, check_heads, positive_int, run_and_report
from labkit.labs.common.tracing import check_folder

PARTS = ("byhand", "torch", "custom", "ppdp")
SIZES = (("--layers", 8, "blocks"), ("--hidden", 64, "hidden size"),
         ("--heads", 4, "attention heads"), ("--vocab", 256, "vocabulary"),
         ("--seq", 32, "tokens per sequence"))


def _torch():
    from labkit.labs.pp import torch_pp
    return torch_pp


def _ppdp():
    from labkit.labs.pp import ppdp
    return ppdp


def _custom():
    from labkit.labs.pp import custom
    return custom


RUN = {"byhand": lambda a, c: byhand.run_byhand(a, c),
       "torch": lambda a, c: _torch().run_torch(a, c),
       "custom": lambda a, c: _custom().run_custom(a, c),
       "ppdp": lambda a, c: _ppdp().run_ppdp(a, c)}
PRINT = {"byhand": lambda r: byhand.print_byhand(r),
         "torch": lambda r: _torch().print_torch(r),
         "custom": lambda r: _custom().print_custom(r),
         "ppdp": lambda r: _ppdp().print_ppdp(r)}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--part", choices=PARTS, default="byhand", help="what to run (default byhand)")
    for flag, default, what in SIZES:
        p.add_argument(flag, type=positive_int, default=default, help=f"{what} (default {default})")
    p.add_argument("--kv-heads", type=positive_int, default=None,
                   help="Llama key/value heads (default half the heads, or all when odd)")
    p.add_argument("--microbatches", type=positive_int, default=None,
                   help="micro-batches per step, m (default 8; --part custom: the schedule's)")
    p.add_argument("--micro-batch", type=positive_int, default=1,
                   help="sequences per micro-batch (default 1)")
    p.add_argument("--chunks", type=positive_int, default=2,
                   help="--part torch: model chunks per rank of interleaved 1F1B, v (default 2)")
    p.add_argument("--schedules", type=schedule_list, default=None,
                   help="--part torch: which of torch's schedules, comma-separated, or all "
                        f"(default {','.join(SCHEDULES)}; also {','.join(V_SHAPED)}); "
                        "--part custom: torch's to run beside yours (default none)")
    p.add_argument("--schedule", action="append", default=None, metavar="FILE.csv",
                   help="--part custom: a schedule in torch's CSV format (a row per rank, "
                        "fields like 0F0, 3I1, 3W1, 0B0, empty = idle), or the name of one in "
                        "labkit/data/schedules (1f1b-p4-m8, zbh1-p4-m8); repeat for several")
    p.add_argument("--stages", type=positive_int, default=None,
                   help="--part custom: virtual stages (default the schedule's largest + 1)")
    p.add_argument("--sleep", type=between(0, 5, "seconds"), default=0.03,
                   help="seconds a rank's stages sleep, together, per forward, 2x per "
                        "backward (default 0.03)")
    p.add_argument("--repeats", type=positive_int, default=5,
                   help="measured steps per schedule; the shortest (least disturbed) is "
                        "reported (default 5)")
    p.add_argument("--steps", type=positive_int, default=2,
                   help="--part ppdp: SGD steps per variant (default 2)")
    p.add_argument("--lr", type=between(1e-9, 10, "a learning rate"), default=0.5,
                   help="--part ppdp: SGD learning rate (default 0.5)")
    p.add_argument("--seed", type=int, default=0, help="seed of weights and data (default 0)")
    p.add_argument("--trace", default=None, metavar="DIR",
                   help="--part byhand: after each schedule's measured steps, profile 2 more "
                        "(torch.profiler) and write DIR/pp-{gpipe,1f1b}-rank{r}.json "
                        "(labkit.trace reads them; default: no trace)")
    args = p.parse_args(argv)
    if args.trace is not None and args.part != "byhand":
        p.error(f"argument --trace: --part {args.part} writes no trace; allowed: with --part "
                "byhand")
    check_folder(p, args.trace)
    check_heads(p, args)
    if args.schedules is not None and args.part not in ("torch", "custom"):
        p.error(f"argument --schedules: --part {args.part} runs no schedule of torch's by name; "
                "allowed: with --part torch or custom")
    if args.schedule is not None and args.part != "custom":
        p.error(f"argument --schedule: --part {args.part} takes no schedule file; allowed: with "
                "--part custom (torch's schedules by name: --part torch --schedules)")
    if args.stages is not None and args.part != "custom":
        p.error(f"argument --stages: --part {args.part} sets its stages itself; allowed: with "
                "--part custom")
    if args.schedules is None:
        args.schedules = () if args.part == "custom" else SCHEDULES
    if args.microbatches is None and args.part != "custom":
        args.microbatches = 8
    return args, p


def schedule_list(text: str) -> tuple[str, ...]:
    """--schedules: names of torch's schedules, comma-separated, or "all"."""
    if text.strip() == "all":
        return ALL
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    bad = [n for n in names if n not in ALL]
    if bad or not names or len(set(names)) != len(names):
        why = (f"{', '.join(map(repr, bad))} is not one" if bad else
               "names a schedule twice" if names else "names none")
        raise argparse.ArgumentTypeError(f"{text!r} {why}; allowed: all, or some of "
                                         f"{', '.join(ALL)}, comma-separated")
    return names


def check_sizes(p: argparse.ArgumentParser, args, world: int) -> None:
    """Refuse sizes the ranks cannot split: equal stages (layers, and interleaved chunks, or the
    V's two stages per rank), interleaved m a multiple of the stages (as labkit.pipeline and
    Megatron-LM), DualPipeV m at least the stages, ppdp 4 ranks. --part custom: its schedule
    files (labkit.labs.pp.custom.prepare)."""
    pp = 2 if args.part == "ppdp" else world
    if args.part == "ppdp" and world != 4:
        p.error(f"--part ppdp runs pp 2 x dp 2: {world} ranks given; allowed: 4 (-n 4)")
    if world < 2:
        p.error(f"a pipeline needs at least 2 ranks, {world} given; allowed: -n 2 or more")
    if args.part == "custom":
        _custom().prepare(p, args, world)
        if not args.schedules:
            return
        args = named_args(args)
    names = args.schedules if args.part in ("torch", "custom") else ()
    per_rank = {n: chunks_of(n, args.chunks) for n in names}
    virtual = pp * max(per_rank.values(), default=1)
    for n in sorted(per_rank, key=lambda n: -per_rank[n]):
        if args.layers % (pp * per_rank[n]):
            virtual = pp * per_rank[n]
            how = (f"{pp} ranks x --chunks {args.chunks}" if n == "interleaved-1f1b" else
                   f"{pp} ranks x 2, {n}'s V" if n in V_SHAPED else f"{pp} ranks")
            p.error(f"argument --layers: {args.layers} does not split into {virtual} equal "
                    f"stages ({how}); allowed: a multiple of {virtual}")
    if args.layers % virtual:
        p.error(f"argument --layers: {args.layers} does not split into {virtual} equal stages "
                f"({pp} ranks); allowed: a multiple of {virtual}")
    if "interleaved-1f1b" in names and args.microbatches % world:
        p.error(f"argument --microbatches: {args.microbatches} is not a multiple of the {world} "
                f"stages (interleaved 1F1B needs it); allowed: a multiple of {world}")
    if "dualpipev" in names and args.microbatches < 2 * world:
        p.error(f"argument --microbatches: {args.microbatches} is fewer than dualpipev's "
                f"{2 * world} stages (torch's ScheduleDualPipeV refuses it); allowed: "
                f"{2 * world} or more")
    if args.part != "ppdp" and args.microbatches < world:
        p.error(f"argument --microbatches: {args.microbatches} is fewer than the {world} stages "
                f"(torch's Schedule1F1B refuses it); allowed: {world} or more")


@record
def main(argv: list[str] | None = None) -> None:
    args, p = parse_args(argv)
    run_and_report(RUN[args.part], PRINT[args.part], args,
                   check=lambda world: check_sizes(p, args, world))


if __name__ == "__main__":
    main()
