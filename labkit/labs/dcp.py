"""DCP lab: torch.distributed.checkpoint on an FSDP2 model, one part at a time.

    labkit run dcp -n 4 -- --part save        # sharded save + load: files and bytes per rank
    labkit run dcp -n 4 -- --part async       # dcp.async_save: returns, then plans and writes
    labkit run dcp -n 4 -- --part reshard --ckpt-dir /tmp/r    # saves (no checkpoint there yet)
    labkit run dcp -n 2 -- --part reshard --ckpt-dir /tmp/r    # loads it on 2 ranks, compares
    labkit run dcp -n 4 -- --part export      # one consolidated file for a plain transformers model

From a notebook: `run_lab("labkit.labs.dcp", nproc=4, args=["--part", "save"])`; rank 0 reports
every figure (labkit.runtime.dist.report). The model is the crash lab's (labkit.labs.checkpoint).
What each part does and measures (labkit.parallel.checkpoint, dcp.*): docs/labs.md, ## dcp.
"""
from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import threading
import time

import torch
import torch.distributed as tdist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.elastic.multiprocessing.errors import record

from labkit.labs.common import fsdp_lm as lm
from labkit.labs.common.flags import positive_int
from labkit.parallel import checkpoint
from labkit.runtime import dist

PARTS = ("save", "async", "reshard", "export")
REFERENCE = "full_reference.pt"          # reshard: the full tensors the first launch saved
HOLD_S = 20.0                            # async: the longest planning waits for the call's return


def flat(state: dict, prefix: str = "") -> dict:
    """{dotted key: tensor or value} of a nested state dict."""
    out = {}
    for k, v in state.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flat(v, key + "."))
        else:
            out[key] = v
    return out


def local(state: dict) -> dict:
    """This rank's own part of every tensor (a DTensor's local shard), cloned."""
    return {k: (v.to_local() if hasattr(v, "to_local") else v).detach().clone()
            for k, v in flat(state).items() if isinstance(v, torch.Tensor)}


def full(state: dict) -> dict:
    """Every tensor whole (a collective for DTensors: call it on every rank)."""
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
            for k, v in flat(state).items() if isinstance(v, torch.Tensor)}


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def max_diff(a: dict, b: dict) -> float:
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def step(model, opt, args, ctx, t: int = 1) -> float:
    ids = lm.batch(args, t, ctx)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def trained(args, ctx, seed_offset: int = 0):
    args = argparse.Namespace(**{**vars(args), "seed": args.seed + seed_offset})
    model, opt = lm.sharded(args)
    step(model, opt, args, ctx)
    return model, opt


def layout(path: str) -> dict:
    """Per file of a DCP checkpoint: its bytes on disk and the tensor bytes it holds, split into
    sharded tensors and AdamW's step counters (read from DCP's .metadata)."""
    meta = dcp.FileSystemReader(path).read_metadata()
    files = {}
    for index, where in meta.storage_data.items():
        f = files.setdefault(where.relative_path, {"file_bytes": os.path.getsize(
            os.path.join(path, where.relative_path)), "tensor_bytes": 0, "counter_bytes": 0,
            "items": 0})
        md = meta.state_dict_metadata[index.fqn]
        if not hasattr(md, "chunks"):
            continue                                 # a pickled non-tensor value
        chunk = next(c for c in md.chunks if tuple(c.offsets) == tuple(index.offset or
                                                                      (0,) * len(c.offsets)))
        n = md.properties.dtype.itemsize * int(torch.Size(chunk.sizes).numel())
        f["items"] += 1
        f["counter_bytes" if index.fqn.endswith(".step") else "tensor_bytes"] += n
    return dict(sorted(files.items()))


def part_save(args, ctx, where: str) -> dict:
    model, opt = trained(args, ctx)
    P = sum(p.numel() for p in model.parameters())
    tensors = sum(1 for p in model.parameters())
    path = checkpoint.save(model, opt, 1, where)
    before = local(checkpoint.state_dict(model, opt))
    step(model, opt, args, ctx, 2)
    changed = not same(local(checkpoint.state_dict(model, opt)), before)
    loaded_step = checkpoint.load(model, opt, path)
    equal = same(local(checkpoint.state_dict(model, opt)), before)
    out = {"num_params": P, "param_tensors": tensors, "world_size": ctx.world_size,
           "changed_by_a_step": changed, "equal_after_load": equal, "loaded_step": loaded_step,
           "predicted": {"model": 4 * P // ctx.world_size, "optim": 8 * P // ctx.world_size,
                         "counters_total": 4 * tensors}}
    if ctx.rank == 0:
        files = layout(path)
        out["files"] = sorted(os.listdir(path))
        out["by_file"] = files
        out["ratio"] = {f: v["tensor_bytes"] / (12 * P / ctx.world_size)
                        for f, v in files.items()}
        out["counter_bytes_total"] = sum(v["counter_bytes"] for v in files.values())
    return out


