"""A planner for real clusters: every layout of a model on N GPUs (`Layout`), the infeasible ones
rejected with their reason (`plan`), the rest ranked by step time (`labkit.planner_cost`).

    >>> p = plan("llama3-70b", gpus=64, gpu="h100-sxm", global_batch=512, seq_len=8192)
    >>> p.best.layout, p.best.step_time, p.best.breakdown      # {"compute": s, "tp": s, ...}
    >>> print(p.table(top=5)); p.rejection_counts(); p.why()  # why nothing fits, when so
    >>> evaluate("llama3-405b", Layout(tp=8, pp=16, dp=128, sharding="fsdp", recompute="full"),
    ...          gpu="h100-sxm", global_batch=2048, seq_len=8192).fits   # True
    >>> # Llama 3's degrees; run without recompute, labkit prices them over 80 GB (its model)
    >>> print(decision("llama2-70b", 64, global_batch=512, seq_len=4096).text())  # what pays
    >>> print(p.compare("tp=8 pp=4 dp=2 fsdp").text())   # why a layout ranks there, by part
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, replace
import itertools
import math

from labkit import validate
from labkit.hardware import GB, get_gpu, get_link
from labkit.memory import RECOMPUTE, tp_splits
from labkit.models import get_model
from labkit.kernels import FRAMEWORKS, matmul_efficiency
from labkit.planner_cost import PARTS, SHARDING, Pricer
from labkit.tp import COMPUTE_DTYPE

SCHEDULES = ("1f1b", "gpipe")
# default links by GPU: its NVLink generation inside a node, one NIC port per GPU across nodes
INTRA = {"a100-40gb": "nvlink3", "a100-80gb": "nvlink3", "h100-sxm": "nvlink4",
         "h200": "nvlink4", "b200": "nvlink5", "h100-pcie": "pcie5"}
INTER = {"a100-40gb": "ib-hdr", "a100-80gb": "ib-hdr"}
DEFAULT_TOKENS = 2**22          # default global batch: about 4M tokens per step
# Headroom: what a plan may not fill. A process holds memory that is not tensors (the CUDA
# context, ~0.5 GB on an H100 with torch; NCCL's buffers and workspace, ~0.5-1 GB with a few
# communicators; cuBLAS workspaces), and the caching allocator cannot use every free byte of a
# fragmented heap (PyTorch CUDA semantics: memory management). A plan that needs more than
# usable = capacity x (1 - FRAGMENTATION) - RESERVED does not fit (module 01: a plan at 95 %
# of the card will not run), capacity being the bytes the device reports (`GPU.device_bytes`:
# 79.11 GiB on an H100 80GB, so 79.2 GB usable), not the label's 80e9.
RESERVED = 1.5 * GB
FRAGMENTATION = 0.05
# Context parallelism must pay for what it adds (another process group, ring attention's
# kernels and their numerics, load balancing across the causal mask): `plan` ranks a CP layout
# as if it took this share longer, so a layout without CP within 1 % is preferred.
CP_PREMIUM = 0.01
# What a framework offered when a published run was made: `plan(..., **ERAS[name])` searches
# only that. Megatron-LM 2021 (Narayanan et al.): full recompute, no sequence parallelism (2022),
# no CP, no sharded optimizer (ZeRO-1 came to Megatron-LM in 2022); metaseq 2021 (OPT): TP
# and FairScale's FSDP, no pipeline; Megatron-DeepSpeed 2022 (BLOOM, MT-NLG): ZeRO-1 as well,
# and DeepSpeed's pipeline engine, which does not interleave.
ERAS = {
    "megatron-2021": dict(recompute=("full",), sequence_parallel=(False,), sharding=("ddp",),
                          min_cp_tokens=validate.MAX_SEQ_LEN),
    "metaseq-2021": dict(recompute=("full",), sequence_parallel=(False,), sharding=("fsdp",),
                         min_cp_tokens=validate.MAX_SEQ_LEN, max_pp=1),
    "megatron-deepspeed-2022": dict(recompute=("full",), sequence_parallel=(False,),
                                    sharding=("ddp", "zero1"), min_cp_tokens=validate.MAX_SEQ_LEN,
                                    max_chunks=1),
}


def usable_memory(capacity: float, reserved=None, fragmentation=None) -> float:
    """Bytes of a `capacity`-byte GPU a plan may fill (defaults RESERVED, FRAGMENTATION)."""
    r = RESERVED if reserved is None else validate.non_negative("reserved", reserved, capacity)
    f = FRAGMENTATION if fragmentation is None else validate.non_negative(
        "fragmentation", fragmentation, 0.5)
    return capacity * (1 - f) - r


@dataclass(frozen=True)
class Layout:
    """Degrees tp x cp x dp x pp = the GPUs; the data-parallel sharding ("ddp" replicates the
    model states, "zero1" / "zero2" shard the optimizer states / also the gradients, "fsdp" is
    ZeRO-3 with one transformer layer per unit), over dp x cp ranks (the gradients are averaged
    over both, as Megatron-LM does); the micro-batch size b (m = global_batch / (dp b)
    micro-batches per step); recompute "none" / "selective" / "full"; sequence parallelism
    (tp > 1)."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1
    sharding: str = "ddp"
    micro_batch: int = 1
    recompute: str = "none"
    sequence_parallel: bool = False
    chunks: int = 1                 # model chunks per stage (interleaved 1F1B)
    reshard_after_forward: bool = True      # FSDP: False keeps each unit gathered until backward
    uneven: bool = False            # first / last stage: one layer fewer (embedding, output)
    ep: int = 1                     # expert parallelism (an MoE model): within tp x cp x dp

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.dp * self.cp

    def __str__(self) -> str:
        sp = "+sp" if self.sequence_parallel else ""
        v = f" v={self.chunks}" if self.chunks > 1 else ""
        keep = " no-reshard" if self.sharding == "fsdp" and not self.reshard_after_forward else ""
        v += " uneven" if self.uneven and self.pp > 1 else ""
        ep = f" ep={self.ep}" if self.ep > 1 else ""
        return (f"tp={self.tp}{sp} pp={self.pp}{v} dp={self.dp} cp={self.cp}{ep} {self.sharding}"
                f"{keep} b={self.micro_batch} recompute={self.recompute}")


