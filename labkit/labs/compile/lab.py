"""Compile lab: torch.compile with DDP and FSDP2 on a small transformers Llama, on gloo ranks.

    labkit run compile -n 2 -- --part ddp        # eager DDP vs torch.compile(ddp_model)
    labkit run compile -n 2 -- --part fsdp       # eager FSDP2 vs compile each block, then shard
    labkit run compile -n 2 -- --part order      # the wrong orders and recompiles, as data
    labkit run compile -n 2 -- --part ddp --backend aot_eager   # no C++ compiler needed

From a notebook: `run_lab("labkit.labs.compile", nproc=2, args=["--part", "ddp"])`. Inductor
needs a C++ compiler; without one the lab says what to install and runs aot_eager. Graphs, graph
breaks and recompiles are dynamo's counters (labkit.labs.compile.tools); docs/labs.md, ## compile.
"""
from __future__ import annotations

import argparse
import os

import torch
from torch.distributed.elastic.multiprocessing.errors import record

from labkit.labs.common.flags import between, check_heads, model_flags, positive_int
from labkit.labs.common.flags import run_and_report
from labkit.labs.compile import tools

PARTS = ("ddp", "fsdp", "order")
# Loss parity eager vs compiled, absolute, on a loss near ln(vocab) = 8.3: aot_eager and eager
# run the same kernels (bitwise equal here); inductor fuses and reorders float sums.
TOLERANCE = {"eager": 1e-5, "aot_eager": 1e-5, "inductor": 1e-3}


def run(args, ctx) -> dict:
    from labkit.labs.compile.order import run_order
    from labkit.labs.compile.parts import run_ddp, run_fsdp

    tools.quiet()
    if args.cold_cache:     # this rank's own empty FX graph cache, gone when the run ends
        import tempfile
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="labkit-inductor-")
    backend, cxx, note = tools.choose_backend(args.backend, args.cxx)
    if note and ctx.rank == 0:
        print(f"note: {note}", flush=True)
    args.backend = backend
    if args.tol is None:
        args.tol = TOLERANCE[backend]
    try:
        out = {"ddp": run_ddp, "fsdp": run_fsdp, "order": run_order}[args.part](args, ctx)
    finally:
        if args.cold_cache:
            import shutil
            shutil.rmtree(os.environ["TORCHINDUCTOR_CACHE_DIR"], ignore_errors=True)
    return dict(out, rank=ctx.rank, world_size=ctx.world_size, backend=backend,
                backend_wanted=args.backend_wanted, cxx=cxx, note=note,
                torch=torch.__version__, layers=args.layers, hidden=args.hidden,
                vocab=args.vocab, seq=args.seq, batch=args.batch, steps=args.steps,
                **tools.inductor_env())


def ms(x: float) -> str:
    return f"{1e3 * x:.1f}"


def timing(r: dict) -> str:
    return (f"step {ms(r['step_s'])} ms (min {ms(r['step_min_s'])}, max {ms(r['step_max_s'])}), "
            f"first step {r['first_s']:.2f} s")


def counts(r: dict) -> str:
    text = (f"graphs {r['graphs']}, handed to the backend {r['backend_graphs']}, breaks "
            f"{r['breaks']}, frames compiled {r['frames']}, recompiles {r['recompiles']}")
    if r.get("refused"):
        text += f", refused {r['refused']}"
    if r.get("cache_hits") or r.get("cache_misses"):
        text += f", FX cache hits {r['cache_hits']} misses {r['cache_misses']}"
    return text


def reasons(r: dict, indent: str = "    ") -> None:
    for why, n in list(r.get("break_reasons", {}).items())[:4]:
        print(f"{indent}break x{n}: {why}")
    for why in r.get("recompile_reasons", [])[:2]:
        print(f"{indent}recompile: {why}")
    for why in r.get("refused_reasons", [])[:1]:
        print(f"{indent}refused: {why}")


def head(r: dict) -> None:
    print(f"torch {r['torch']}, backend {r['backend']}"
          + (f" (asked for {r['backend_wanted']})" if r['backend'] != r['backend_wanted'] else "")
          + f", {r['world_size']} ranks; Llama {r['layers']} block(s), h {r['hidden']}, "
            f"vocab {r['vocab']}, {r['batch']} x {r['seq']} tokens per rank, {r['steps']} steps")


def show_pair(r: dict) -> None:
    head(r)
    for name, run_ in r["runs"].items():
        print(f"  {name:<9}{timing(run_)}")
    c = r["runs"]["compiled"]
    print(f"  compiled: {counts(c)}")
    reasons(c)
    print(f"  loss parity: max |eager - compiled| {r['loss_max_diff']:.2e} "
          f"(tolerance {r['tolerance']:g}): {'ok' if r['parity_ok'] else 'DIFFERENT'}")
    if r["part"] == "ddp":
        sub = ", ".join(f"{g['param_bytes']:,}" for g in c["subgraphs"])
        print(f"  DDP buckets (bucket_cap_mb {r['bucket_mb']:g}): eager "
              f"{r['runs']['eager']['ddp_buckets']}, in the compiled run {c['ddp_buckets']}")
        print(f"  DDPOptimizer's subgraphs: {len(c['subgraphs'])}, parameter bytes {sub}")
    else:
        print(f"  {r['blocks']} blocks compiled one by one: {c['graphs']} graph(s) traced")


