"""`labkit mem MODEL ...`: per-GPU training memory, a view over labkit.memory.estimate_memory.
When the plan does not fit on the GPU, it shows the smallest changes that would make it fit,
each computed with estimate_memory (recomputation first: it costs no GPUs).

    labkit mem llama2-70b --zero 3 --dp 64
    labkit mem llama2-7b --tp 2 --pp 2 --seq-len 4096 --recompute selective --gpu a100-80gb
    labkit mem 7.5e9 --precision fp16-mixed --optimizer adam --zero 1 --dp 64
    labkit mem gpt2 --seq-len 1024 --batch-size 8 --implementation megatron --attention eager
    labkit mem llama2-7b --zero 3 --dp 8 --offload params
"""
from __future__ import annotations

import itertools
import sys

MAX_PAIRS = 5   # two-lever changes shown when no single lever is enough


def add_arguments(parser):
    parser.add_argument("model", help="a preset (e.g. llama2-7b, gpt2, debug) or a parameter "
                        "count (e.g. 7.5e9: model states only)")
    parser.add_argument("--precision", default="bf16-mixed",
                        help="fp32 | fp16-mixed | bf16-mixed | bf16 (default bf16-mixed)")
    parser.add_argument("--optimizer", default="adamw",
                        help="sgd | sgd-momentum | adam | adamw | adamw-8bit (default adamw)")
    parser.add_argument("--zero", type=int, default=0, help="ZeRO stage 0-3 over dp (default 0)")
    for name in ("dp", "tp", "pp", "cp"):
        parser.add_argument(f"--{name}", type=int, default=1, help=f"{name} degree (default 1)")
    parser.add_argument("--batch-size", type=int, default=1,
                        help="micro-batch size in sequences (default 1)")
    parser.add_argument("--seq-len", type=int, default=None,
                        help="tokens per sequence (default: the model's context length)")
    parser.add_argument("--microbatches", type=int, default=1,
                        help="micro-batches per step (default 1)")
    parser.add_argument("--schedule", default="1f1b", help="pipeline schedule: 1f1b | gpipe")
    parser.add_argument("--sequence-parallel", action="store_true",
                        help="Megatron sequence parallelism (with tp > 1)")
    parser.add_argument("--recompute", default="none", help="none | selective | full")
    parser.add_argument("--implementation", default=None,
                        help="whose activations: megatron | hf-gpt2 | hf-llama (default: from "
                        "the model, transformers' own for GPT-2 and Llama)")
    parser.add_argument("--attention", default=None,
                        help="eager (s x s scores kept) | sdpa (fused; default for transformers)")
    parser.add_argument("--offload", default="none",
                        help="none | optimizer (ZeRO-Offload) | params (ZeRO-3 / FSDP2 CPU "
                        "offload): the offloaded states are listed as host memory")
    parser.add_argument("--gpu", default="h100-sxm",
                        help="GPU to check the fit against (default h100-sxm)")


def _model_arg(text: str):
    try:
        return float(text)
    except ValueError:
        return text


# The levers `labkit mem` tries when a plan does not fit, cheapest first: (flags, the change
# to estimate_memory's arguments) for each step of each lever, smallest step first.
def _levers(kw: dict) -> list[list[tuple[str, dict]]]:
    from labkit.memory import RECOMPUTE

    more = [r for r in RECOMPUTE if RECOMPUTE.index(r) > RECOMPUTE.index(kw["recompute"])]
    return [
        [(f"--recompute {r}", {"recompute": r}) for r in more],
        [("--sequence-parallel", {"sequence_parallel": True})] if kw["tp"] > 1 and not kw["sequence_parallel"] else [],
        [(f"--zero {z}", {"zero_stage": z}) for z in range(kw["zero_stage"] + 1, 4)] if kw["dp"] > 1 else [],
        [(f"--dp {kw['dp'] * k}", {"dp": kw["dp"] * k}) for k in (2, 4, 8)] if kw["zero_stage"] else [],
        [(f"--tp {t} --sequence-parallel", {"tp": t, "sequence_parallel": True})
         for t in (2, 4, 8) if t > kw["tp"]],
        [(f"--pp {p} --microbatches {max(p, kw['microbatches'])}",
          {"pp": p, "microbatches": max(p, kw["microbatches"])}) for p in (2, 4, 8, 16, 32, 64) if p > kw["pp"]],
        [(f"--cp {c}", {"cp": c}) for c in (2, 4, 8) if c > kw["cp"]],
        [(f"--batch-size {b}", {"batch_size": b}) for b in (1, 2, 4, 8) if b < kw["batch_size"]][::-1],
    ]