@dataclass
class Estimate:
    """One layout priced: memory per GPU (worst stage), step time and its parts, throughput.

    Throughput: tokens/s = global_batch x seq_len / step; TFLOP/s per GPU of model FLOPs (MFU's)
    and of hardware FLOPs (with recompute, HFU's: what Megatron-LM's Table 1 reports). The parts
    of the step: `labkit.planner_cost.Pricer.time`."""

    layout: Layout
    microbatches: int
    memory: float                   # bytes per GPU
    capacity: float                 # the GPU's bytes
    breakdown: dict                 # seconds by part: PARTS
    usable: float                   # what a plan may fill: capacity less the headroom
    links: dict                     # axis -> link name
    tokens_per_step: int
    model_flops: float              # per step, all GPUs
    hardware_flops: float
    peak: float                     # dense FLOP/s of one GPU

    @property
    def fits(self) -> bool:
        """The memory fits in the usable part of the GPU (`usable_memory`)."""
        return self.memory <= self.usable

    @property
    def step_time(self) -> float:
        return sum(self.breakdown.values())

    @property
    def tokens_per_second(self) -> float:
        return self.tokens_per_step / self.step_time

    @property
    def model_tflops_per_gpu(self) -> float:
        return self.model_flops / self.step_time / self.layout.gpus / 1e12

    @property
    def hardware_tflops_per_gpu(self) -> float:
        return self.hardware_flops / self.step_time / self.layout.gpus / 1e12

    @property
    def mfu(self) -> float:
        return self.model_tflops_per_gpu * 1e12 / self.peak


@dataclass(frozen=True)
class Rejection:
    layout: Layout
    reason: str                     # "<kind>: <why>"

    @property
    def kind(self) -> str:
        return self.reason.split(":", 1)[0]

    def __iter__(self):             # candidate, reason = rejection
        return iter((self.layout, self.reason))