def any_done(done: bool) -> bool:
    """Whether any rank's write has finished: the ranks must agree on how many training steps
    to run, or one starts a step's collectives while another has moved on to dcp.load (gloo
    then aborts on mismatched message sizes: seen once in six runs before this)."""
    flag = torch.tensor([1 if done else 0])
    tdist.all_reduce(flag, op=tdist.ReduceOp.MAX)
    return bool(flag.item())


class WatchedPlanner(DefaultSavePlanner):
    """DCP's default save planner, noting on which thread it ran and when (perf_counter) each
    planning step did: set_up (before any of the save's collectives), global (rank 0, after the
    plans' gather), agreed (after the scatter: this rank holds the agreed plan). set_up first
    waits (at most HOLD_S) for `returned`, set by the caller once async_save returned: had
    async_save waited for the plan, it could not have returned, and `held` would be False."""

    def __init__(self, returned: threading.Event):
        super().__init__()
        self.returned, self.times, self.thread, self.held = returned, {}, None, None

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator=False):
        self.thread = threading.current_thread().name
        self.held = self.returned.wait(HOLD_S)
        self.times["set_up"] = time.perf_counter()     # planning goes on from here
        super().set_up_planner(state_dict, storage_meta, is_coordinator)

    def create_global_plan(self, all_plans):
        self.times["global"] = time.perf_counter()
        return super().create_global_plan(all_plans)

    def finish_plan(self, new_plan):
        self.times["agreed"] = time.perf_counter()
        return super().finish_plan(new_plan)


def part_async(args, ctx, where: str) -> dict:
    model, opt = trained(args, ctx)
    state = checkpoint.state_dict(model, opt)
    group = tdist.new_group(backend="gloo")       # the writer thread's collectives, apart
    tdist.barrier()
    t = time.perf_counter()
    copy = local(state)                           # what staging does: copy every local tensor
    copy_s = time.perf_counter() - t
    tdist.barrier()
    t = time.perf_counter()
    dcp.save(state, checkpoint_id=os.path.join(where, "blocking"), process_group=group)
    blocking_s = time.perf_counter() - t
    returned = threading.Event()
    planner = WatchedPlanner(returned)
    tdist.barrier()
    t = time.perf_counter()
    future = dcp.async_save(state, checkpoint_id=os.path.join(where, "async"),
                            process_group=group, planner=planner)
    returned_s = time.perf_counter() - t
    returned.set()                                # planning may begin (it waited for this)
    future = getattr(future, "upload_completion", future)
    steps = 0
    while steps < args.max_steps and not any_done(future.done()):
        step(model, opt, args, ctx, 2 + steps)    # training goes on while the thread writes
        steps += 1
    future.result()
    done_s = time.perf_counter() - t
    after = local(checkpoint.state_dict(model, opt))
    reread = checkpoint.state_dict(model, opt)
    dcp.load(reread, checkpoint_id=os.path.join(where, "async"))
    mine = {"returned_s": returned_s, "held": planner.held, "thread": planner.thread,
            **{f"{k}_s": v - t for k, v in planner.times.items()}}
    ranks = [None] * ctx.world_size
    tdist.all_gather_object(ranks, mine)
    return {"world_size": ctx.world_size, "copy_s": copy_s, "blocking_s": blocking_s,
            "returned_s": returned_s, "done_s": done_s, "steps_while_writing": steps,
            "plan_agreed_s": ranks[0]["agreed_s"], "planning": ranks,
            "planned_after_return": all(r["held"] and r["agreed_s"] > r["returned_s"]
                                        for r in ranks),
            "planning_threads": sorted({r["thread"] for r in ranks}),
            "saved_is_state_at_call": same(local(reread), copy),
            "training_changed_it": steps == 0 or not same(after, copy)}


