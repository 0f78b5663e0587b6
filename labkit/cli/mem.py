"""`labkit mem MODEL ...`: per-GPU training memory, a view over labkit.memory.estimate_memory.

    labkit mem llama2-70b --zero 3 --dp 64
    labkit mem llama2-7b --tp 2 --pp 2 --seq-len 4096 --recompute selective --gpu a100-80gb
    labkit mem 7.5e9 --precision fp16-mixed --optimizer adam --zero 1 --dp 64
"""
from __future__ import annotations

import sys


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
    parser.add_argument("--gpu", default="h100-sxm",
                        help="GPU to check the fit against (default h100-sxm)")


def _model_arg(text: str):
    try:
        return float(text)
    except ValueError:
        return text


def run(args) -> int:
    from labkit.hardware import GB, GiB, get_gpu
    from labkit.memory import estimate_memory

    try:
        m = estimate_memory(
            _model_arg(args.model), batch_size=args.batch_size, seq_len=args.seq_len,
            precision=args.precision, optimizer=args.optimizer, zero_stage=args.zero,
            dp=args.dp, tp=args.tp, pp=args.pp, cp=args.cp,
            sequence_parallel=args.sequence_parallel, recompute=args.recompute,
            microbatches=args.microbatches, schedule=args.schedule)
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
    return 0
