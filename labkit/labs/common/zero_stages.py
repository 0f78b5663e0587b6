"""What the ZeRO lab (labkit.labs.zero) trains and how it reads what each rank holds and sends:
the implementations built around one model, the predictions they are compared with (padding
included), and what a ring and gloo should put on the wire.

    stage = build(kind, module, lr)     # kind in IMPLS + EXTRA: each implementation, AdamW
    predicted_memory(kind, num_params, world); padding(kind, sizes, world)
    predicted_comm(kind, num_params, world); wire_expected(by_kind, world)

What each implementation is (DeepSpeed's stages, torch's ZeroRedundancyOptimizer): `build`.
"""
from __future__ import annotations

import copy

import torch.distributed as tdist

from labkit.labs.common.training import CausalLM, global_batch

from dataclasses import dataclass

import torch

IMPLS = ("ddp", "zero1", "zero2", "zero3", "torch_zero")        # the default run
EXTRA = ("zero3_bf16",)                                          # on request (--impl)
STAGE = {"ddp": 0, "zero1": 1, "zero2": 2, "zero3": 3, "torch_zero": 1, "zero3_bf16": 3}
STRATEGY = {"ddp": "ddp", "zero1": "zero1", "zero2": "zero2", "zero3": "zero3",
            "torch_zero": "ddp", "zero3_bf16": "zero3"}
GATHER_BYTES = {"zero3_bf16": 2}       # bytes of a gathered weight element (else fp32's 4)
TERMS = ("params", "grads", "optimizer_states")


@dataclass
class Stage:
    """One implementation: `model(ids)` returns the loss; after `loss.backward()`, `sync()` (None:
    synchronised inside backward), `opt.step()`, `opt.zero_grad()`."""

    kind: str
    model: object
    opt: object
    sync: object = None

    def full_parameters(self) -> dict:
        """{name: full tensor} of the wrapped model (collective for ZeRO-3: call on every rank)."""
        if STAGE[self.kind] == 3:
            return self.model.gather_full_params()
        module = getattr(self.model, "module", self.model)
        return {n: p.detach() for n, p in module.named_parameters()}


def build(kind: str, module, lr: float) -> Stage:
    """Wrap `module` (already on its device, the same on every rank) as implementation `kind`.

    Implementations (IMPLS, and EXTRA on request), each on its own copy of the same model, AdamW:
    - "ddp": torch's DistributedDataParallel (the baseline: every rank holds everything);
    - "zero1": labkit.parallel.zero.ShardedOptimizer(reduce_gradients=True), no DDP: each rank
      keeps its full gradients; step() reduce-scatters them, updates this rank's shard of the
      flat parameters and all-gathers the shards (DeepSpeed's stage 1);
    - "zero2": labkit.parallel.zero.ShardedGradientOptimizer: the gradients are reduce-scattered
      as soon as backward has produced them, each rank keeping only its shard's, then ZeRO-1's
      step;
    - "zero3": labkit.parallel.zero.FullyShardedModel sharding every module that holds
      parameters (Linear, Embedding and the RMSNorms too, so that no parameter stays replicated
      and estimate_memory's 4P/N weights are exact);
    - "torch_zero": torch's DDP + torch.distributed.optim.ZeroRedundancyOptimizer (ZeRO-1 as
      torch ships it: the all-reduce, then a broadcast of each parameter from the rank that
      updated it);
    - "zero3_bf16" (only when asked for): "zero3" with compute_dtype=torch.bfloat16: the weights
      are gathered and used in bf16 (half the all-gather bytes), while the shards, their fp32
      gradients (reduce-scattered in fp32) and AdamW stay fp32: the same memory as "zero3"."""
    from torch import nn

    from labkit.labs.common.training import torch_ddp

    adamw = torch.optim.AdamW
    if kind == "ddp":
        model = torch_ddp(module)
        return Stage(kind, model, adamw(model.parameters(), lr=lr))
    if kind == "torch_zero":
        from torch.distributed.optim import ZeroRedundancyOptimizer

        model = torch_ddp(module)
        return Stage(kind, model, ZeroRedundancyOptimizer(model.parameters(), adamw, lr=lr))
    from labkit.parallel import zero

    if kind in ("zero3", "zero3_bf16"):
        owners = tuple({type(m) for m in module.modules()
                        if any(p is not None for p in m._parameters.values())})
        dtype = torch.bfloat16 if kind == "zero3_bf16" else None
        model = zero.FullyShardedModel(module, compute_dtype=dtype,
                                       shard=(nn.Linear, nn.Embedding, *owners))
        return Stage(kind, model, adamw(model.parameters(), lr=lr),
                     model.finish_gradient_synchronization)
    if kind == "zero1":     # no DDP: step() reduce-scatters each rank's own gradients
        return Stage(kind, module, zero.ShardedOptimizer(module.parameters(), adamw, lr=lr,
                                                         reduce_gradients=True))
    if kind == "zero2":     # backward's last gradient launches the reduce-scatter
        return Stage(kind, module, zero.ShardedGradientOptimizer(module.parameters(), adamw,
                                                                 lr=lr))
    raise ValueError(f"kind={kind!r} is not an implementation; allowed: "
                     f"{', '.join(IMPLS + EXTRA)}")


# ---------------------------------------------------------------------------------------------
# predictions

