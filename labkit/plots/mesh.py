"""Pictures for module 08: a device mesh laid on nodes, and which ranks share each axis's groups.

    >>> from labkit.parallel.mesh import Degrees          # in the notebook (layer 4)
    >>> deg = Degrees(pp=2, dp=8, tp=8)                   # 16 nodes x 8 GPUs
    >>> fig = mesh_figure({a: deg.groups(a) for a in ("tp", "dp", "pp")}, gpus_per_node=8)

One panel per axis: every rank a cell, one row per node (gpus_per_node cells), coloured by the
group of that axis it belongs to (same colour: those ranks talk on that axis); each panel's
title says whether the axis's groups stay inside a node (NVLink) or cross nodes (network).
The groups come in as lists of ranks (labkit.parallel.mesh.Degrees.groups computes them; this
layer does not import it). No torch here (layer 2).
"""
from __future__ import annotations

from labkit import validate
from labkit.plots import new_figure

MAX_RANKS = 4096
PALETTE = ("#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860", "#da8bc3",
           "#8c8c8c", "#ccb974", "#64b5cd")


def check_groups(groups: dict) -> int:
    """The world size of `groups` ({axis: [[ranks], ...]}); ValueError unless every axis's
    groups cover ranks 0..world-1 exactly once and all axes have the same world."""
    if not isinstance(groups, dict) or not groups:
        raise ValueError(f"groups={validate.describe(groups)} must be a non-empty dict "
                         "{axis: [[ranks], ...]}, e.g. {a: Degrees.groups(a) for a in AXES}")
    world = None
    for axis, gs in groups.items():
        flat = [r for g in gs for r in g] if isinstance(gs, (list, tuple)) else None
        if not flat or sorted(flat) != list(range(len(flat))) or len(flat) > MAX_RANKS:
            raise ValueError(f"groups[{axis!r}] must cover ranks 0 to world - 1 once each "
                             f"(at most {MAX_RANKS}); got {validate.describe(gs)}")
        if world is not None and len(flat) != world:
            raise ValueError(f"groups[{axis!r}] covers {len(flat)} ranks but another axis "
                             f"{world}; allowed: every axis over the same ranks")
        world = len(flat)
    return world


def link_of(group_list, gpus_per_node: int) -> str:
    """"NVLink (inside a node)" when every group lies inside one node, else "network"."""
    inside = all(len({r // gpus_per_node for r in g}) == 1 for g in group_list)
    return "NVLink (inside a node)" if inside else "network (across nodes)"


def mesh_figure(groups: dict, gpus_per_node: int = 8, title: str | None = None):
    """One panel per axis of `groups` (axes of size 1 left out): ranks as a nodes x GPUs grid,
    coloured by their group on that axis, nodes outlined, rank numbers written when the mesh is
    small (<= 64 ranks)."""
    from matplotlib.patches import Rectangle

    world = check_groups(groups)
    gpn = validate.positive_int("gpus_per_node", gpus_per_node, MAX_RANKS)
    gpn = min(gpn, world)
    axes = [a for a, gs in groups.items() if len(gs[0]) > 1] or list(groups)[:1]
    nodes = -(-world // gpn)
    fig = new_figure(3.2 * len(axes) + 0.5, 1.0 + 0.35 * max(nodes, 2) + 0.25 * (nodes < 4))
    for k, axis in enumerate(axes):
        ax = fig.add_subplot(1, len(axes), k + 1)
        colour = {r: i for i, g in enumerate(groups[axis]) for r in g}
        for r in range(world):
            node, gpu = divmod(r, gpn)
            ax.add_patch(Rectangle((gpu, nodes - 1 - node), 1, 1, edgecolor="white",
                                   facecolor=PALETTE[colour[r] % len(PALETTE)]))
            if world <= 64:
                ax.text(gpu + 0.5, nodes - 0.5 - node, str(r), ha="center", va="center",
                        fontsize=7, color="white")
        for node in range(nodes):
            ax.add_patch(Rectangle((0, nodes - 1 - node), gpn, 1, fill=False,
                                   edgecolor="black", linewidth=1.2))
        ax.set_xlim(0, gpn)
        ax.set_ylim(0, nodes)
        ax.set_aspect("equal")
        ax.set_xticks([])
        ax.set_yticks([])
        ax.set_xlabel(f"GPU in node ({gpn} per node)", fontsize=7)
        if k == 0:
            # a short label where the grid is short: the long one ran into the title above
            ax.set_ylabel(f"node (0..{nodes - 1}, top down)" if nodes >= 4 else "node", fontsize=7)
        n = len(groups[axis])
        ax.set_title(f"{axis}: {n} groups of {len(groups[axis][0])}\n"
                     f"{link_of(groups[axis], gpn)}", fontsize=8)
    if title:
        fig.suptitle(title, fontsize=9)
    return fig
