"""The degrees of a parallel job, the ranks each group holds, the named DeviceMesh, and the one
ordered composition TP -> activation checkpointing -> FSDP (torchtitan's order).

    deg = Degrees.for_world(8, tp=2, pp=2)          # dp = 8 / (2 x 2) = 2
    deg.check("llama2-7b", seq_len=4096, global_batch=64)   # ValueError naming what is wrong
    deg.groups("tp")        # [[0, 1], [2, 3], [4, 5], [6, 7]]: pure Python, no ranks needed
    mesh = deg.build_mesh("cpu")                    # inside ranks: init_device_mesh, named axes
    parallelize(model, mesh, activation_checkpoint=True)    # pp: split first, see parallelize

Ranks are numbered TP innermost, as Megatron-LM does (why: above `AXES`).
"""
from __future__ import annotations

from dataclasses import dataclass
import itertools
import math

from labkit import validate

# Rank order (outermost first): pp, dp, cp, tp. A rank's coordinates are read from its number as
# from a row-major array of shape (pp, dp, cp, tp): rank = ((p dp + d) cp + c) tp + t. TP is
# innermost, so a TP group is tp consecutive ranks: with tp dividing the GPUs per node, it stays
# inside one node (its per-layer collectives use NVLink); CP next (its K/V ring also wants the
# fast link), then DP, and PP outermost (one send per micro-batch and stage boundary: it
# tolerates the inter-node link best). Megatron-LM numbers its ranks the same way (tp-cp-dp-pp,
# innermost first), and so does labkit.planner when it picks each axis's link.
AXES = ("pp", "dp", "cp", "tp")          # outermost to innermost
# The expert layers' view of the same ranks (Megatron-LM's "tp-ep-dp-pp" expert order): in each
# pipeline stage its tp x cp x dp ranks are laid out again as edp x ep x etp, expert tensor
# parallelism innermost, then expert parallelism, then expert data parallelism (edp =
# tp cp dp / (ep etp)): rank = p (tp cp dp) + (d ep + e) etp + t.
EXPERT_AXES = ("pp", "edp", "ep", "etp")
TP_PLANS = ("llama", "llama-sp")
MP_KEYS = ("param_dtype", "reduce_dtype")