@dataclass
class Plan:
    ranked: list = field(default_factory=list)       # Estimates, fastest first
    rejected: list = field(default_factory=list)     # Rejections
    inputs: dict = field(default_factory=dict)
    pricing: tuple = field(default=(), repr=False)   # (spec, evaluate's keyword arguments)

    def compare(self, layout) -> "Comparison":
        """Why `layout` (a Layout or its text, e.g. "tp=8 pp=16 dp=128 fsdp recompute=full")
        ranks where it does against this plan's best: it priced as `evaluate` prices it (with
        this plan's inputs), its rank among the feasible layouts, and the step time part by
        part. A layout that cannot run at all is a ValueError with the reason."""
        if not self.pricing:
            raise ValueError("this Plan was not made by plan(): nothing to compare with")
        spec, kwargs = self.pricing
        lay = parse_layout(layout) if isinstance(layout, str) else layout
        est = evaluate(spec, lay, **kwargs)
        faster = sum(rank_key(e) < rank_key(est) for e in self.ranked)
        return Comparison(est, self.best, faster + 1 if est.fits else None, len(self.ranked))

    @property
    def best(self) -> Estimate | None:
        return self.ranked[0] if self.ranked else None

    def rejection_counts(self) -> Counter:
        return Counter(r.kind for r in self.rejected)

    def leanest(self, k: int = 1) -> list:
        """The k layouts rejected for memory that need the least of it, leanest first."""
        over = [r for r in self.rejected if r.kind == "memory"]
        return sorted(over, key=lambda r: _gb(r.reason))[:k]

    def why(self) -> str:
        """One paragraph: the best layout, or why nothing fits."""
        i = self.inputs
        if self.best is not None:
            b = self.best
            return (f"best of {len(self.ranked):,} feasible layouts ({len(self.rejected):,} "
                    f"rejected): {b.layout}, {b.step_time:.3g} s per step, "
                    f"{b.tokens_per_second:,.0f} tokens/s, MFU {100 * b.mfu:.1f} %")
        counts = ", ".join(f"{n:,} rejected for {k}" for k, n in
                           self.rejection_counts().most_common())
        text = f"nothing fits: {i['model']} on {i['gpus']:,} x {i['gpu']} ({counts})."
        over = self.leanest(1)
        if over:
            lean = over[0]
            text += (f" The leanest layout, {lean.layout}, needs {_gb(lean.reason):,.1f} GB per "
                     f"GPU of the {i['capacity'] / GB:,.0f} GB; model states alone are "
                     f"{i['states_per_param']} B/param x {i['params'] / 1e9:,.1f}B parameters = "
                     f"{i['states_per_param'] * i['params'] / GB:,.0f} GB, "
                     f"{i['states_per_param'] * i['params'] / GB / i['gpus']:,.1f} GB per GPU "
                     "even spread evenly over every GPU: more GPUs, or GPUs with more memory.")
        return text

    def table(self, top: int = 10) -> str:
        """The `top` fastest layouts with their step-time breakdown ("8u": 8 uneven stages)."""
        head = (f"{'#':>3} {'tp':>3} {'sp':>2} {'pp':>4} {'v':>2} {'dp':>5} {'cp':>3} {'ep':>3} "
                f"{'sharding':>8} {'b':>2} {'m':>4} {'recompute':>9} {'GB':>6} {'step s':>8} "
                + " ".join(f"{p[:7]:>7}" for p in PARTS)
                + f" {'tok/s':>10} {'TF/GPU':>6} {'MFU%':>5}")
        lines = [head]
        for k, e in enumerate(self.ranked[:top], 1):
            lay, bd = e.layout, e.breakdown
            lines.append(
                f"{k:>3} {lay.tp:>3} {'y' if lay.sequence_parallel else '-':>2} "
                f"{str(lay.pp) + ('u' if lay.uneven and lay.pp > 1 else ''):>4} "
                f"{lay.chunks:>2} {lay.dp:>5} {lay.cp:>3} {lay.ep:>3} {_sharding(lay):>8} "
                f"{lay.micro_batch:>2} {e.microbatches:>4} {lay.recompute:>9} "
                f"{e.memory / GB:>6.1f} {e.step_time:>8.3f} "
                + " ".join(f"{bd[p]:>7.3f}" for p in PARTS)
                + f" {e.tokens_per_second:>10,.0f} {e.model_tflops_per_gpu:>6.0f} "
                f"{100 * e.mfu:>5.1f}")
        return "\n".join(lines)


@dataclass
class Comparison:
    """A layout against a plan's best (`Plan.compare`)."""

    estimate: Estimate
    best: Estimate | None
    rank: int | None                # among the plan's feasible layouts; None: it does not fit
    of: int

    def differences(self) -> dict:
        """Seconds per step by part: this layout's minus the best's (positive: slower here)."""
        if self.best is None:
            return {}
        return {p: self.estimate.breakdown[p] - self.best.breakdown[p] for p in PARTS}

    def text(self) -> str:
        e, b = self.estimate, self.best
        where = (f"rank {self.rank:,} of {self.of:,} feasible layouts" if self.rank else
                 f"does not fit: {e.memory / GB:,.1f} GB per GPU, {e.usable / GB:,.1f} usable "
                 f"of {e.capacity / GB:,.0f}")
        lines = [f"{e.layout}: {e.step_time:.3g} s per step, {e.memory / GB:.1f} GB per GPU, "
                 f"MFU {100 * e.mfu:.1f} % ({where})"]
        if b is None:
            return "\n".join(lines + ["nothing fits in this plan: no best to compare with"])
        lines.append(f"best: {b.layout}: {b.step_time:.3g} s per step, {b.memory / GB:.1f} GB "
                     f"per GPU, MFU {100 * b.mfu:.1f} %")
        lines.append(f"{'part':>9} {'this':>9} {'best':>9} {'this-best':>10}")
        diff = self.differences()
        for p in PARTS:
            lines.append(f"{p:>9} {e.breakdown[p]:>9.3f} {b.breakdown[p]:>9.3f} "
                         f"{diff[p]:>+10.3f}")
        worse = sorted((d, p) for p, d in diff.items() if d > 0)[::-1][:2]
        total = e.step_time - b.step_time
        if total > 0 and worse:
            lines.append(f"slower by {total:.3g} s ({100 * total / b.step_time:.1f} %), mostly "
                         + " and ".join(f"{p} (+{d:.3g} s)" for d, p in worse))
        elif total <= 0:
            lines.append("as fast as the best, or faster" + ("" if e.fits else
                                                              ", but it does not fit"))
        return "\n".join(lines)


