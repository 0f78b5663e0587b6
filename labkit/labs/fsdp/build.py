"""What every part of the FSDP lab (labkit.labs.fsdp) shares: the model (transformers Llama or
GPT-2 from a config), the FSDP units' parameter groups, and how a rank's gathered (unsharded)
parameter bytes are read (labkit.fsdp.fsdp_memory predicts them: unsharded_held, _peak).

Gathered bytes (`gathered_bytes`): the distinct storages an FSDP2 unit allocates beyond its
shard: the unsharded parameters (`FSDPParam.all_gather_outputs` / `_unsharded_param`, in
param_dtype) and, with `reshard_after_forward=k`, the post-forward shard of 1/k of the unit
(`_sharded_post_forward_param_data`). A freed unit's storages are resized to 0 and count
nothing. `GatheredPeak` samples that sum after every operator the dispatcher runs inside its
`with` block, so its `peak` is exact at operator granularity.
"""
from __future__ import annotations

import torch
import torch.distributed as tdist
from torch import nn

from labkit.runtime import measure


def build(args, device):
    """(model returning its loss from `model(ids)`, ModelSpec): the --model preset at the flags'
    sizes, seeded, the same on every rank (Llama: labkit.labs.zero's; GPT-2: labkit.labs.ddp's,
    tied embedding and head, no dropout)."""
    from labkit.models import get_model

    if args.model == "gpt2":
        from labkit.labs.common.training import build_model
        spec = get_model("debug-gpt2").with_(
            num_layers=args.layers, hidden_size=args.hidden, num_heads=args.heads,
            num_kv_heads=args.heads, ffn_size=4 * args.hidden, vocab_size=args.vocab,
            max_seq_len=max(args.seq, 64))
        return build_model(args, device), spec
    from labkit.labs.common.zero_stages import build_model
    spec = get_model("debug-llama").with_(
        name="lab-llama", num_layers=args.layers, hidden_size=args.hidden,
        num_heads=args.heads, num_kv_heads=args.kv_heads, ffn_size=2 * args.hidden,
        vocab_size=args.vocab, max_seq_len=max(args.seq, 64))
    return build_model(args, device), spec


def param_groups(model: nn.Module) -> list:
    """The FSDPParamGroup of each unit of a model sharded with fully_shard (the root last)."""
    from labkit.parallel.fsdp import units

    groups = [u._get_fsdp_state()._fsdp_param_group for u in units(model)]
    return [g for g in groups if g is not None]


def gathered_bytes(params: list) -> int:
    """Bytes this rank holds beyond its shards: unsharded parameters and post-forward shards."""
    tensors = []
    for fp in params:
        tensors.extend(getattr(fp, "all_gather_outputs", None) or [])
        tensors.append(getattr(fp, "_unsharded_param", None))
        tensors.append(getattr(fp, "_sharded_post_forward_param_data", None))
    return measure.storage_bytes(tensors)


def op_mode(before=None, after=None):
    """A TorchDispatchMode calling before(func, args) and after() around every operator run
    inside it (DTensor operators are left to DTensor's dispatch first: the operators it runs
    on local tensors come back through the mode, collectives included)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class _Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if any(getattr(t, "__name__", "") == "DTensor" for t in types):
                return NotImplemented
            if before is not None:
                before(func, args)
            out = func(*args, **(kwargs or {}))
            if after is not None:
                after()
            return out

    return _Mode()


class GatheredPeak:
    """`with GatheredPeak(model) as g:` ... after any operator, the most bytes held at once:
    g.peak (unsharded parameters and post-forward shards, `gathered_bytes`); g.now(): those
    bytes at this moment. (labkit.fsdp.fsdp_memory's unsharded_peak / unsharded_held predict
    both: ratio 1.000.)"""

    def __init__(self, model: nn.Module):
        self.params = [fp for g in param_groups(model) for fp in g.fsdp_params]
        self.peak = 0

    def now(self) -> int:
        return gathered_bytes(self.params)

    def sample(self) -> None:
        self.peak = max(self.peak, self.now())

    def __enter__(self):
        self.peak = 0
        self.sample()
        self._mode = op_mode(after=self.sample)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        self._mode.__exit__(*exc)
        return False


def adamw(model, lr):
    return torch.optim.AdamW(model.parameters(), lr=lr)


def mean_over_ranks(rows: dict, ctx) -> dict:
    """{kind: [loss per step]} averaged over the ranks (each rank's loss is its shard's mean)."""
    table = torch.tensor([rows[k] for k in rows], dtype=torch.float64)
    if ctx.world_size > 1:
        tdist.all_reduce(table)
    return {k: (table[i] / ctx.world_size).tolist() for i, k in enumerate(rows)}



def wire_payload(comm) -> dict:
    """{op: (calls, payload bytes S)} from a labkit.comm.StepComm."""
    out: dict = {}
    for c in comm.collectives:
        calls, nbytes = out.get(c.op, (0, 0))
        out[c.op] = (calls + c.count, nbytes + c.count * c.nbytes)
    return out
