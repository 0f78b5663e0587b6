"""--part mesh of labkit.labs.threed: the DeviceMesh's groups, and who talks on each axis.

Degrees(dp=2, tp=2) on 4 ranks, Degrees(pp=2, dp=2, tp=2) on 8 (world size picks), built with
labkit.parallel.mesh's `build_mesh` (init_device_mesh with named axes pp, dp, cp, tp; TP
innermost). Reported per axis:
- the groups read from the DeviceMesh itself (the lines of its rank array along that axis) and
  the ranks of this rank's group as its ProcessGroup says (torch.distributed
  .get_process_group_ranks(mesh[axis].get_group())), beside `Degrees.groups(axis)` (pure
  Python, no ranks): equal when the mesh is what the formula says;
- one all-reduce per axis of a one-hot vector (1 at this rank's index): the sum shows exactly
  which ranks took part, so "who talked to whom" is measured, not assumed.
"""
from __future__ import annotations

import torch
import torch.distributed as tdist

from labkit.labs.threed import shared

DEGREES = {4: dict(dp=2, tp=2), 8: dict(pp=2, dp=2, tp=2)}


def degrees_for(world: int):
    from labkit.parallel.mesh import Degrees

    if world not in DEGREES:
        raise ValueError(f"--part mesh runs on {world} ranks; allowed: -n 4 (dp2 x tp2) or "
                         f"-n 8 (pp2 x dp2 x tp2)")
    return Degrees(**DEGREES[world])


def run_mesh(args, ctx) -> dict:
    deg = degrees_for(ctx.world_size)
    mesh = deg.build_mesh(ctx.device.type)
    from_mesh = shared.axis_groups(mesh)
    axes = {}
    for axis in mesh.mesh_dim_names:
        group = mesh[axis].get_group()
        onehot = torch.zeros(ctx.world_size, device=ctx.device)
        onehot[ctx.rank] = 1.0
        tdist.all_reduce(onehot, group=group)
        talked = [r for r, v in enumerate(onehot.tolist()) if v == 1.0]
        mine = tdist.get_process_group_ranks(group)
        formula = deg.groups(axis)
        axes[axis] = dict(size=mesh[axis].size(), local_rank=mesh[axis].get_local_rank(),
                          groups_from_mesh=from_mesh[axis], groups_formula=formula,
                          groups_equal=from_mesh[axis] == formula,
                          my_group=sorted(mine), my_group_in_formula=sorted(mine) in formula,
                          all_reduce_ranks=talked, all_reduce_equals_group=talked == sorted(mine))
    return dict(part="mesh", rank=ctx.rank, world_size=ctx.world_size, degrees=str(deg),
                shape=list(deg.shape), coords=deg.coords(ctx.rank), axes=axes,
                all_equal=all(a["groups_equal"] and a["my_group_in_formula"]
                              and a["all_reduce_equals_group"] for a in axes.values()))


def print_mesh(r: dict) -> None:
    print(f"{r['degrees']}: mesh shape (pp, dp, cp, tp) = {tuple(r['shape'])}")
    for axis, a in r["axes"].items():
        if a["size"] == 1:
            continue
        same = "=" if a["groups_equal"] else "!="
        print(f"  {axis}: groups from the DeviceMesh {a['groups_from_mesh']} {same} "
              f"Degrees.groups('{axis}') {a['groups_formula']}")
        print(f"      rank 0's all-reduce on mesh['{axis}'] reached ranks {a['all_reduce_ranks']}")
    print(f"  everything agrees: {r['all_equal']}")