def predicted_memory(kind: str, num_params: int, world: int) -> dict:
    """estimate_memory's model states per rank for this implementation's stage (fp32 AdamW: 4 B
    weights, 4 B gradients, 8 B moments per parameter)."""
    from labkit.memory import estimate_memory

    est = estimate_memory(num_params, precision="fp32", optimizer="adamw",
                          zero_stage=STAGE[kind], dp=world)
    return {t: getattr(est, t) for t in TERMS}


def padding(kind: str, sizes: list[int], world: int) -> tuple[dict, dict]:
    """(memory, payload) bytes that padding adds to the predictions, by term and by collective:
    shards must be equal, so labkit.parallel.zero pads. ZeRO-1/2 pad the one flat buffer of all
    P parameters to P_pad = padded_size(P, N): the replicated weights grow by P_pad - P
    elements, each shard (moments; ZeRO-2's gradients) by (P_pad - P) / N, and the
    reduce-scatter and all-gather carry P_pad. ZeRO-3 pads each sharded tensor of n elements to
    padded_size(n, N): each rank holds sum(padded) / N of every state, and its collectives carry
    the padded tensors. DDP and torch's ZeroRedundancyOptimizer (whole tensors) pad nothing.
    fp32: 4 B a weight or gradient element, 8 B of AdamW moments."""
    from labkit.parallel.zero import padded_size

    none = {t: 0 for t in TERMS}
    if kind in ("zero1", "zero2"):
        extra = padded_size(sum(sizes), world) - sum(sizes)
        grads = 4 * extra / world if kind == "zero2" else 0
        return ({"params": 4 * extra, "grads": grads, "optimizer_states": 8 * extra / world},
                {"reduce_scatter": 4 * extra, "all_gather": 4 * extra})
    if STAGE[kind] == 3:
        extra = sum(padded_size(n, world) - n for n in sizes)
        return ({"params": 4 * extra / world, "grads": 4 * extra / world,
                 "optimizer_states": 8 * extra / world},
                {"all_gather": 2 * GATHER_BYTES.get(kind, 4) * extra,
                 "reduce_scatter": 4 * extra})
    return none, {}


def predicted_comm(kind: str, num_params: int, world: int) -> tuple[dict, float]:
    """({op: payload bytes}, bytes a ring sends per rank) from labkit.comm.step_communication
    (fp32 gradients; weights gathered in fp32, or bf16 for zero3_bf16). torch_zero: DDP's
    all-reduce plus one broadcast of every parameter from its owner (the weights once)."""
    from labkit.comm import step_communication

    comm = step_communication(STRATEGY[kind], num_params=num_params, dp=world,
                              param_bytes=GATHER_BYTES.get(kind, 4), grad_bytes=4)
    payload = {op: nbytes for op, (_, nbytes) in comm.payload.items()}
    sent = comm.total_bytes
    if kind == "torch_zero":
        payload["broadcast"] = 4 * num_params
        sent += 4 * num_params * (world - 1) / world     # a chain's S (N-1), averaged
    return payload, sent


def wire_expected(by_kind: dict, world: int) -> dict:
    """What the collectives issued should send per rank: a ring's bytes (labkit.comm) and what
    gloo sends, whose reduce_scatter runs as an all_reduce (module 02: 2(N-1)/N of the buffer,
    twice a ring reduce-scatter's (N-1)/N). A broadcast sends S to each of the N - 1 others
    (a chain or gloo's tree alike): S (N-1)/N per rank on average over the ranks, which is how
    the lab compares it (totals over the ranks)."""
    from labkit.comm import bytes_sent_per_rank

    ring = gloo = 0.0
    for op, (_, nbytes) in by_kind.items():
        if op == "broadcast":
            sent = nbytes * (world - 1) / world
        elif op in ("all_reduce", "all_gather", "reduce_scatter"):
            sent = bytes_sent_per_rank(op, nbytes, world)
        else:
            continue            # nothing else is issued in a counted step
        ring += sent
        gloo += bytes_sent_per_rank("all_reduce", nbytes, world) if op == "reduce_scatter" else sent
    return {"ring": ring, "gloo": gloo}


def build_model(args, device) -> CausalLM:
    """The same Llama on every rank (seeded): debug-llama at the flags' sizes (ffn 2h)."""
    from labkit.labs.common.models import build_model as build_lm
    from labkit.models import get_model

    spec = get_model("debug-llama").with_(
        name="lab-llama", num_layers=args.layers, hidden_size=args.hidden, num_heads=args.heads,
        num_kv_heads=args.kv_heads, ffn_size=2 * args.hidden, vocab_size=args.vocab,
        max_seq_len=max(args.seq, 64))
    torch.manual_seed(args.seed)
    model = CausalLM(build_lm(spec, None, torch.float32, "sdpa"))
    assert sum(p.numel() for p in model.parameters()) == spec.num_params()
    return model.to(device).train()



def gathered(value, ctx) -> list:
    """Every rank's `value` (a small picklable object), in rank order."""
    if ctx.world_size == 1:
        return [value]
    out = [None] * ctx.world_size
    tdist.all_gather_object(out, value)
    return out



def reference(base, args, world: int):
    """Rank 0 alone: the same model trained with AdamW on the whole batch (losses, model)."""
    model = copy.deepcopy(base)
    device = next(model.parameters()).device
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    losses = []
    for step in range(args.steps):
        loss = model(global_batch(args, world, step).to(device))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, model
