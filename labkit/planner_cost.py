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
import math

from labkit.comm import _TREE_OPS as TREE_OPS, collective_time, step_communication
from labkit.flops import attention_flops_per_token, flops_per_step
from labkit.memory import activation_value_bytes, estimate_memory, state_bytes
from labkit.pipeline import activation_in_flight, bubble_formula
from labkit.precision import gradient_bytes

# sharding -> (ZeRO stage for estimate_memory, strategy for step_communication)
SHARDING = {"ddp": (0, "ddp"), "zero1": (1, "zero1"), "zero2": (2, "zero2"), "fsdp": (3, "fsdp")}
AXES = ("tp", "cp", "dp", "pp")          # rank order, innermost first (Megatron-LM's tp-cp-dp-pp)


class Pricer:
    """Prices layouts of one model, batch and cluster; caches what layouts share."""

    def __init__(self, spec, gpus, global_batch, seq_len, *, gpu, dtype, mfu, intra, inter,
                 gpus_per_node, precision, optimizer, grad_accum, schedule, implementation,
                 attention):
        self.spec, self.gpus, self.B, self.s = spec, gpus, global_batch, seq_len
        self.gpu, self.mfu, self.intra, self.inter = gpu, mfu, intra, inter
        self.gpn, self.schedule = gpus_per_node, schedule
        self.peak = gpu.flops(dtype)
        self.mem_kw = dict(seq_len=seq_len, precision=precision, optimizer=optimizer,
                           grad_accum=grad_accum, implementation=implementation,
                           attention=attention)
        self.state_bytes = state_bytes(precision, optimizer, grad_accum)
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

    def activations(self, tp, pp, cp, sp, recompute) -> list[float]:
        """Bytes per stage of one micro-batch of one sequence (b = 1): one estimate (m = 1)
        less the model states of the same tp and pp without sharding."""
        def make():
            one = self._per_stage(microbatches=1, tp=tp, pp=pp, cp=cp, sequence_parallel=sp,
                                  recompute=recompute)
            return [t - st for t, st in zip(one, self.states(tp, pp, "ddp", 1))]
        return self._memo(("act", tp, pp, cp, sp, recompute), make)

    def states(self, tp, pp, sharding, group) -> list[float]:
        """Model-state bytes per stage (plus FSDP's gathered unit) of one GPU: GPipe estimates
        at m = 1 and m = 2 differ by one micro-batch's activations; the rest is the states."""
        def make():
            zero = SHARDING[sharding][0]
            kw = dict(tp=tp, pp=pp, cp=1, recompute="full", sequence_parallel=False,
                      zero_stage=zero, dp=group,
                      largest_layer=self.unit_params(tp) if zero == 3 else None)
            one, two = (self._per_stage(microbatches=k, **kw) for k in (1, 2))
            return [2 * a - b for a, b in zip(one, two)]
        return self._memo(("states", tp, pp, sharding, group), make)

    def unit_params(self, tp) -> float:
        """Parameters of the unit FSDP gathers at once on one TP rank: one transformer layer."""
        parts = self.spec.layer_parts()
        return (parts["attention_sharded"] + parts["mlp_sharded"]) / tp + parts["replicated"]

    def memory(self, lay, m) -> float:
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
        states = self.states(lay.tp, lay.pp, lay.sharding, lay.dp * lay.cp)
        act = self.activations(lay.tp, lay.pp, lay.cp, lay.sequence_parallel, lay.recompute)
        held = self._memo(("held", self.schedule_of(lay), lay.pp, m, lay.chunks),
                          lambda: activation_in_flight(self.schedule_of(lay), lay.pp, m,
                                                       lay.chunks))
        return max(st + lay.micro_batch * a * k for st, a, k in zip(states, act, held))

    def schedule_of(self, lay) -> str:
        return "interleaved-1f1b" if lay.chunks > 1 else self.schedule

    # ---- time --------------------------------------------------------------------------------
    def link(self, lay, axis):
        """The link an axis's groups use: intra-node while its ranks lie in one node."""
        span = 1
        for a in AXES[:AXES.index(axis) + 1]:
            span *= getattr(lay, a)
        return self.intra if span <= self.gpn else self.inter

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

    def time(self, lay, m) -> dict:
        """Seconds per step, by part: compute, tp, cp, pp, dp (exposed), bubble.

        - compute: the step's FLOPs with recompute's extra forward (`labkit.flops.flops_per_step`,
          hardware=True) over gpus x dense peak x `mfu` (the share of peak the matmuls reach),
          times pp ceil(L/pp) / L (the slowest stage sets the pace when the layers do not split
          evenly).
        - communication per axis (`labkit.comm.step_communication`, priced at one micro-batch
          and scaled by m where its counts are: TP, CP, PP, every count per micro-batch; the
          faster of ring and tree where NCCL has both), on the link its group uses: ranks are
          numbered TP innermost, then CP, DP, PP (Megatron-LM's order), and a group inside one
          node uses `intra_link`, else `inter_link` (bandwidth per GPU). Overlap assumption:
          TP's collectives and PP's sends sit on the critical path (all exposed); CP's K/V
          passes hide behind the attention FLOPs; the data-parallel reduction hides behind
          backward compute: the last micro-batch's for ddp and ZeRO-1 (one reduction per step),
          every micro-batch's for ZeRO-2, and FSDP's gathers behind all the compute (prefetch).
          Exposed = max(0, communication - what hides it).
        - bubble: `labkit.pipeline.bubble_formula` (relative to the ideal), times compute + TP
          + CP."""
        spec, n = self.spec, self.gpus
        rate = n * self.peak * self.mfu
        stage_layers = math.ceil(spec.num_layers / lay.pp)
        compute = self.flops(lay.recompute) / rate * lay.pp * stage_layers / spec.num_layers
        out = {"compute": compute}
        out["tp"] = m * self._axis("tp", lay, self.link(lay, "tp"))
        attention = 3 * attention_flops_per_token(spec, self.s) * self.B * self.s / rate
        out["cp"] = max(0.0, m * self._axis("cp", lay, self.link(lay, "cp")) - attention)
        out["pp"] = m * self._axis("pp", lay, self.link(lay, "pp"), chunks=lay.chunks)
        strategy = SHARDING[lay.sharding][1]
        dp_link = self.link(lay, "dp")
        dp = self._memo(("dp", strategy, lay.tp, lay.pp, lay.dp * lay.cp, m, dp_link.name),
                        lambda: self._seconds(step_communication(
                            strategy, spec, dp=lay.dp * lay.cp, tp=lay.tp, pp=lay.pp,
                            microbatches=m, param_bytes=self.bytes["param_bytes"],
                            grad_bytes=self.bytes["grad_bytes"]), dp_link))
        backward = 2 / 3 * compute
        window = {"ddp": backward / m, "zero1": backward / m, "zero2": backward,
                  "fsdp": compute}[lay.sharding]
        out["dp"] = max(0.0, dp - window)
        relative = (bubble_formula(self.schedule_of(lay), lay.pp, m, lay.chunks)[1]
                    if lay.pp > 1 else 0.0)
        out["bubble"] = relative * (compute + out["tp"] + out["cp"])
        return out