def part_reshard(args, ctx, where: str) -> dict:
    found = checkpoint.latest(where)
    if args.phase == "save" or (args.phase == "auto" and found is None):
        model, opt = trained(args, ctx)
        checkpoint.save(model, opt, 1, where)
        whole = full(checkpoint.state_dict(model, opt))
        if ctx.rank == 0:
            torch.save(whole, os.path.join(where, REFERENCE))
        return {"phase": "save", "world_size": ctx.world_size, "tensors": len(whole)}
    if found is None:
        raise FileNotFoundError(f"--part reshard --phase load: no complete checkpoint in "
                                f"{where!r}; allowed: a --ckpt-dir a save phase wrote")
    model, opt = trained(args, ctx, seed_offset=1)        # other weights, other moments
    before = full(checkpoint.state_dict(model, opt))
    checkpoint.load(model, opt, found[1])
    after = full(checkpoint.state_dict(model, opt))
    out = {"phase": "load", "world_size": ctx.world_size,
           "saved_by": checkpoint.info(found[1])["world_size"]}
    if ctx.rank == 0:
        ref = torch.load(os.path.join(where, REFERENCE))
        out.update(tensors=len(after), equal=same(after, ref), max_diff=max_diff(after, ref),
                   differed_before=not same(before, ref))
    return out


def part_export(args, ctx, where: str) -> dict:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    model, opt = trained(args, ctx)
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    whole = checkpoint.state_dict(model, opt, options)["model"]   # rank 0 only; {} elsewhere
    dcp.save(get_model_state_dict(model), checkpoint_id=os.path.join(where, "sharded"))
    gen = torch.Generator().manual_seed(99)
    ids = torch.randint(0, args.vocab, (2, args.seq), generator=gen).to(ctx.device)
    with torch.no_grad():
        sharded_logits = model(input_ids=ids).logits      # every rank the same input
    out = {"world_size": ctx.world_size}
    if ctx.rank == 0:
        P = sum(v.numel() for v in whole.values())
        torch.save(whole, os.path.join(where, "model.pt"))
        files = {"model.pt": os.path.getsize(os.path.join(where, "model.pt"))}
        plain = lm.build(argparse.Namespace(**{**vars(args), "seed": args.seed + 1}))
        plain.load_state_dict(torch.load(os.path.join(where, "model.pt")))
        with torch.no_grad():
            diffs = {"torch.save": (plain(input_ids=ids).logits - sharded_logits).abs().max()}
        try:
            from safetensors.torch import load_file, save_file
            save_file(whole, os.path.join(where, "model.safetensors"))
            files["model.safetensors"] = os.path.getsize(os.path.join(where, "model.safetensors"))
            plain.load_state_dict(load_file(os.path.join(where, "model.safetensors")))
            with torch.no_grad():
                diffs["safetensors"] = (plain(input_ids=ids).logits - sharded_logits).abs().max()
        except ImportError:
            pass
        dcp_to_torch_save(os.path.join(where, "sharded"), os.path.join(where, "converted.pt"))
        converted = torch.load(os.path.join(where, "converted.pt"))
        out.update(num_params=P, full_bytes=4 * P, files=files, keys=len(whole),
                   logits_max_diff={k: v.item() for k, v in diffs.items()},
                   converted_equal=same(converted, whole))
    return out


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--part", choices=PARTS, required=True, help="what to show")
    p.add_argument("--ckpt-dir", default=None,
                   help="where checkpoints go (needed by reshard; default: a temporary folder)")
    p.add_argument("--phase", choices=("auto", "save", "load"), default="auto",
                   help="reshard: save, load, or auto (load if --ckpt-dir holds a checkpoint)")
    p.add_argument("--max-steps", type=positive_int, default=20,
                   help="async: at most this many training steps while the save writes")
    lm.model_flags(p)
    args = p.parse_args(argv)
    lm.check_model_flags(p, args)
    if args.part == "reshard" and args.ckpt_dir is None:
        p.error("argument --ckpt-dir: --part reshard runs as two launches that share it; "
                "allowed: a folder")
    if args.phase != "auto" and args.part != "reshard":
        p.error(f"argument --phase: only --part reshard has phases, not --part {args.part}")
    return args


@record
def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    ctx = dist.setup()
    lm.check_world(args, ctx)
    temporary = args.ckpt_dir is None
    box = [tempfile.mkdtemp(prefix="labkit-dcp-") if temporary and ctx.rank == 0 else
           args.ckpt_dir]
    tdist.broadcast_object_list(box)          # one folder for every rank
    try:
        result = globals()[f"part_{args.part}"](args, ctx, box[0])
        if ctx.rank == 0:
            dist.report(part=args.part, **result)
            print({k: v for k, v in result.items() if k not in ("by_file", "planning")},
                  flush=True)
    finally:
        tdist.barrier()
        if temporary and ctx.rank == 0:
            shutil.rmtree(box[0], ignore_errors=True)
    dist.shutdown()


if __name__ == "__main__":
    main()
