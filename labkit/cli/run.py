"""`labkit run LAB [-n N] [--timeout S] [--launcher pool|torchrun] [-- LAB ARGS]`: run a lab.

    labkit run hello -n 2
    labkit run hello -n 2 --launcher torchrun          # the standard path, for comparison
    labkit run path/to/lab.py -n 2 -- --steps 10        # lab arguments after --
    # two nodes (run on each, same endpoint; R = 0 on the node that hosts the endpoint):
    labkit run hello -n 4 --nnodes 2 --node-rank R --rdzv-endpoint HOST:29400
    # on one machine, node 1 adds --local-addr 127.0.0.2 (docs/multinode.md)

Exit status: 0 when every rank succeeded, 1 when the lab failed (the reason is printed),
2 for bad arguments, 130 when interrupted. Which launcher runs it: `run`.
"""
from __future__ import annotations

import argparse
import sys


def _add_options(parser: argparse.ArgumentParser, default=None) -> None:
    def d(value):
        return value if default is None else default
    parser.add_argument("-n", "--nproc-per-node", "--nproc", dest="nproc", type=int,
                        default=d(None),
                        help="ranks per node (default: one per GPU, else min(4, cores), >= 2)")
    parser.add_argument("--timeout", type=float, default=d(600.0),
                        help="seconds before every rank is stopped (default 600; 0: none)")
    parser.add_argument("--nnodes", type=int, default=d(1), help="number of nodes (default 1)")
    parser.add_argument("--max-restarts", type=int, default=d(0),
                        help="times torchrun may restart every rank after one fails (default 0;"
                             " > 0 runs under torchrun: the lab resumes from its checkpoint)")
    parser.add_argument("--node-rank", type=int, default=d(None),
                        help="this node's rank (torchrun uses it for static rendezvous)")
    parser.add_argument("--rdzv-endpoint", default=d(None),
                        help="HOST:PORT of the rendezvous, the same on every node")
    parser.add_argument("--local-addr", default=d(None),
                        help="this node's own address, if not its host name's (127.0.0.2 "
                             "simulates a second node on one machine)")
    parser.add_argument("--rdzv-id", default=d(None),
                        help="job id, the same on every node (default: labkit-<lab>)")
    parser.add_argument("--verbose", action="store_true", default=d(False),
                        help="also show torchrun's own log")
    parser.add_argument("--oversubscribe", action="store_true", default=d(False),
                        help="start more ranks than this machine holds (refused otherwise)")
    parser.add_argument("--launcher", choices=["auto", "pool", "torchrun"], default=d(None),
                        help="pool: ranks forked from a warm process (one Linux machine); "
                             "torchrun: python -m torch.distributed.run; auto (default, or "
                             "LABKIT_LAUNCHER): the pool where it can")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    _add_options(parser)
    parser.add_argument("lab", help="a lab name (hello), a module (labkit.labs.hello) or a .py path")
    parser.add_argument("lab_args", nargs=argparse.REMAINDER,
                        help="the lab's arguments; options of this command may come first, "
                             "anything after -- goes to the lab")


def _split(args) -> list[str]:
    """Options given after the lab name are still ours; what we do not know goes to the lab."""
    rest = list(args.lab_args)
    after = []
    if "--" in rest:
        i = rest.index("--")
        rest, after = rest[:i], rest[i + 1:]
    # Its errors read like the command's own: "usage: labkit run ..." (not the script's name).
    full = argparse.ArgumentParser(prog="labkit run")
    add_arguments(full)
    late = argparse.ArgumentParser(prog="labkit run", usage=full.format_usage()[len("usage: "):],
                                   add_help=False)
    _add_options(late, default=argparse.SUPPRESS)
    known, unknown = late.parse_known_args(rest)
    for key, value in vars(known).items():
        setattr(args, key, value)
    return unknown + after


def _check_nodes(nnodes: int, node_rank: int | None) -> None:
    from labkit.validate import positive_int

    nnodes = positive_int("--nnodes", nnodes)
    if node_rank is not None and not 0 <= node_rank < nnodes:
        raise ValueError(f"--node-rank={node_rank} is not a node of --nnodes={nnodes}; allowed: "
                         + ("0" if nnodes == 1 else f"0 to {nnodes - 1}"))


def run(args) -> int:
    """Run the lab through run_lab. On one Linux machine the ranks are forked from a warm pool
    (labkit.runtime.pool); across nodes, or with `--launcher torchrun` (or
    LABKIT_LAUNCHER=torchrun), they run under torchrun. From the shell each command starts its
    own pool, so the gain is in notebooks and tests, which run many labs."""
    from labkit.runtime.launch import LabError, run_lab

    lab_args = _split(args)
    rdzv_id = args.rdzv_id          # None: run_lab names it after the lab, as on every node
    try:
        _check_nodes(args.nnodes, args.node_rank)
        result = run_lab(args.lab, nproc=args.nproc, args=lab_args,
                         timeout=args.timeout or None, nnodes=args.nnodes,
                         node_rank=args.node_rank, rdzv_endpoint=args.rdzv_endpoint,
                         rdzv_id=rdzv_id, local_addr=args.local_addr, verbose=args.verbose,
                         oversubscribe=args.oversubscribe or None, launcher=args.launcher,
                         max_restarts=args.max_restarts)
    except ValueError as exc:
        print(f"labkit run: {exc}", file=sys.stderr)
        return 2
    except LabError as exc:
        print(f"labkit run: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    ranks = [r for r in result.ranks if r.wall_time is not None]
    print(f"labkit run: {result.target} finished on {len(ranks)} rank(s) in "
          f"{result.wall_time:.1f} s ({result.launcher})", file=sys.stderr)
    for f in result.failures:          # --max-restarts: what each earlier attempt died of
        print(f"labkit run: attempt {f['attempt']} failed ({f['message']}); torchrun "
              "restarted the ranks", file=sys.stderr)
    return 0