def show_order(r: dict) -> None:
    head(r)
    for name, c in r["cases"].items():
        if "graphs" not in c:
            print(f"  {name:<18}{timing(c)}")
            continue
        if c["error"]:
            print(f"  {name:<18}FAILED: {c['error']}: {c['error_line']}")
        elif name.startswith("dynamic"):
            print(f"  {name:<18}seconds per step " + " ".join(f"{x:.2f}" for x in c["secs"])
                  + f"; graphs per step {c['new_graphs']}")
        else:
            print(f"  {name:<18}{timing(c)}")
        print(f"  {'':<18}{counts(c)}")
        reasons(c, " " * 20)
    c = r["cases"]["ddp_compile_first"]
    print(f"  DDP's buckets {r['cases']['ddp_eager']['ddp_buckets']}; compiled first, then "
          f"wrapped: {c['backend_graphs']} subgraph(s) (wrapped first: --part ddp)")
    for key in ("fsdp_whole_parity", "ddp_compile_first_parity"):
        p = r[key]
        print(f"  {key}: max diff {p['loss_max_diff']:.2e} (tolerance {p['tolerance']:g})")
    print(f"  sequence lengths per step {r['seqs']}; recompile_limit {r['recompile_limit']} "
          f"for dynamic=False and the kv_cache cases (default {r['default_recompile_limit']})")
    print(f"  kv_cache: {r['deep_blocks']} blocks, each compiled; with transformers' KV cache "
          f"on, graphs {r['cases']['kv_cache_on']['graphs']} (refused "
          f"{r['cases']['kv_cache_on']['refused']}: those blocks ran eagerly), off "
          f"{r['cases']['kv_cache_off']['graphs']}")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--part", choices=PARTS, default="ddp", help="what to run (default ddp)")
    p.add_argument("--backend", choices=tools.BACKENDS, default=None,
                   help="torch.compile backend (default inductor, aot_eager without a C++ "
                        "compiler; --part order: aot_eager, since its cases are about dynamo's "
                        "graphs, breaks and recompiles, the same for every backend)")
    p.add_argument("--cxx", default=None, help="C++ compiler inductor uses (default: torch's "
                   "torch._inductor.config.cpp.cxx, from $CXX, else g++)")
    model_flags(p, layers=1, hidden=64, heads=4, vocab=4096, seq=16)
    p.add_argument("--steps", type=positive_int, default=5,
                   help="steps per run (>= 3: the first includes compiling; default 5)")
    p.add_argument("--lr", type=between(1e-9, 1, "a learning rate"), default=0.1,
                   help="SGD learning rate (default 0.1)")
    p.add_argument("--seed", type=int, default=0, help="seed of weights and batches (default 0)")
    p.add_argument("--bucket-mb", type=between(1, 1024, "a bucket size in MiB"), default=1.0,
                   help="DDP bucket_cap_mb (default 1: the 4096 x 64 embedding and head fill "
                        "one bucket each; below 1, DDPOptimizer refuses: see --part order)")
    p.add_argument("--small-bucket-mb", type=between(1e-3, 1024, "a bucket size in MiB"),
                   default=0.25, help="--part order: the too-small bucket_cap_mb (default 0.25)")
    p.add_argument("--shape-steps", type=positive_int, default=4,
                   help="--part order: steps with a new sequence length each (default 4)")
    p.add_argument("--recompile-limit", type=positive_int, default=2,
                   help="--part order: recompile_limit for the dynamic=False run (default 2)")
    p.add_argument("--cold-cache", action="store_true",
                   help="compile with an empty inductor cache (a first run's compile time)")
    p.add_argument("--tol", type=between(0, 1, "a loss tolerance"), default=None,
                   help="loss parity tolerance (default: 1e-5; 1e-3 with inductor)")
    args = p.parse_args(argv)
    if args.steps < 3:
        p.error(f"argument --steps: {args.steps} is too few; allowed: >= 3 (the first step "
                "compiles, the others are timed)")
    check_heads(p, args)
    if args.backend is None:
        args.backend = "aot_eager" if args.part == "order" else "inductor"
    args.backend_wanted = args.backend
    return args, p


PRINT = {"ddp": show_pair, "fsdp": show_pair, "order": show_order}


@record
def main(argv: list[str] | None = None) -> None:
    args, _ = parse_args(argv)
    run_and_report(run, PRINT[args.part], args)


if __name__ == "__main__":
    main()