@dataclass(frozen=True)
class Degrees:
    """Validated parallel degrees; their product is the world size (`world`). ep and etp
    (expert and expert-tensor parallelism) fold into the same ranks (`EXPERT_AXES`): ep x etp
    must divide tp x cp x dp, the ranks of one pipeline stage."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int = 1

    def __post_init__(self):
        for axis in AXES + ("ep", "etp"):
            object.__setattr__(self, axis, validate.positive_int(axis, getattr(self, axis),
                                                                 validate.MAX_RANKS))
        stage = self.tp * self.cp * self.dp
        if stage % (self.ep * self.etp):
            ok = [d for d in validate.divisors(stage) if stage % (d * self.etp) == 0]
            raise ValueError(f"ep={self.ep} x etp={self.etp} does not divide the tp={self.tp} x "
                             f"cp={self.cp} x dp={self.dp} = {stage} ranks of a pipeline stage, "
                             f"which the expert layers reuse; allowed ep (etp={self.etp}): "
                             f"{', '.join(map(str, ok)) or 'none'}")

    @property
    def edp(self) -> int:
        """Expert data parallelism: how many copies of each expert (tp cp dp / (ep etp))."""
        return self.tp * self.cp * self.dp // (self.ep * self.etp)

    @property
    def expert_shape(self) -> tuple[int, int, int, int]:
        """The expert mesh's shape, in `EXPERT_AXES` order (pp, edp, ep, etp)."""
        return self.pp, self.edp, self.ep, self.etp

    @classmethod
    def for_world(cls, world: int, **given) -> "Degrees":
        """The degrees for `world` ranks: those given, and dp (when not given) the rest (ep and
        etp fold into the same ranks: they do not count in the product)."""
        world = validate.positive_int("world", world, validate.MAX_RANKS)
        for name in given:
            validate.choice("degree", name, AXES + ("ep", "etp"))
        others = math.prod(validate.positive_int(k, v, validate.MAX_RANKS)
                           for k, v in given.items() if k in AXES and k != "dp")
        if "dp" not in given:
            if world % others:
                named = " x ".join(f"{k}={v}" for k, v in given.items() if k in AXES)
                raise ValueError(f"{named} (product {others}) does not divide world={world}: dp "
                                 f"would not be whole; allowed products: "
                                 f"{', '.join(map(str, validate.divisors(world)))}")
            given = {**given, "dp": world // others}
        return cls(**given).check(world=world)

    @property
    def world(self) -> int:
        return self.pp * self.dp * self.cp * self.tp

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """The mesh shape, in `AXES` order (pp, dp, cp, tp)."""
        return tuple(getattr(self, a) for a in AXES)

    def __str__(self) -> str:
        experts = (f" (experts: ep{self.ep} x etp{self.etp} x edp{self.edp})"
                   if self.ep * self.etp > 1 else "")
        return " x ".join(f"{a}{getattr(self, a)}" for a in AXES) + f" = {self.world} ranks" \
            + experts

    def check(self, model=None, *, seq_len: int | None = None, global_batch: int | None = None,
              microbatch: int = 1, world: int | None = None, causal_balanced: bool = False,
              uneven_stages: bool = False) -> "Degrees":
        """Raise ValueError, naming the degree and the values allowed, unless every degree
        divides what it splits; return self.

        world: the product of the degrees must equal it. model (a preset name, ModelSpec or
        transformers config): tp divides num_heads, num_kv_heads and ffn_size (whole heads, an
        equal MLP slice per rank); pp divides num_layers (equal stages, as split_model cuts;
        uneven_stages=True only asks pp <= num_layers, as Llama 3 405B's 126 layers on 16).
        seq_len: cp divides it (2 cp with causal_balanced: each rank holds two chunks, one
        early and one late, so causal masking leaves every rank the same work).
        global_batch: dp x microbatch divides it (each replica gets whole micro-batches).
        """
        if world is not None:
            world = validate.positive_int("world", world, validate.MAX_RANKS)
            if self.world != world:
                raise ValueError(f"{self} but the world size is {world}: the product of the "
                                 f"degrees must equal it")
        validate.choice("causal_balanced", causal_balanced, (False, True))
        validate.choice("uneven_stages", uneven_stages, (False, True))
        if model is not None:
            from labkit.memory import tp_splits
            from labkit.models import get_model

            spec = get_model(model)
            for what, count in tp_splits(spec).items():
                validate.divides("tp", self.tp, what, count)
            if not uneven_stages:
                validate.divides("pp", self.pp, "num_layers", spec.num_layers)
            elif self.pp > spec.num_layers:
                raise ValueError(f"pp={self.pp} is more stages than num_layers="
                                 f"{spec.num_layers}; allowed: 1 to {spec.num_layers}")
        if seq_len is not None:
            s = validate.positive_int("seq_len", seq_len, validate.MAX_SEQ_LEN)
            chunks = 2 * self.cp if causal_balanced else self.cp
            if s % chunks:
                ok = [d for d in validate.divisors(s) if not causal_balanced or s % (2 * d) == 0]
                how = " (2 cp chunks: causal_balanced)" if causal_balanced else ""
                raise ValueError(f"cp={self.cp} does not split seq_len={s} into {chunks} equal "
                                 f"chunks{how}; allowed cp: {', '.join(map(str, ok))}")
        if global_batch is not None:
            b = validate.positive_int("global_batch", global_batch, validate.MAX_BATCH)
            mb = validate.positive_int("microbatch", microbatch, validate.MAX_BATCH)
            if b % (self.dp * mb):
                ok = validate.divisors(b // mb) if b % mb == 0 else []
                raise ValueError(f"dp={self.dp} x microbatch={mb} does not divide global_batch="
                                 f"{b}; allowed dp: {', '.join(map(str, ok)) or 'none'}")
        return self

    def coords(self, rank: int) -> dict[str, int]:
        """{axis: this rank's index along it}."""
        out, rest = {}, _rank(rank, self.world)
        for axis in reversed(AXES):
            rest, out[axis] = divmod(rest, getattr(self, axis))
        return {a: out[a] for a in AXES}

    def groups(self, *axes: str) -> list[list[int]]:
        """The ranks of every group along `axes` (one axis, or several flattened together, as
        FSDP over dp and cp): ranks that differ only in those coordinates, ascending; groups in
        order of the other coordinates. Pure Python: what build_mesh's groups must equal."""
        if not axes:
            raise ValueError(f"groups() needs at least one axis; allowed: {', '.join(AXES)}, "
                             "or the expert axes edp, ep, etp")
        expert = [a for a in axes if a in EXPERT_AXES[1:]]
        if expert and len(expert) != len(axes):
            raise ValueError(f"groups{axes}: expert axes (edp, ep, etp) and dense axes "
                             f"({', '.join(AXES)}) are two views of the same ranks; ask one view")
        for a in axes:
            validate.choice("axis", a, AXES + EXPERT_AXES[1:])
        names = EXPERT_AXES if expert else AXES
        shape = self.expert_shape if expert else self.shape
        fixed = [i for i, a in enumerate(names) if a not in axes]
        free = [i for i, a in enumerate(names) if a in axes]

        def rank_of(idx):
            r = 0
            for i, n in zip(idx, shape):
                r = r * n + i
            return r

        out = []
        for outer in itertools.product(*(range(shape[i]) for i in fixed)):
            group = []
            for inner in itertools.product(*(range(shape[i]) for i in free)):
                idx = [0] * len(names)
                for i, v in zip(fixed, outer):
                    idx[i] = v
                for i, v in zip(free, inner):
                    idx[i] = v
                group.append(rank_of(idx))
            out.append(sorted(group))
        return out

    def view(self, expert: bool = False) -> dict[str, list[list[int]]]:
        """{axis: groups} for every axis of the dense layers (`AXES`) or, expert=True, of the
        expert layers (`EXPERT_AXES`): two views of the same ranks, what
        labkit.plots.mesh.mesh_figure draws."""
        validate.choice("expert", expert, (False, True))
        return {a: self.groups(a) for a in (EXPERT_AXES if expert else AXES)}

    def nodes_spanned(self, axis: str, gpus_per_node: int) -> int:
        """The most nodes any one `axis` group touches (1: the axis stays inside a node)."""
        return max(len({node_of(r, gpus_per_node) for r in g}) for g in self.groups(axis))

    def build_mesh(self, device_type: str = "cpu"):
        """init_device_mesh over the 4 axes, named `AXES` (size-1 axes too, so mesh["tp"]
        always works); needs the process group and world size == self.world."""
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        from labkit.parallel import require_process_group

        require_process_group("Degrees.build_mesh")
        self.check(world=dist.get_world_size())
        validate.choice("device_type", device_type, ("cpu", "cuda"))
        return init_device_mesh(device_type, self.shape, mesh_dim_names=AXES)

    def build_expert_mesh(self, device_type: str = "cpu"):
        """The expert layers' DeviceMesh over the same ranks, axes `EXPERT_AXES` (pp, edp, ep,
        etp): its groups are `groups("ep")`, `groups("edp")`, `groups("etp")`."""
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        from labkit.parallel import require_process_group

        require_process_group("Degrees.build_expert_mesh")
        self.check(world=dist.get_world_size())
        validate.choice("device_type", device_type, ("cpu", "cuda"))
        return init_device_mesh(device_type, self.expert_shape, mesh_dim_names=EXPERT_AXES)


def node_of(rank: int, gpus_per_node: int) -> int:
    """The node holding global `rank` when each node runs `gpus_per_node` consecutive ranks."""
    gpn = validate.positive_int("gpus_per_node", gpus_per_node, validate.MAX_RANKS)
    return _rank(rank, validate.MAX_RANKS) // gpn


def _rank(rank, world: int) -> int:
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world:
        raise ValueError(f"rank={validate.describe(rank)} must be a whole number from 0 to "
                         f"{validate.show(world - 1)}")
    return rank


def llama_plan(sequence_parallel: bool = False) -> dict:
    """DTensor's parallelize_module plan for one transformers LlamaDecoderLayer: column-parallel
    q, k, v, gate, up; row-parallel o and down; the attention's and MLP's input made a
    replicated DTensor once (PrepareModuleInput: one backward all-reduce each, Megatron's
    count). sequence_parallel: the norms run on sequence shards (Shard(1)); the row-parallel
    outputs reduce-scatter and the inputs all-gather. Then pass position_ids to the model."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput,
                                                   RowwiseParallel, SequenceParallel)

    entry = Shard(1) if sequence_parallel else Replicate()
    plan = {f"self_attn.{n}": ColwiseParallel() for n in ("q_proj", "k_proj", "v_proj")}
    plan.update({f"mlp.{n}": ColwiseParallel() for n in ("gate_proj", "up_proj")})
    plan["self_attn.o_proj"] = RowwiseParallel(output_layouts=entry)
    plan["mlp.down_proj"] = RowwiseParallel(output_layouts=entry)
    plan["self_attn"] = PrepareModuleInput(input_kwarg_layouts={"hidden_states": entry},
                                           desired_input_kwarg_layouts={"hidden_states":
                                                                        Replicate()})
    plan["mlp"] = PrepareModuleInput(input_layouts=(entry,), desired_input_layouts=(Replicate(),))
    if sequence_parallel:
        plan["input_layernorm"] = SequenceParallel()
        plan["post_attention_layernorm"] = SequenceParallel()
    return plan


def vocab_modules(model) -> dict:
    """{"embed": name, "head": name, "norm": name} of the modules a vocab-parallel plan shards
    (an nn.Embedding named ...embed_tokens, an nn.Linear named ...lm_head) or keeps on sequence
    shards (the final norm, ...norm, with sequence parallelism), those this model or pipeline
    stage has. {} when the head's weight is the embedding's (tie_word_embeddings=True): one
    matrix cannot be both the embedding's row-wise and the head's column-wise shard, so a tied
    model keeps both whole."""
    from torch import nn

    found = {}
    for name, mod in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "embed_tokens" and isinstance(mod, nn.Embedding):
            found["embed"] = name
        elif leaf == "lm_head" and isinstance(mod, nn.Linear):
            found["head"] = name
        elif leaf == "norm" and "layers" not in name.split("."):
            found["norm"] = name
    if "embed" in found and "head" in found:
        if model.get_submodule(found["head"]).weight is model.get_submodule(found["embed"]).weight:
            return {}
    return found


def vocab_plan(model, sequence_parallel: bool = False) -> dict:
    """The parallelize_module plan for what is outside the decoder layers (torchtitan's, for a
    transformers Llama or a pipeline stage cut from one): the embedding vocab-parallel
    (RowwiseParallel: each rank holds vocab/tp rows, its lookups are summed: one forward
    all-reduce of b s h, or a reduce-scatter onto sequence shards with sequence parallelism), the
    head column-parallel over the vocabulary (ColwiseParallel: vocab/tp rows of the head; its
    replicated input's gradient is all-reduced in the backward, and its logits are all-gathered
    so the loss sees them whole; Megatron's parallel cross-entropy avoids that gather). With
    sequence parallelism the final norm runs on sequence shards and the head's input is
    all-gathered first (its gradient reduce-scattered)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   SequenceParallel)

    found = vocab_modules(model)
    entry = Shard(1) if sequence_parallel else Replicate()
    plan = {}
    if "embed" in found:
        plan[found["embed"]] = RowwiseParallel(input_layouts=Replicate(), output_layouts=entry)
    if "head" in found:
        plan[found["head"]] = ColwiseParallel(input_layouts=entry, output_layouts=Replicate())
        if sequence_parallel and "norm" in found:
            plan[found["norm"]] = SequenceParallel()
    return plan


def _axis(mesh, name: str):
    names = getattr(mesh, "mesh_dim_names", None)
    if not names:
        raise ValueError("mesh has no dimension names, so mesh['dp'] cannot be found: build it "
                         "with init_device_mesh(..., mesh_dim_names=(...)) or "
                         "Degrees.build_mesh()")
    return mesh[name] if name in names else None


def parallelize(model, mesh, *, tp_plan="llama", activation_checkpoint: bool = False,
                fsdp: bool = True, mp: dict | None = None, vocab_parallel: bool = True):
    """Compose the axes on `model` in place, in this order, and return it:
    1. TP on mesh["tp"] (when larger than 1): `tp_plan` ("llama", "llama-sp" = with sequence
       parallelism, or your own per-layer plan dict) on every decoder layer, and with
       vocab_parallel (default) the embedding and the head split over the vocabulary
       (`vocab_plan`, as labkit.memory.estimate_memory assumes; a tied model keeps them whole).
       TP first: FSDP then shards the DTensor shards (2D: each parameter is Shard on tp, then
       on dp).
    2. activation checkpointing of each decoder layer (recomputed in the backward);
    3. FSDP2 (labkit.parallel.fsdp.shard_model: per layer, then the root) over mesh["dp"],
       or over dp and cp flattened when cp > 1 (CP ranks hold the same weights and average
       their gradients as data-parallel ones do). mp: {"param_dtype": ..., "reduce_dtype": ...}.
    The pp axis is not touched: split the model first (labkit.parallel.pipe.split_model), keep
    this rank's stage (mesh["pp"].get_local_rank()) and `parallelize` that stage with the same
    mesh; its decoder layers are found the same way."""
    from labkit.parallel import fsdp as fsdp_mod

    validate.choice("activation_checkpoint", activation_checkpoint, (False, True))
    validate.choice("fsdp", fsdp, (False, True))
    validate.choice("vocab_parallel", vocab_parallel, (False, True))
    if not isinstance(tp_plan, dict):
        validate.choice("tp_plan", tp_plan, TP_PLANS + ("a dict of per-layer styles",))
    mp = {} if mp is None else mp
    if not isinstance(mp, dict) or set(mp) - set(MP_KEYS):
        raise ValueError(f"mp={validate.describe(mp)} must be a dict with keys among "
                         f"{', '.join(MP_KEYS)}")
    if mp and not fsdp:
        raise ValueError("mp= sets FSDP2's mixed precision: it needs fsdp=True")
    blocks = fsdp_mod.transformer_blocks(model)
    tp_mesh = _axis(mesh, "tp")
    if tp_mesh is not None and tp_mesh.size() > 1:
        from torch.distributed.tensor.parallel import parallelize_module

        plan = tp_plan if isinstance(tp_plan, dict) else llama_plan(tp_plan == "llama-sp")
        for block in blocks:
            parallelize_module(block, tp_mesh, plan)
        root = vocab_plan(model, tp_plan == "llama-sp") if vocab_parallel else {}
        if root:
            parallelize_module(model, tp_mesh, root)
    if fsdp:
        dp_mesh = _axis(mesh, "dp")
        cp_mesh = _axis(mesh, "cp")
        if dp_mesh is None:
            raise ValueError(f"fsdp=True shards over the 'dp' axis; the mesh's axes are "
                             f"{mesh.mesh_dim_names}")
        if cp_mesh is not None and cp_mesh.size() > 1:
            dp_mesh = mesh["dp", "cp"]._flatten("dp_cp")
        fsdp_mod.shard_model(model, mesh=dp_mesh, checkpoint_blocks=activation_checkpoint, **mp)
    elif activation_checkpoint:
        for block in blocks:
            fsdp_mod._replace(model, block, fsdp_mod.checkpoint_block(block))
    return model
