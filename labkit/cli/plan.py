"""`labkit plan MODEL --gpus N ...`: the best layout of a model on a cluster, the top K with
their step-time breakdown, and how many layouts were rejected for each reason (with examples);
a view over labkit.planner.plan. Bad input is a message and exit 2; exit 1 when nothing fits.

    labkit plan llama3-405b --gpus 16384 --gpu h100-sxm --global-batch 2048 --seq-len 8192
    labkit plan llama3.2-1b --gpus 8 --top 5
    labkit plan llama3-405b --gpus 8          # nothing fits, and why
    labkit plan llama3-405b --gpus 16384 --global-batch 2048 --seq-len 8192 \
        --compare "tp=8+sp pp=16 v=2 dp=128 fsdp recompute=full"   # why it ranks there
"""
from __future__ import annotations

import sys

EXAMPLES = 2       # rejected layouts shown per reason


def add_arguments(parser):
    parser.add_argument("model", help="a preset (e.g. llama3-70b, gpt3-175b, llama3.2-1b)")
    parser.add_argument("--gpus", type=int, required=True, help="GPUs in the job")
    parser.add_argument("--gpu", default="h100-sxm", help="GPU type (default h100-sxm)")
    parser.add_argument("--gpus-per-node", type=int, default=8,
                        help="GPUs joined by the intra-node link (default 8)")
    parser.add_argument("--global-batch", type=int, default=None,
                        help="sequences per step (default: about 4M tokens)")
    parser.add_argument("--seq-len", type=int, default=None,
                        help="tokens per sequence (default: the model's context, at most 8192)")
    parser.add_argument("--precision", default="bf16-mixed", help="default bf16-mixed")
    parser.add_argument("--optimizer", default="adamw", help="default adamw")
    parser.add_argument("--mfu", type=float, default=None,
                        help="share of the dense peak large matmuls reach (default: the GPU's "
                             "measured ceiling x 0.85, labkit.kernels)")
    parser.add_argument("--framework", default="megatron",
                        help="whose kernels and host costs: megatron | nanotron (default "
                             "megatron)")
    parser.add_argument("--intra-link", default=None, help="e.g. nvlink4 (default: the GPU's)")
    parser.add_argument("--inter-link", default=None, help="e.g. ib-ndr (default: by GPU)")
    parser.add_argument("--max-microbatch", type=int, default=8,
                        help="largest micro-batch size tried (powers of two; default 8)")
    parser.add_argument("--schedule", default="1f1b", help="1f1b | gpipe (default 1f1b)")
    parser.add_argument("--top", type=int, default=10, help="layouts listed (default 10)")
    parser.add_argument("--compare", default=None, metavar="LAYOUT",
                        help='a layout to compare with the best, part by part, e.g. '
                             '"tp=8 pp=16 dp=128 fsdp recompute=full" (+sp after tp: sequence '
                             'parallelism; v=2: interleaved chunks)')


def run(args) -> int:
    from labkit import validate
    from labkit.planner import parse_layout, plan

    try:
        top = validate.positive_int("--top", args.top, 10_000)
        compare = None if args.compare is None else parse_layout(args.compare)
        p = plan(args.model, args.gpus, gpu=args.gpu, gpus_per_node=args.gpus_per_node,
                 global_batch=args.global_batch, seq_len=args.seq_len,
                 precision=args.precision, optimizer=args.optimizer, mfu=args.mfu,
                 intra_link=args.intra_link, inter_link=args.inter_link,
                 max_microbatch=args.max_microbatch, schedule=args.schedule,
                 framework=args.framework)
    except ValueError as exc:
        print(f"labkit plan: {exc}", file=sys.stderr)
        return 2
    i = p.inputs
    print(f"{i['model']} on {i['gpus']:,} x {i['gpu']} ({i['gpus_per_node']} per node; TP "
          f"links: {i['intra_link']}, across nodes: {i['inter_link']}); global batch "
          f"{i['global_batch']:,} x {i['seq_len']:,} tokens, {i['precision']}, {i['optimizer']}, "
          f"matmuls at {100 * i['mfu']:.3g} % of peak, {i['schedule']}, "
          f"{i['framework']} kernels; usable memory {i['usable'] / 1e9:.1f} GB per GPU")
    print(p.why())
    if p.ranked:
        print()
        print(f"top {min(top, len(p.ranked))} (seconds per step by part):")
        print(p.table(top))
    print()
    print(f"rejected {len(p.rejected):,} layouts:")
    for kind, count in p.rejection_counts().most_common():
        print(f"  {kind}: {count:,}")
        for r in [r for r in p.rejected if r.kind == kind][:EXAMPLES]:
            print(f"    e.g. {r.layout}: {r.reason.split(': ', 1)[1]}")
    if compare is not None:
        print()
        try:
            print(p.compare(compare).text())
        except ValueError as exc:
            print(f"labkit plan: --compare: {exc}", file=sys.stderr)
            return 2
    return 0 if p.ranked else 1
