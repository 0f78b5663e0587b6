"""What `labkit.planner` prices a layout with: its memory per GPU and its step time, from the
layer-1 cost models (no formula of its own beyond adding their results up).

`Pricer` (built by `labkit.planner.plan` / `evaluate` for one model, batch and cluster):
`.memory(layout, m)` composes `labkit.memory.estimate_memory`'s per-stage figures, asked once
per shape (checked against estimate_memory on random layouts in tests/cost/test_planner.py);
`.time(layout, m)` adds up `labkit.flops`, `labkit.comm` and `labkit.pipeline` per part, with
the overlap assumptions it states.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import replace
import math

from labkit.comm import _TREE_OPS as TREE_OPS, collective_time, step_communication
from labkit.activations import resolve
from labkit.flops import flops_per_step
from labkit.kernels import (FRAMEWORKS, LOSS_PEAK_BYTES, head_seconds, layer_seconds,
                            optimizer_seconds)
from labkit.memory import activation_value_bytes, estimate_memory, state_bytes
from labkit.pipeline import activation_in_flight, bubble_formula
from labkit.placement import stage_layers, stage_params
from labkit.precision import gradient_bytes

# sharding -> (ZeRO stage for estimate_memory, strategy for step_communication)
SHARDING = {"ddp": (0, "ddp"), "zero1": (1, "zero1"), "zero2": (2, "zero2"), "fsdp": (3, "fsdp")}
AXES = ("tp", "cp", "dp", "pp")          # rank order, innermost first (Megatron-LM's tp-cp-dp-pp)
# the parts of a step's time (`Pricer.time`), in the order tables print them
PARTS = ("compute", "host", "tp", "cp", "ep", "pp", "dp", "optimizer", "bubble")


class Pricer:
    """Prices layouts of one model, batch and cluster; caches what layouts share."""

    def __init__(self, spec, gpus, global_batch, seq_len, *, gpu, dtype, mfu, intra, inter,
                 gpus_per_node, precision, optimizer, grad_accum, schedule, implementation,
                 attention, framework="megatron"):
        self.spec, self.gpus, self.B, self.s = spec, gpus, global_batch, seq_len
        self.gpu, self.mfu, self.intra, self.inter = gpu, mfu, intra, inter
        self.gpn, self.schedule = gpus_per_node, schedule
        self.peak, self.dtype, self.framework = gpu.flops(dtype), dtype, framework
        self.mem_kw = dict(seq_len=seq_len, precision=precision, optimizer=optimizer,
                           grad_accum=grad_accum, implementation=implementation,
                           attention=attention)
        self.state_bytes = state_bytes(precision, optimizer, grad_accum)
        # the attention kernel the time prices: materialised scores, or FlashAttention's
        self.attention = ("eager" if resolve(implementation, attention, None, spec)[1] == "eager"
                          else "flash")
        w = self.state_bytes[0]
        self.bytes = dict(param_bytes=w, grad_bytes=gradient_bytes(w, grad_accum)[0],
                          activation_bytes=activation_value_bytes(precision))
        self._cache: dict = {}

    def _memo(self, key, make):
        if key not in self._cache:
            self._cache[key] = make()
        return self._cache[key]

    # ---- memory ------------------------------------------------------------------------------
    def _per_stage(self, **kw) -> list[float]:
        return estimate_memory(self.spec, schedule="gpipe", **self.mem_kw, **kw).per_stage

    def activations(self, tp, pp, cp, sp, recompute, uneven=False) -> list[float]:
        """Bytes per stage of one micro-batch of one sequence (b = 1): one estimate (m = 1)
        less the model states of the same tp and pp without sharding."""
        def make():
            one = self._per_stage(microbatches=1, tp=tp, pp=pp, cp=cp, sequence_parallel=sp,
                                  recompute=recompute, uneven=uneven)
            return [t - st for t, st in zip(one, self.states(tp, pp, "ddp", 1, uneven))]
        return self._memo(("act", tp, pp, cp, sp, recompute, uneven), make)

    def states(self, tp, pp, sharding, group, uneven=False, ep=1) -> list[float]:
        """Model-state bytes per stage (plus FSDP's gathered unit) of one GPU: GPipe estimates
        at m = 1 and m = 2 differ by one micro-batch's activations; the rest is the states."""
        def make():
            zero = SHARDING[sharding][0]
            kw = dict(tp=tp, pp=pp, cp=1, recompute="full", sequence_parallel=False,
                      zero_stage=zero, dp=group,
                      largest_layer=self.unit_params(tp) if zero == 3 else None, uneven=uneven,
                      ep=ep)
            one, two = (self._per_stage(microbatches=k, **kw) for k in (1, 2))
            return [2 * a - b for a, b in zip(one, two)]
        return self._memo(("states", tp, pp, sharding, group, uneven, ep), make)

    def unit_params(self, tp) -> float:
        """Parameters of the unit FSDP gathers at once on one TP rank: one transformer layer."""
        parts = self.spec.layer_parts()
        return (parts["attention_sharded"] + parts["mlp_sharded"]) / tp + parts["replicated"]

    def memory(self, lay, m, transient=True) -> float:
        """Bytes per GPU on the worst stage for layout `lay` with m micro-batches.

        `labkit.memory.estimate_memory`'s worst stage. A plan prices tens of thousands of
        layouts, and estimate_memory takes a fraction of a millisecond, so the pricer asks it
        once per shape and composes: every activation term is linear in the micro-batch size b
        (s b h, a s^2 b, the logits' b s V), and the model states do not depend on b, the
        recompute mode or sequence parallelism. So for stage i

            total_i = states_i(sharding, group) + b x act_i(sp, recompute) x in_flight_i(pp, m, v)

        with states_i and act_i read from estimate_memory's `per_stage` (GPipe, m = 1 and
        m = 2: the difference is one micro-batch's activations, as
        `labkit.pipeline.activation_memory` does) and in_flight_i from
        `labkit.pipeline.activation_in_flight` (1F1B, GPipe or interleaved).
        tests/cost/test_planner.py checks the composition against estimate_memory on random
        layouts."""
        states = self.states(lay.tp, lay.pp, lay.sharding, lay.dp * lay.cp, lay.uneven, lay.ep)
        act = self.activations(lay.tp, lay.pp, lay.cp, lay.sequence_parallel, lay.recompute,
                               lay.uneven)
        held = self._memo(("held", self.schedule_of(lay), lay.pp, m, lay.chunks),
                          lambda: activation_in_flight(self.schedule_of(lay), lay.pp, m,
                                                       lay.chunks, divisible=False))
        gathered = [0.0] * lay.pp
        if lay.sharding == "fsdp" and not lay.reshard_after_forward and transient:
            # every unit stays gathered from its forward to its backward
            group = lay.dp * lay.cp
            gathered = [self.bytes["param_bytes"] * n * (1 - 1 / group)
                        for n in self.stage_params(lay.tp, lay.pp, lay.uneven, lay.ep)]
        # the loss's transient peak on the last stage (`labkit.kernels.LOSS_PEAK_BYTES`), and
        # FSDP's gathered units without resharding: not what estimate_memory counts
        gathered[-1] += transient * (lay.micro_batch * self.s / lay.cp * self.spec.vocab_size / lay.tp
                         * LOSS_PEAK_BYTES[FRAMEWORKS[self.framework].kernels])
        return max(st + g + lay.micro_batch * a * k
                   for st, g, a, k in zip(states, gathered, act, held))

    def schedule_of(self, lay) -> str:
        return "interleaved-1f1b" if lay.chunks > 1 else self.schedule

    # ---- time --------------------------------------------------------------------------------
    def link(self, lay, axis):
        """The link an axis's groups use: intra-node while its ranks lie in one node."""
        return self.links(lay)[axis]

    def links(self, lay) -> dict:
        """Every axis's link (`link`), for this layout's degrees."""
        key = ("links", lay.tp, lay.cp, lay.dp, lay.pp, lay.ep)
        if key not in self._cache:
            out, span = {}, 1
            for a in AXES:
                span *= getattr(lay, a)
                out[a] = self.intra if span <= self.gpn else self.inter
            # expert groups: ep consecutive ranks of the tp x cp x dp ones (expert TP = 1)
            out["ep"] = self.intra if self.gpn % lay.ep == 0 else self.inter
            self._cache[key] = out
        return self._cache[key]

    @staticmethod
    def _seconds(comm, link) -> float:
        """`comm`'s collectives back to back on `link`, each the faster of ring and tree where
        NCCL has both (`labkit.comm.collective_time`); identical ones priced once."""
        counts = Counter()
        for c in comm.collectives:
            counts[c.op, c.nbytes, c.group] += c.count
        return sum(k * min(collective_time(op, size, group, link.bandwidth, link.latency, alg)
                           for alg in (("ring", "tree") if op in TREE_OPS else ("ring",)))
                   for (op, size, group), k in counts.items())

    def _axis(self, strategy, lay, link, **kw) -> float:
        key = (strategy, lay.tp, lay.pp, lay.cp, lay.micro_batch, lay.sequence_parallel,
               lay.recompute, link.name, tuple(sorted(kw.items())))

        def make():
            comm = step_communication(strategy, self.spec, tp=lay.tp, pp=lay.pp, cp=lay.cp,
                                      batch_size=lay.micro_batch, seq_len=self.s,
                                      sequence_parallel=lay.sequence_parallel,
                                      recompute=lay.recompute, **self.bytes, **kw)
            return self._seconds(comm, link)
        return self._memo(key, make)

    def flops(self, recompute, hardware=True) -> float:
        return self._memo(("flops", recompute, hardware), lambda: flops_per_step(
            self.spec, self.B, self.s, recompute=recompute, hardware=hardware))

    def kernels(self, lay) -> tuple:
        """(one layer, the head): `labkit.kernels` seconds for one micro-batch on one GPU."""
        key = ("kernels", lay.tp, lay.cp, lay.sequence_parallel, lay.recompute, lay.micro_batch,
               lay.ep)

        def make():
            tokens = lay.micro_batch * self.s / lay.cp
            kw = dict(framework=self.framework, efficiency=self.mfu, dtype=self.dtype)
            return (layer_seconds(self.spec, self.gpu, tokens=tokens, seq_len=self.s, tp=lay.tp,
                                  cp=lay.cp, sequence_parallel=lay.sequence_parallel,
                                  recompute=lay.recompute, attention=self.attention,
                                  ep=lay.ep, **kw),
                    head_seconds(self.spec, self.gpu, tokens=tokens, tp=lay.tp, **kw))
        return self._memo(key, make)

    def time(self, lay, m) -> dict:
        """Seconds per step, by part (`PARTS`): compute, host, tp, cp, pp, dp, optimizer, bubble.

        One micro-batch on the slowest pipeline stage (layers split as evenly as possible, the
        last stage holding the fewest plus the output layer and the loss; `lay.uneven`: the
        first and last one layer fewer, `labkit.placement.stage_layers`):
        - compute: its kernels (`labkit.kernels.layer_seconds` / `head_seconds`: matmuls on a
          roofline with a measured ceiling, `mfu` if given, FlashAttention, elementwise work at
          HBM bandwidth; recompute's extra forward included).
        - tp: TP's collectives (`labkit.comm.step_communication`, the faster of ring and tree
          where NCCL has both), on the critical path. cp: the K/V ring passes, hidden behind
          the attention of the blocks already received: exposed = max(0, passes - attention x
          (cp - 1) / cp).
        - ep (a mixture of experts): the dispatch and combine all-to-alls
          (`labkit.comm.step_communication("ep")`) on the critical path, none hidden (DualPipe
          style overlap is not priced).
        - host: the framework's launch time per layer (`labkit.kernels.FRAMEWORKS`), plus its
          wait per layer and TP rank where a pipeline hop crosses nodes (`pp_tp_wait`); a
          micro-batch takes max(device, host): the part of the host time not covered (all of
          it where the framework's launches block: device + host).
        Times m micro-batches. Then
        - pp: the point-to-point sends of every micro-batch (on the critical path);
        - bubble: `labkit.pipeline.bubble_formula` (relative to the ideal) x m x one
          micro-batch's time;
        - dp (exposed): the data-parallel collectives less what hides them: the last
          micro-batch's backward for ddp and ZeRO-1 (one reduction per step), every backward
          for ZeRO-2, all the compute for FSDP (gathers prefetched; reshard_after_forward=False
          drops the backward gathers);
        - optimizer: a fused AdamW step over the parameters this GPU updates
          (`labkit.kernels.optimizer_seconds`).
        Groups inside one node use `intra_link`, else `inter_link`; ranks are numbered TP
        innermost, then CP, DP, PP (Megatron-LM's order)."""
        spec = self.spec
        layer, head = self.kernels(lay)
        L, pp = spec.num_layers, lay.pp
        full, others, last = self._memo(("layers", pp, lay.uneven), lambda: (
            lambda n: (max(n), max(n[:-1] or [0]), n[-1]))(stage_layers(L, pp, lay.uneven)))
        stage = max(others * layer.device, last * layer.device + head.device)
        tp = self._axis("tp", lay, self.link(lay, "tp"))
        cp = max(0.0, self._axis("cp", lay, self.link(lay, "cp"))
                 - full * layer.attention * (lay.cp - 1) / lay.cp)
        ep = (self._axis("ep", lay, self.link(lay, "ep"), ep=lay.ep)
              if self.spec.is_moe and lay.ep > 1 else 0.0)
        device = stage + tp + cp + ep
        fw = FRAMEWORKS[self.framework]
        # a framework's own cost where a pipeline hop crosses nodes with TP inside a stage
        # (`labkit.kernels.Framework.pp_tp_wait`): per layer, micro-batch and TP rank
        crossing = lay.pp > 1 and lay.tp > 1 and self.link(lay, "pp") is self.inter
        wait = fw.pp_tp_wait * lay.tp * full if crossing else 0.0
        host = full * layer.host + wait
        host = host if fw.blocking else max(0.0, host - device)
        out = {"compute": m * stage, "host": m * host, "tp": m * tp, "cp": m * cp,
               "ep": m * ep}
        out["pp"] = m * self._axis("pp", lay, self.link(lay, "pp"), chunks=lay.chunks)
        strategy = SHARDING[lay.sharding][1]
        dp_link = self.link(lay, "dp")
        reshard = lay.reshard_after_forward
        # FSDP without resharding keeps the weights gathered for the whole step: one gather
        # and one reduce-scatter per step (torchtitan's pipeline schedules with FSDP: no
        # reshard after backward and gradient sync on the last micro-batch only, as Llama 3)
        per_step = 1 if strategy == "fsdp" and not reshard else m
        key = ("dp", strategy, reshard, lay.tp, lay.pp, lay.dp * lay.cp, per_step)
        comm = self._memo(key, lambda: step_communication(
                              strategy, spec, dp=lay.dp * lay.cp, tp=lay.tp, pp=lay.pp,
                              microbatches=per_step, param_bytes=self.bytes["param_bytes"],
                              grad_bytes=self.bytes["grad_bytes"],
                              **({} if strategy != "fsdp" else
                                 {"reshard_after_forward": reshard})))
        backward = 2 / 3 * out["compute"]
        waited = ((lay.sharding == "fsdp" and not fw.fsdp_prefetch)
                  or (lay.sharding in ("zero1", "zero2") and not fw.overlap_param_gather))
        if waited:
            # FSDP without prefetch: each gather starts when its layer needs it and the layer
            # waits. ZeRO-1/2 without overlap: the updated weights are gathered after the
            # optimizer step, with nothing left to run. The reduce-scatters still run behind
            # the backward.
            gathers = self._memo(key + ("gathers", dp_link.name), lambda: self._seconds(
                replace(comm, collectives=[c for c in comm.collectives
                                           if c.op == "all_gather"]), dp_link))
            rest = self._memo(key + (dp_link.name,), lambda: self._seconds(comm, dp_link))
            window = backward if lay.sharding in ("fsdp", "zero2") else backward / m
            out["dp"] = gathers + max(0.0, rest - gathers - window)
        else:
            dp = self._memo(key + (dp_link.name,), lambda: self._seconds(comm, dp_link))
            window = {"ddp": backward / m, "zero1": backward / m, "zero2": backward,
                      "fsdp": out["compute"]}[lay.sharding]
            out["dp"] = max(0.0, dp - window)
        held = max(self.stage_params(lay.tp, lay.pp, lay.uneven, lay.ep))
        out["optimizer"] = optimizer_seconds(
            held / (1 if lay.sharding == "ddp" else lay.dp * lay.cp), self.gpu)
        relative = (bubble_formula(self.schedule_of(lay), lay.pp, m, lay.chunks,
                                   divisible=False)[1]
                    if lay.pp > 1 else 0.0)
        out["bubble"] = relative * (out["compute"] + out["host"] + out["tp"] + out["cp"]
                                    + out["ep"])
        return out

    def stage_params(self, tp, pp, uneven=False, ep=1) -> list[float]:
        return self._memo(("params", tp, pp, uneven, ep),
                          lambda: stage_params(self.spec, tp, pp, uneven, ep=ep))