_LAYOUT_KEYS = {"tp": "tp", "pp": "pp", "dp": "dp", "cp": "cp", "b": "micro_batch",
                "micro_batch": "micro_batch", "v": "chunks", "chunks": "chunks",
                "recompute": "recompute", "sharding": "sharding", "ep": "ep"}


def parse_layout(text: str) -> Layout:
    """A Layout from its text: "tp=8 pp=16 dp=128 cp=1 fsdp b=1 recompute=full", with "+sp"
    after tp (or "sp") for sequence parallelism, "v=2" for interleaved chunks and "uneven" for
    one layer fewer on the first and last stages; the form
    `str(Layout)` prints. Unknown words are a ValueError naming them and what is allowed."""
    if not isinstance(text, str) or not text.split():
        raise ValueError(f"layout={text!r} must be text such as 'tp=8 pp=16 dp=128 fsdp'")
    kw: dict = {}
    for word in text.replace(",", " ").split():
        key, _, value = word.partition("=")
        if word in SHARDING:
            kw["sharding"] = word
        elif word == "no-reshard":
            kw["sharding"], kw["reshard_after_forward"] = "fsdp", False
        elif word == "uneven":
            kw["uneven"] = True
        elif word in ("sp", "+sp", "sequence_parallel"):
            kw["sequence_parallel"] = True
        elif key in _LAYOUT_KEYS and value:
            if key == "tp" and value.endswith("+sp"):
                value, kw["sequence_parallel"] = value[:-3], True
            field_name = _LAYOUT_KEYS[key]
            try:
                kw[field_name] = value if field_name in ("recompute", "sharding") else int(value)
            except ValueError:
                raise ValueError(f"layout: {word!r} needs a whole number") from None
        else:
            raise ValueError(f"layout: {word!r} is not understood; allowed: tp=, pp=, dp=, cp=, "
                             f"b=, v=, ep= (experts), recompute=, a sharding "
                             f"({', '.join(SHARDING)}), no-reshard (FSDP), sp, uneven (pipeline)")
    return _check_layout(Layout(**kw))


def _sharding(lay: Layout) -> str:
    return "fsdp-nr" if lay.sharding == "fsdp" and not lay.reshard_after_forward else lay.sharding


def _gb(reason: str) -> float:
    return float(reason.split("needs ", 1)[1].split(" GB", 1)[0].replace(",", ""))