def what_fits(model, kw: dict, gpu) -> list[tuple[str, object]]:
    """The smallest changes of `kw` (estimate_memory's arguments) that make `model` fit on `gpu`,
    each as (flags, estimate): for every lever its first step that fits; when no single lever
    is enough, the first fitting step of each pair of levers. Empty when none fits."""
    from labkit.memory import estimate_memory

    def fitting(changes: dict):
        try:
            m = estimate_memory(model, **{**kw, **changes})
        except ValueError:          # a step this model does not allow (tp not dividing heads)
            return None
        return m if m.fits(gpu) else None

    levers = [steps for steps in _levers(kw) if steps]
    singles = [next(((f, m) for f, m in ((f, fitting(c)) for f, c in steps) if m), None)
               for steps in levers]
    if any(singles):
        return [s for s in singles if s]
    pairs = []
    for i, a in enumerate(levers):
        for b in levers[i + 1:]:
            both = sorted(itertools.product(enumerate(a), enumerate(b)), key=lambda p: p[0][0] + p[1][0])
            pairs += [(f"{fa} {fb}", m) for (_, (fa, ca)), (_, (fb, cb)) in both
                      if (m := fitting({**ca, **cb}))][:1]
    return pairs[:MAX_PAIRS]


def run(args) -> int:
    from labkit.hardware import GB, GiB, get_gpu
    from labkit.memory import estimate_memory

    model = _model_arg(args.model)
    kw = dict(batch_size=args.batch_size, seq_len=args.seq_len, precision=args.precision,
              optimizer=args.optimizer, zero_stage=args.zero, dp=args.dp, tp=args.tp, pp=args.pp,
              cp=args.cp, sequence_parallel=args.sequence_parallel, recompute=args.recompute,
              microbatches=args.microbatches, schedule=args.schedule,
              implementation=args.implementation, attention=args.attention,
              offload=args.offload)
    try:
        if args.sequence_parallel and args.tp == 1:
            raise ValueError("--sequence-parallel needs --tp > 1 (it splits across the tensor-"
                             "parallel ranks the activations they would each keep whole); got --tp=1")
        m = estimate_memory(model, **kw)
        gpu = get_gpu(args.gpu)
    except ValueError as exc:
        print(f"labkit mem: {exc}", file=sys.stderr)
        return 2
    i = m.inputs
    print(f"{i['model']}: per-GPU training memory (worst pipeline stage: {m.stage})")
    print(f"  precision={i['precision']} optimizer={i['optimizer']} zero={i['zero_stage']} "
          f"dp={i['dp']} tp={i['tp']} pp={i['pp']} cp={i['cp']}"
          + (f" micro-batch={i['batch_size']} seq_len={i['seq_len']} "
             f"microbatches={i['microbatches']} recompute={i['recompute']}"
             + (" sequence-parallel" if i['sequence_parallel'] else "")
             if i["seq_len"] is not None else ""))
    print()
    print(m.table())
    print()
    verdict = "fits" if m.fits(gpu) else "does NOT fit"
    print(f"{verdict} on {gpu.name}: {m.total / GB:.2f} GB of {gpu.memory / GB:.0f} GB "
          f"({m.total / GiB:.2f} GiB of {gpu.memory_gib:.2f} GiB; GB = 1e9 bytes, GiB = 2**30)")
    if not m.fits(gpu):
        _print_fixes(model, kw, gpu)
    return 0


def _print_fixes(model, kw: dict, gpu) -> None:
    from labkit.hardware import GB

    fixes = what_fits(model, kw, gpu)
    if not fixes:
        print("no change of one or two levers (recompute, ZeRO, dp, tp, pp, cp, micro-batch size) "
              "makes it fit: shard over more GPUs (--zero 3 with a larger --dp), shorten --seq-len, "
              "or pick a GPU with more memory (--gpu)")
        return
    print(f"it fits on {gpu.name} with" + (" one of these changes:" if len(fixes) > 1 else ":"))
    width = max(len(flags) for flags, _ in fixes)
    for flags, fixed in fixes:
        print(f"  {flags:<{width}}  {fixed.total / GB:8.2f} GB")
