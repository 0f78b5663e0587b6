"""Your 2D (tensor + data) parallel composition on real ranks, next to one process: the runner
of module 08's exercise "compose".

    torchrun --nproc-per-node 4 -m labkit.labs.threed.exercise --source my.py --name parallelize

From a notebook (what the exercise does), pass the function itself:

    from labkit.labs.threed.exercise import run_user_2d
    r = run_user_2d(parallelize_2d, nproc=4)       # r.ok, r.problems(), print(r.summary())

The model, the mesh, the contract of `fn` and what is checked: `run_user_2d`'s docstring.
"""
from __future__ import annotations

import argparse
import inspect

import torch

from labkit.labs.common import exercise as shared
from labkit.labs.threed.check import TwoDCheck, layer_linear
from labkit.labs.common.exercise import where_raised, run_exported, stub_message
from labkit.labs.common.tiny_llama import SEED, ROWS, batch, build
from labkit.labs.common.tiny_llama import SGD_LR, plain_step, full_params, max_diff

DEFAULT_TIMEOUT = 90          # seconds; a correct run takes a few seconds once the pool is warm
TP = 2                        # the tensor-parallel degree: SPEC's 2 KV heads allow 2 at most
STEPS = 3


def run_user_2d(fn, nproc: int = 4, timeout: float = DEFAULT_TIMEOUT,
                quiet: bool = True) -> TwoDCheck:
    """Run `fn(model, mesh)` (your TP-then-FSDP composition, defined in a notebook cell or a .py
    file) on `nproc` ranks, a (nproc/2) x 2 mesh ("dp", "tp").
    NotImplementedError for a stub, ValueError for bad arguments,
    labkit.runtime.launch.LabError when a rank fails outside your code.

    Each rank builds module 05's transformers Llama (labkit.labs.fsdp.exercise.SPEC: 2 decoder
    layers, h=64, 4 heads, 2 KV heads, every width divisible by 2 and 4) with the same weights,
    and a named DeviceMesh of shape (nproc / 2, 2), axes ("dp", "tp"): TP innermost, so the two
    ranks of a TP group are neighbours (0-1, 2-3), as on one node. `fn(model, mesh)` must make
    the model tensor-parallel on mesh["tp"] (ColwiseParallel on q_proj, k_proj, v_proj,
    gate_proj, up_proj, RowwiseParallel on o_proj and down_proj, in every decoder layer), then
    shard it with FSDP2 on mesh["dp"] (each decoder layer, then the root): TP first, then FSDP,
    torchtitan's order.

    Measured: the placements of every parameter on the mesh (which axis shards it), each rank's
    parameter bytes against the prediction (a layer's seven Linears / (tp x dp), the rest / dp),
    and three SGD steps (each data-parallel rank on its own rows, the two ranks of a TP group on
    the same rows) whose losses and final parameters must equal one process trained on the whole
    batch."""
    if nproc not in (4, 8):
        raise ValueError(f"nproc={nproc!r}: allowed 4 or 8 (a dp x tp = {TP} mesh with dp >= 2)")
    if not inspect.isfunction(fn):
        raise ValueError(f"run_user_2d takes a function fn(model, mesh) defined in a notebook "
                         f"cell or a .py file; received {fn!r} (a {type(fn).__name__})")
    msg = stub_message(fn.__name__, [lambda: fn(torch.nn.Linear(2, 2), None)])
    if msg:
        raise NotImplementedError(msg)
    res = run_exported(fn, "labkit.labs.threed.exercise", nproc, timeout, quiet, [],
                       "the ranks did not apply the same parallelism in the same order")
    return TwoDCheck.from_reports([res.results[r] for r in range(nproc)], name=fn.__name__,
                                  output=res.output)


# ---------------------------------------------------------------------------------------------
# inside a rank

def predicted_bytes(model, tp: int, dp: int) -> int:
    """Bytes of parameters one rank should hold: each decoder layer's seven Linears split over
    tp x dp ranks, everything else (embeddings, norms, head) over dp."""
    total = 0
    for name, p in model.named_parameters():
        split = tp * dp if layer_linear(name) else dp
        total += p.numel() * p.element_size() // split
    return total


def placements(model) -> dict:
    """{parameter name: {mesh axis: "Shard(dim)" (FSDP2's _StridedShard too, when TP shards
    the same dim), "Replicate" or "Partial"}} ({} for a plain tensor)."""
    from torch.distributed.tensor import DTensor

    out = {}
    for name, p in model.named_parameters():
        if isinstance(p, DTensor):
            dims = p.device_mesh.mesh_dim_names or tuple(f"dim{i}" for i in
                                                         range(p.device_mesh.ndim))
            out[name] = {d: f"Shard({pl.dim})" if hasattr(pl, "dim") else type(pl).__name__
                         for d, pl in zip(dims, p.placements)}
        else:
            out[name] = {}
    return out


def _train(model, opt, step, dp_rank, dp) -> float:
    """One SGD step on this data-parallel rank's rows; the loss averaged over every rank (the TP
    ranks of a group hold the same loss, so this is the mean over the dp ranks)."""
    import torch.distributed as dist

    tokens = batch(step, ROWS * dp)[dp_rank * ROWS:(dp_rank + 1) * ROWS]
    loss = torch.tensor(plain_step(model, opt, tokens))
    dist.all_reduce(loss)
    return float(loss) / dist.get_world_size()


def _2d_task(fn, ctx, out: dict) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    dp = ctx.world_size // TP
    mesh = init_device_mesh("cpu", (dp, TP), mesh_dim_names=("dp", "tp"))
    model = build(SEED)
    out["predicted_bytes"] = predicted_bytes(model, TP, dp)
    out["whole_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())
    returned = fn(model, mesh)
    if isinstance(returned, torch.nn.Module):
        model = returned
    out["placements"] = placements(model)
    out["local_bytes"] = sum((p.to_local() if isinstance(p, DTensor) else p).numel()
                             * p.element_size() for p in model.parameters())
    single = build(SEED)
    opt = torch.optim.SGD(model.parameters(), lr=SGD_LR)
    opt1 = torch.optim.SGD(single.parameters(), lr=SGD_LR)
    dp_rank = mesh["dp"].get_local_rank()
    out["losses"], out["single_losses"] = [], []
    for step in range(STEPS):
        out["losses"].append(_train(model, opt, step, dp_rank, dp))
        out["single_losses"].append(plain_step(single, opt1, batch(step, ROWS * dp)))
    out["diff_single"] = max_diff(full_params(model), full_params(single))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description="check a learner's TP + FSDP composition on ranks")
    p.add_argument("--source", required=True, help="a .py file defining the function")
    p.add_argument("--name", required=True, help="the function fn(model, mesh)")
    args = p.parse_args(argv)

    from labkit.runtime import dist
    ctx = dist.setup()
    torch.set_num_threads(1)
    out = {"error": ""}
    try:
        _2d_task(shared.load_source(args.source, args.name), ctx, out)
    except Exception as exc:  # noqa: BLE001 - the learner's code may raise anything
        out["error"] = f"your {args.name} raised {where_raised(exc, args.source)}"
    shared.note_refusal(out)         # the rank guard's (labkit.course.forbid), if any
    dist.report(**out)
    dist.print0(f"2D on {ctx.world_size} ranks: {'raised' if out['error'] else 'ran'}")
    dist.shutdown()


__all__ = ["run_user_2d", "predicted_bytes", "placements", "main"]

if __name__ == "__main__":
    main()