def _setup(model, gpus, gpu, gpus_per_node, global_batch, seq_len, precision, optimizer, mfu,
           intra_link, inter_link, schedule, grad_accum, implementation, attention,
           framework="megatron", reserved=None, fragmentation=None):
    spec = get_model(model)
    n = validate.positive_int("gpus", gpus, validate.MAX_RANKS)
    gpn = validate.positive_int("gpus_per_node", gpus_per_node, validate.MAX_RANKS)
    if n > gpn and n % gpn:
        raise ValueError(f"gpus={n:,} is not a whole number of nodes of gpus_per_node={gpn}; "
                         f"allowed: 1 to {gpn}, or a multiple of {gpn}")
    the_gpu = get_gpu(gpu)
    s = validate.positive_int("seq_len", min(spec.max_seq_len, 8192) if seq_len is None
                              else seq_len, validate.MAX_SEQ_LEN)
    if spec.learned_positions and s > spec.max_seq_len:
        raise ValueError(f"seq_len={s:,} exceeds the {spec.max_seq_len:,} learned positions of "
                         f"{spec.name}; allowed: 1 to {spec.max_seq_len:,}")
    B = validate.positive_int("global_batch", max(1, DEFAULT_TOKENS // s)
                              if global_batch is None else global_batch, validate.MAX_BATCH)
    validate.choice("precision", precision, COMPUTE_DTYPE)
    dtype = COMPUTE_DTYPE[precision]
    if dtype not in the_gpu.peak_flops:
        raise ValueError(f"precision={precision!r} runs its matmuls in {dtype}, for which gpu="
                         f"{the_gpu.name!r} has no peak figure; allowed on it: " + ", ".join(
                             repr(p) for p, d in COMPUTE_DTYPE.items() if d in the_gpu.peak_flops))
    u = None if mfu is None else validate.positive("mfu", mfu, 1.0)
    validate.choice("framework", framework, FRAMEWORKS)
    if implementation is None:      # what the framework's kernels keep for backward
        implementation = "fused" if FRAMEWORKS[framework].kernels == "fused" else None
    validate.choice("schedule", schedule, SCHEDULES)
    key = gpu if isinstance(gpu, str) else ""
    intra = get_link(INTRA.get(key.lower(), "pcie4") if intra_link is None else intra_link)
    inter = get_link(INTER.get(key.lower(), "ib-ndr") if inter_link is None else inter_link)
    pricer = Pricer(spec, n, B, s, gpu=the_gpu, dtype=dtype, mfu=u, intra=intra, inter=inter,
                    gpus_per_node=gpn, precision=precision, optimizer=optimizer,
                    grad_accum=grad_accum, schedule=schedule, implementation=implementation,
                    attention=attention, framework=framework)
    inputs = dict(model=spec.name, gpus=n, gpu=the_gpu.name, capacity=the_gpu.memory,
                  gpus_per_node=gpn, global_batch=B, seq_len=s, precision=precision,
                  optimizer=optimizer, mfu=matmul_efficiency(the_gpu) if u is None else u, intra_link=intra.name, inter_link=inter.name,
                  schedule=schedule, params=spec.num_params(),
                  states_per_param=sum(pricer.state_bytes), framework=framework,
                  usable=usable_memory(the_gpu.device_bytes, reserved, fragmentation))
    return spec, pricer, inputs


def degree_problem(spec, lay: Layout, gpus_per_node: int, seq_len: int,
                   min_cp_tokens: int = 1, cross_node_tp: bool = False) -> str | None:
    """Why degrees tp, pp, cp (and sequence parallelism) cannot run `spec`, or None.
    cross_node_tp: TP over whole nodes is priced (on the inter-node link), not refused."""
    t, s = lay.tp, seq_len
    whole_nodes = cross_node_tp and t > gpus_per_node and t % gpus_per_node == 0
    if (t > gpus_per_node or gpus_per_node % t) and not whole_nodes:
        return (f"tp across nodes: tp={t} with {gpus_per_node} GPUs per node; TP's per-layer "
                f"collectives need the intra-node link: tp must divide {gpus_per_node}")
    for what, count in tp_splits(spec).items():
        if count % t:
            return f"divisibility: tp={t} does not divide {what}={count:,}"
    if lay.pp * lay.chunks > spec.num_layers:
        return (f"divisibility: pp={lay.pp}" + (f" x chunks={lay.chunks}" if lay.chunks > 1
                                                 else "")
                + f" is more stages than num_layers={spec.num_layers}")
    if s % lay.cp:
        return f"divisibility: cp={lay.cp} does not divide seq_len={s:,}"
    if lay.cp > 1 and s // lay.cp < min_cp_tokens:
        return (f"cp: cp={lay.cp} leaves {s // lay.cp:,} tokens per rank, fewer than "
                f"min_cp_tokens={min_cp_tokens:,}")
    if lay.sequence_parallel and (t == 1 or (s // lay.cp) % t):
        return (f"divisibility: sequence parallelism needs tp > 1 dividing seq_len / cp = "
                f"{s // lay.cp:,}; tp={t}")
    if lay.ep > 1:
        if not spec.is_moe:
            return f"ep: ep={lay.ep} needs a mixture of experts; {spec.name} is dense"
        if spec.num_experts % lay.ep:
            return f"divisibility: ep={lay.ep} does not divide num_experts={spec.num_experts}"
        if (t * lay.cp * lay.dp) % lay.ep:
            return (f"divisibility: ep={lay.ep} does not divide tp x cp x dp = "
                    f"{t * lay.cp * lay.dp} (the expert layers reuse those ranks)")
    return None


def _price(pricer, lay: Layout, inputs, time_rejected=True) -> tuple[Estimate | None, str | None]:
    """(Estimate, None), or (Estimate or None, why not); time_rejected=False: a layout over
    the memory is not timed (plan's search, which keeps only the reason)."""
    B = inputs["global_batch"]
    if B % (lay.dp * lay.micro_batch):
        return None, (f"batch: global_batch={B:,} is not divisible by dp x micro-batch = "
                      f"{lay.dp} x {lay.micro_batch}")
    m = B // (lay.dp * lay.micro_batch)
    if lay.chunks > 1 and m < lay.pp:
        return None, (f"batch: interleaved 1F1B needs at least pp={lay.pp} micro-batches; "
                      f"m={m}")
    mem = pricer.memory(lay, m)
    why = None if mem <= inputs["usable"] else (
        f"memory: needs {mem / GB:,.1f} GB per GPU, more than the "
        f"{inputs['usable'] / GB:,.1f} GB usable of the "
        f"{inputs['capacity'] / GB:,.0f} GB of the {inputs['gpu']}")
    if why and not time_rejected:
        return None, why
    est = Estimate(lay, m, mem, inputs["capacity"], pricer.time(lay, m), inputs["usable"],
                   {a: link.name for a, link in pricer.links(lay).items()},
                   B * inputs["seq_len"], pricer.flops("none", hardware=False),
                   pricer.flops(lay.recompute), pricer.peak)
    return est, why               # over the memory, priced anyway: `evaluate` shows it


def _check_layout(lay: Layout) -> Layout:
    if not isinstance(lay, Layout):
        raise ValueError(f"layout={validate.describe(lay)} must be a labkit.planner.Layout")
    for name in ("tp", "pp", "dp", "cp", "micro_batch", "chunks", "ep"):
        validate.positive_int(f"layout.{name}", getattr(lay, name), validate.MAX_RANKS)
    validate.choice("layout.sharding", lay.sharding, SHARDING)
    validate.choice("layout.recompute", lay.recompute, RECOMPUTE)
    validate.choice("layout.sequence_parallel", lay.sequence_parallel, (False, True))
    validate.choice("layout.reshard_after_forward", lay.reshard_after_forward, (False, True))
    validate.choice("layout.uneven", lay.uneven, (False, True))
    return lay


def evaluate(model, layout: Layout, gpu="h100-sxm", gpus_per_node=8, global_batch=None,
             seq_len=None, precision="bf16-mixed", optimizer="adamw", mfu=None, intra_link=None,
             inter_link=None, schedule="1f1b", grad_accum="param", implementation=None,
             attention=None, framework="megatron", reserved=None,
             fragmentation=None) -> Estimate:
    """Price ONE layout (e.g. a published run's) as `plan` prices each: an Estimate whose `.fits`
    says whether it fits. A layout that cannot run at all (degrees that do not divide, a batch
    that does not split) is a ValueError with the reason. layout.chunks > 1: interleaved 1F1B.
    TP over whole nodes, which `plan` refuses, is priced on the inter-node link (runs measured
    that way exist: labkit.field's sweep)."""
    lay = _check_layout(layout)
    spec, pricer, inputs = _setup(model, lay.gpus, gpu, gpus_per_node, global_batch, seq_len,
                                  precision, optimizer, mfu, intra_link, inter_link, schedule,
                                  grad_accum, implementation, attention, framework, reserved,
                                  fragmentation)
    problem = degree_problem(spec, lay, inputs["gpus_per_node"], inputs["seq_len"],
                             cross_node_tp=True)
    est, why = (None, problem) if problem else _price(pricer, lay, inputs)
    if est is None:
        raise ValueError(f"layout {lay} cannot run {spec.name}: {why}")
    return est


def plan(model, gpus, gpu="h100-sxm", gpus_per_node=8, global_batch=None, seq_len=None,
         precision="bf16-mixed", optimizer="adamw", mfu=None, intra_link=None, inter_link=None,
         max_microbatch=8, schedule="1f1b", grad_accum="param", min_cp_tokens=1024,
         implementation=None, attention=None, framework="megatron", reserved=None,
         fragmentation=None, max_chunks=4, recompute=RECOMPUTE,
         sequence_parallel=(False, True), sharding=tuple(SHARDING), max_pp=None) -> Plan:
    """Every layout of `model` on `gpus` GPUs (`Layout`), ranked by step time.

    gpu: a key of `labkit.hardware.GPUS`; gpus_per_node: GPUs one intra-node link joins;
    global_batch: sequences per step (default about 4M tokens); seq_len: default the model's
    context, at most 8,192; mfu: share of the dense peak the matmuls reach, in (0, 1];
    intra_link / inter_link: keys of LINKS or Links (default: the GPU's NVLink, and one
    InfiniBand port per GPU: HDR for A100s, else NDR); max_microbatch: micro-batch sizes tried
    are the powers of two up to it; schedule: "1f1b" or "gpipe"; min_cp_tokens: fewest tokens a
    context-parallel rank keeps (seq_len: no CP); max_chunks: interleaved model chunks per
    stage tried (1, 2, 4, ...); recompute / sequence_parallel: the modes tried (e.g.
    recompute=("full",), sequence_parallel=(False,), sharding=("ddp",) searches what
    Megatron-LM offered in 2021; `ERAS`); max_pp: the most pipeline stages tried (default any;
    1 for a framework without pipelining);
    framework: whose kernels and host costs (`labkit.kernels.FRAMEWORKS`, default "megatron");
    reserved / fragmentation: the headroom (`usable_memory`). Ranked by `rank_key`: step time,
    CP layouts charged CP_PREMIUM.

    Rejected, each with its reason, in this order: TP across nodes (tp larger than, or not
    dividing, gpus_per_node: its per-layer collectives need NVLink); degrees that do not divide
    what they split (tp: heads, KV heads, MLP width; pp: at most num_layers, stages may be
    uneven, as Llama 3 405B's 126 layers on 16 stages; cp: seq_len, keeping at least
    `min_cp_tokens` tokens per rank; tp | seq_len / cp with sequence parallelism); a global
    batch not divisible by dp x b; memory over the GPU (`labkit.memory.estimate_memory`, worst
    stage, GB = 1e9 bytes)."""
    spec, pricer, inputs = _setup(model, gpus, gpu, gpus_per_node, global_batch, seq_len,
                                  precision, optimizer, mfu, intra_link, inter_link, schedule,
                                  grad_accum, implementation, attention, framework, reserved,
                                  fragmentation)
    top_v = validate.positive_int("max_chunks", max_chunks, validate.MAX_LAYERS)
    top_pp = (validate.MAX_LAYERS if max_pp is None
              else validate.positive_int("max_pp", max_pp, validate.MAX_LAYERS))
    modes = _subset("recompute", recompute, RECOMPUTE)
    sps = _subset("sequence_parallel", sequence_parallel, (False, True))
    shards = _subset("sharding", sharding, tuple(SHARDING))
    top_b = validate.positive_int("max_microbatch", max_microbatch, validate.MAX_BATCH)
    min_cp = validate.positive_int("min_cp_tokens", min_cp_tokens, validate.MAX_SEQ_LEN)
    n, gpn, s = inputs["gpus"], inputs["gpus_per_node"], inputs["seq_len"]
    sizes = [2**k for k in range(int(math.log2(top_b)) + 1)]
    out = Plan(inputs=inputs, pricing=(spec, dict(
        gpu=gpu, gpus_per_node=gpus_per_node, global_batch=inputs["global_batch"], seq_len=s,
        precision=precision, optimizer=optimizer, mfu=mfu, intra_link=intra_link,
        inter_link=inter_link, schedule=schedule, grad_accum=grad_accum,
        implementation=implementation, attention=attention, framework=framework,
        reserved=reserved, fragmentation=fragmentation)))
    for tp in validate.divisors(n):
        for pp in validate.divisors(n // tp):
            if pp > top_pp:
                continue
            for cp in validate.divisors(n // (tp * pp)):
                dp = n // (tp * pp * cp)
                base = Layout(tp=tp, pp=pp, dp=dp, cp=cp)
                problem = degree_problem(spec, base, gpn, s, min_cp)
                if problem:
                    out.rejected.append(Rejection(base, problem))
                    continue
                if inputs["global_batch"] % dp:
                    out.rejected.append(Rejection(base, (
                        f"batch: global_batch={inputs['global_batch']:,} is not divisible by "
                        f"dp={dp:,}")))
                    continue
                # expert parallelism (an MoE model): every ep that divides the experts and
                # the tp x cp x dp ranks the expert layers reuse
                for ep in (validate.divisors(spec.num_experts) if spec.is_moe else [1]):
                    if (tp * cp * dp) % ep == 0:
                        _levers(pricer, replace(base, ep=ep), sizes, inputs, out, spec, top_v,
                                modes, sps, shards)
    # at the same step time (4 significant digits), the fewest model-parallel ranks (less to
    # set up and to go wrong), then the least memory; CP ranked as if CP_PREMIUM slower
    out.ranked.sort(key=rank_key)
    return out


def rank_key(e: Estimate) -> tuple:
    """How `plan` orders layouts: step time (CP's x (1 + CP_PREMIUM)) at 4 significant digits,
    then the fewest model-parallel ranks, then the least memory."""
    lay = e.layout
    t = e.step_time * (1 + CP_PREMIUM if lay.cp > 1 else 1)
    return float(f"{t:.4g}"), lay.tp * lay.pp * lay.cp, e.memory


def _subset(name, values, allowed) -> tuple:
    values = tuple(values) if isinstance(values, (list, tuple)) else (values,)
    if not values:
        raise ValueError(f"{name}=() tries nothing; allowed: a non-empty choice of {allowed}")
    for v in values:
        validate.choice(name, v, allowed)
    return values


def _levers(pricer, base, sizes, inputs, out, spec, top_v, modes=RECOMPUTE,
            allowed_sp=(False, True), shards=tuple(SHARDING)) -> None:
    """Price every sharding (FSDP with and without resharding after forward), interleaving
    (chunks v = 1, 2, 4, ... up to top_v with pp x v <= num_layers), even stages and, where
    pp divides num_layers + 2, uneven ones, sequence parallelism,
    recompute and micro-batch size of `base`."""
    shardings = ([(s, True) for s in shards] + [("fsdp", False)] * ("fsdp" in shards)
                 if base.dp * base.cp > 1 else [("ddp", True)])
    chunks = [v for v in (2**k for k in range(int(math.log2(top_v)) + 1))
              if base.pp * v <= spec.num_layers] if base.pp > 1 else [1]
    sps = [sp for sp in allowed_sp
           if not sp or (base.tp > 1 and (inputs["seq_len"] // base.cp) % base.tp == 0)]
    # uneven stages where they make every slot equal: (layers + 2) % pp == 0 (Llama 3's 126 + 2
    # on 16 stages; BigScience's "Layers+2 % PP = 0" for BLOOM's 70 on 12)
    unevens = (False, True) if base.pp > 1 and (spec.num_layers + 2) % base.pp == 0 else (False,)
    for (sharding, reshard), v, u, sp, rc, b in itertools.product(shardings, chunks, unevens,
                                                                    sps, modes, sizes):
        lay = replace(base, sharding=sharding, reshard_after_forward=reshard, chunks=v,
                      uneven=u, sequence_parallel=sp, recompute=rc, micro_batch=b)
        est, why = _price(pricer, lay, inputs, time_rejected=False)
        if why:
            out.rejected.append(Rejection(lay, why))
        else:
            out.ranked.append(est)


# ---- the decision framework: which lever to turn on first, and what each later one buys ------
# Cumulative rungs, cheapest lever first: each allows its lever and every one before it. A
# layout's rung is that of the last lever it uses (`rung_of`).
LADDER = (
    ("data parallel", "a full copy of the model per GPU, each on its share of the batch: only "
     "the gradient all-reduce, hidden behind backward", lambda lay: True),
    ("sharding (ZeRO / FSDP)", "the model states split over the data-parallel ranks: 16 B/param "
     "/ dp, for gathers that hide behind compute", lambda lay: lay.sharding != "ddp"),
    ("recompute", "activations dropped in forward and recomputed in backward: memory for up "
     "to a third more compute", lambda lay: lay.recompute != "none"),
    ("TP inside a node", "each layer's matmuls split over NVLink: weights and activations / "
     "tp, for collectives on the critical path", lambda lay: lay.tp > 1),
    ("PP across nodes", "the layers split into stages, point-to-point sends between nodes: "
     "for a pipeline bubble", lambda lay: lay.pp > 1),
    ("CP", "the sequence split over ranks, K/V passed around a ring: activations / cp for long "
     "contexts", lambda lay: lay.cp > 1),
)
WORTH = 0.01         # a later lever is worth turning on when it saves at least 1 % of the step


def rung_of(layout: Layout) -> int:
    """The index in LADDER of the last lever `layout` uses (0: plain data parallelism)."""
    return max(k for k, (_, _, uses) in enumerate(LADDER) if uses(layout))


@dataclass
class Rung:
    lever: str
    buys: str
    best: Estimate | None           # fastest layout using this lever and those before it only
    reason: str                     # why nothing fits on this rung ("" when one does)


@dataclass
class Decision:
    plan: Plan
    rungs: list

    @property
    def first(self) -> Rung | None:
        """The lever to turn on first: the lowest rung on which a layout fits."""
        return next((r for r in self.rungs if r.best is not None), None)

    @property
    def worth(self) -> list:
        """The rungs after the first that save at least WORTH of the step time of the best
        below them: the levers worth turning on next, in order."""
        out, last = [], self.first
        for r in self.rungs[self.rungs.index(last) + 1:] if last else []:
            if r.best is not None and r.best.step_time < (1 - WORTH) * last.best.step_time:
                out.append(r)
                last = r
        return out

    def text(self) -> str:
        """One line per rung: what fits with the levers up to it, and the step time it gives."""
        lines, first = [], self.first
        for k, r in enumerate(self.rungs):
            mark = ("  <- turn on first" if r is first else "  <- worth it" if r in self.worth
                    else "")
            got = (f"{r.best.layout}: {r.best.step_time:.3g} s per step, "
                   f"{r.best.memory / GB:.1f} GB per GPU" if r.best else r.reason)
            lines.append(f"{k + 1}. {'+ ' if k else ''}{r.lever}: {got}{mark}")
        return "\n".join(lines)


def decision(model, gpus, **kwargs) -> Decision:
    """The decision framework on `plan(model, gpus, **kwargs)` (see `decide`)."""
    return decide(plan(model, gpus, **kwargs))


def decide(p: Plan) -> Decision:
    """For each rung of LADDER, the fastest layout of plan `p` that uses only its lever and
    those before it, or why none fits; `Decision.first` is the lever to turn on first."""
    rungs = []
    for k, (lever, buys, _) in enumerate(LADDER):
        best = next((e for e in p.ranked if rung_of(e.layout) <= k), None)
        reason = ""
        if best is None:
            below = Plan(rejected=[r for r in p.rejected if rung_of(r.layout) <= k],
                         inputs=p.inputs)
            lean = below.leanest(1)
            first = lean[0] if lean else below.rejected[0]
            reason = (f"nothing {'fits' if lean else 'runs'} ({len(below.rejected):,} rejected)"
                      f"; e.g. {first.layout}: {first.reason}")
        rungs.append(Rung(lever, buys, best, reason))
    return Decision(p, rungs)
