"""Design cases worked with labkit: the whiteboard questions of an interview, every number from
the cost models (no formula of its own beyond adding their results up).

    >>> run = pretraining_run("llama3-70b", gpus=512, gpu="h100-sxm", days=30)
    >>> run.tokens, run.layout, run.memory, run.step_time, run.mfu, run.interval
    >>> print(run.summary())
    >>> ft = finetune_run("llama3-8b", gpus=8)           # full fine-tune: what fits on 8 GPUs
    >>> lc = long_context_run("llama3-8b", seq_len=2**20)   # the CP degree a 1M context needs

How each case is worked, and from which model, is in its function's docstring. Pure Python.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
import math

from labkit import flops, memory, resilience, validate
from labkit.comm import collective_time, step_communication
from labkit.hardware import GB, LINKS, get_gpu
from labkit.kernels import matmul_efficiency
from labkit.models import get_model
from labkit.planner import Estimate, Layout, evaluate, plan

DAY = resilience.DAY
# Hoffmann et al. 2022 ("Training Compute-Optimal Large Language Models", Chinchilla): for a
# compute-optimal model, about 20 training tokens per parameter (their Table 3's fits; a rule of
# thumb, stated as such).
CHINCHILLA_TOKENS_PER_PARAM = 20
# The course's scenario for failures and storage (module 05): 0.01 % of GPUs fail a day, and the
# file system takes a checkpoint at 100 GB/s in aggregate. Scenario inputs, not hardware facts.
# Measured: Llama 3's pre-training lost about 0.047 % of its GPUs a day (419 unexpected
# interruptions in 54 days on 16,384 GPUs, `resilience.LLAMA3_FAILURE_RATE`), 4.7 times the
# scenario; `PretrainingCase.at_failure_rate` works a case at that rate.
SCENARIO_FAILURE_RATE = 1e-4
SCENARIO_CKPT_BANDWIDTH = 100 * GB
LORA_SCOPE = ("LoRA is out of scope here: labkit's memory model (`estimate_memory`) has no "
              "policy for frozen weights (no gradients or optimizer states for them, adapters "
              "with their own), so it cannot cost LoRA honestly; the full fine-tune is costed.")


def _efficiency(value, gpu) -> float:
    """matmul_efficiency, None meaning what labkit.kernels prices (`matmul_efficiency`)."""
    if value is None:
        return matmul_efficiency(gpu)
    return validate.positive("matmul_efficiency", value, 1.0)


def trainable_tokens(model, gpus, gpu, days, mfu, seq_len=None, dtype="bf16") -> float:
    """Tokens `gpus` x `gpu` train in `days` at model FLOPs utilisation `mfu`:
    days x 86,400 x gpus x dense peak x mfu / (6N + attention FLOPs per token)."""
    d = validate.positive("days", days, 1e6)
    u = validate.positive("mfu", mfu, 1.0)
    g = validate.positive_int("gpus", gpus, validate.MAX_RANKS)
    return d * DAY * g * get_gpu(gpu).flops(dtype) * u / flops.flops_per_token(model, seq_len)


def gpus_for_tokens(model, tokens, gpu, days, mfu, seq_len=None, dtype="bf16") -> int:
    """The fewest GPUs that train `tokens` in `days` at `mfu` (rounded up)."""
    t = validate.positive("tokens", tokens, 1e18)
    one = trainable_tokens(model, 1, gpu, days, mfu, seq_len, dtype)
    return max(1, math.ceil(t / one - 1e-9))


@dataclass
class PretrainingCase:
    """A pre-training run designed with labkit (see `pretraining_run`). Bytes, seconds, FLOPs."""

    inputs: dict
    params: int
    flops_per_token: float           # model FLOPs per token: 6N + attention
    attention_share: float           # of those, the attention scores' share
    estimate: Estimate               # the planner's fastest layout
    tokens: float                    # trained in `days` at the plan's throughput, no failures
    chinchilla_tokens: float         # 20 N
    gpus_for_chinchilla: int         # GPUs to train 20 N tokens in `days` at the same MFU
    checkpoint_bytes: float
    write_seconds: float
    mtbf: float                      # seconds between failures of the whole job
    interval: float                  # Young's optimal seconds of work between checkpoints
    overhead: float                  # fraction of the time lost (writes + lost work)
    expected_failures: float         # over the run
    candidates: int = 0              # layouts the planner priced (feasible)

    layout = property(lambda self: self.estimate.layout)
    memory = property(lambda self: self.estimate.memory)          # bytes per GPU, worst stage
    step_time = property(lambda self: self.estimate.step_time)
    tokens_per_second = property(lambda self: self.estimate.tokens_per_second)
    mfu = property(lambda self: self.estimate.mfu)

    @property
    def chinchilla_days(self) -> float:
        """Days these GPUs need for 20 N tokens at the plan's throughput."""
        return self.chinchilla_tokens / self.tokens_per_second / DAY

    def at_failure_rate(self, daily_failure_rate) -> "PretrainingCase":
        """This run at another failure rate per GPU per day (a fraction; Llama 3 measured
        `resilience.LLAMA3_FAILURE_RATE`): the MTBF, Young's interval, the time lost and the
        failures expected recomputed; the layout, the checkpoint and the tokens are the same."""
        i = self.inputs
        return replace(self, inputs={**i, "daily_failure_rate": daily_failure_rate},
                       **_failures(i["gpus"], daily_failure_rate, self.write_seconds,
                                   i["restart_seconds"], i["days"]))

    @property
    def goodput_tokens(self) -> float:
        """Tokens left after checkpoint writes and the work lost to failures."""
        return self.tokens * (1 - self.overhead)

    def summary(self) -> str:
        i, e = self.inputs, self.estimate
        return "\n".join([
            f"{i['model']} on {i['gpus']:,} x {i['gpu']} for {i['days']:g} days "
            f"({self.params / 1e9:.1f}B parameters, {i['seq_len']:,}-token sequences, "
            f"{i['global_batch']:,} per step)",
            f"  FLOPs per token   {self.flops_per_token:.3e} (6N + attention; attention "
            f"{self.attention_share:.1%})",
            f"  layout            {e.layout} (best of {self.candidates:,} that fit)",
            f"  memory per GPU    {e.memory / GB:.1f} GB of {e.capacity / GB:.0f} GB",
            f"  step time         {e.step_time:.2f} s; {e.tokens_per_second:,.0f} tokens/s; "
            f"MFU {e.mfu:.1%}",
            f"  tokens in {i['days']:g} days {self.tokens / 1e12:.2f}T; Chinchilla 20N = "
            f"{self.chinchilla_tokens / 1e12:.2f}T ({self.chinchilla_days:.1f} days here, or "
            f"{self.gpus_for_chinchilla:,} GPUs for {i['days']:g} days)",
            f"  checkpoint        {self.checkpoint_bytes / GB:,.0f} GB in "
            f"{self.write_seconds:.1f} s at {i['ckpt_bandwidth'] / GB:g} GB/s",
            f"  failures          MTBF {self.mtbf / 3600:.1f} h at {i['daily_failure_rate']:.3%}"
            f"/GPU/day; {self.expected_failures:.1f} expected over the run",
            f"  checkpoint every  {self.interval / 60:.1f} min (Young); {self.overhead:.2%} of "
            f"the time lost; {self.goodput_tokens / 1e12:.2f}T tokens left",
        ])


def pretraining_run(model="llama3-70b", gpus=512, gpu="h100-sxm", days=30, *, seq_len=8192,
                    global_batch_tokens=2**22, matmul_efficiency=None,
                    daily_failure_rate=SCENARIO_FAILURE_RATE,
                    ckpt_bandwidth=SCENARIO_CKPT_BANDWIDTH, restart_seconds=0.0,
                    min_cp_tokens=None, gpus_per_node=8) -> PretrainingCase:
    """Design a pre-training run: the planner's fastest layout of `model` on `gpus` x `gpu`
    (global batch `global_batch_tokens` / seq_len sequences; matmul_efficiency: the share of
    the dense peak the matmuls reach, the planner's `mfu`; the MFU reported counts the
    communication and bubble too), the tokens trained in `days`, checkpoints and failures
    (`daily_failure_rate` per GPU, a fraction: default the course's scenario of 0.01 %, Llama 3
    measured about 0.047 %; `ckpt_bandwidth` bytes/s in aggregate; `restart_seconds` lost per
    failure). min_cp_tokens: default seq_len (no CP).

    The planner's fastest layout (`labkit.planner.plan`, CP left off: context parallelism is
    for sequences too long for one GPU) gives the memory per GPU, the step time and the MFU;
    the tokens the GPUs train in `days` follow from MFU: tokens = days x 86,400 x gpus x peak x
    MFU / FLOPs per token (`labkit.flops`: 6N + the attention term), compared with Chinchilla's
    rule of about 20 tokens per parameter (Hoffmann et al. 2022). Checkpoints
    (`labkit.resilience`): 12 B/param written at `ckpt_bandwidth`, the job's MTBF
    1 / (gpus x rate), Young's interval sqrt(2 delta M), the time lost, the failures expected
    over the run, and the tokens left after that loss."""
    spec = get_model(model)
    s = validate.positive_int("seq_len", seq_len, validate.MAX_SEQ_LEN)
    bt = validate.positive_int("global_batch_tokens", global_batch_tokens, 10**12)
    if bt < s:
        raise ValueError(f"global_batch_tokens={bt:,} is less than one sequence of seq_len="
                         f"{s:,}; allowed: at least {s:,}")
    d = validate.positive("days", days, 1e6)
    matmul_efficiency = _efficiency(matmul_efficiency, gpu)
    p = plan(spec, gpus, gpu=gpu, gpus_per_node=gpus_per_node, global_batch=bt // s,
             seq_len=s, mfu=matmul_efficiency,
             min_cp_tokens=s if min_cp_tokens is None else min_cp_tokens)
    if p.best is None:
        raise ValueError(f"no layout of {spec.name} fits on {gpus:,} x {gpu}: {p.why()}")
    best = p.best
    per_token = flops.flops_per_token(spec, s)
    attention = 3 * flops.attention_flops_per_token(spec, s)
    tokens = trainable_tokens(spec, gpus, gpu, d, best.mfu, s)
    chinchilla = CHINCHILLA_TOKENS_PER_PARAM * spec.num_params()
    size = resilience.checkpoint_bytes(spec)
    write = resilience.write_seconds(size, ckpt_bandwidth)
    inputs = dict(model=spec.name, gpus=p.inputs["gpus"], gpu=gpu, days=d, seq_len=s,
                  global_batch=p.inputs["global_batch"], matmul_efficiency=matmul_efficiency,
                  daily_failure_rate=daily_failure_rate, ckpt_bandwidth=ckpt_bandwidth,
                  restart_seconds=restart_seconds)
    return PretrainingCase(
        inputs=inputs, params=spec.num_params(), flops_per_token=per_token,
        attention_share=attention / per_token, estimate=best, tokens=tokens,
        chinchilla_tokens=chinchilla,
        gpus_for_chinchilla=gpus_for_tokens(spec, chinchilla, gpu, d, best.mfu, s),
        checkpoint_bytes=size, write_seconds=write, candidates=len(p.ranked),
        **_failures(gpus, daily_failure_rate, write, restart_seconds, d))


def _failures(gpus, rate, write, restart_seconds, days) -> dict:
    """The job's MTBF, Young's interval, the time lost and the failures over `days`."""
    mtbf = resilience.job_mtbf(gpus, rate)
    tau = resilience.young_daly_interval(mtbf, write)
    return dict(mtbf=mtbf, interval=tau, overhead=resilience.overhead(tau, write, mtbf,
                                                                      restart_seconds),
                expected_failures=resilience.failures_per_day(gpus, rate) * days)


# ---- full fine-tuning --------------------------------------------------------------------------

@dataclass(frozen=True)
class FinetuneOption:
    zero_stage: int
    recompute: str
    model_states: float              # bytes per GPU
    activations: float               # bytes per GPU
    capacity: float

    @property
    def total(self) -> float:
        return self.model_states + self.activations

    @property
    def fits(self) -> bool:
        return self.total <= self.capacity


@dataclass
class FinetuneCase:
    inputs: dict
    params: int
    options: list                    # FinetuneOption for each ZeRO stage x recompute mode
    estimate: Estimate               # the planner's fastest layout on the same GPUs
    lora: str = LORA_SCOPE

    @property
    def first_fit(self) -> FinetuneOption | None:
        """The least sharding, then the least recompute, that fits."""
        return next((o for o in self.options if o.fits), None)

    @property
    def hours(self) -> float:
        """Hours to fine-tune on `tokens` tokens at the planner's throughput."""
        return self.inputs["tokens"] / self.estimate.tokens_per_second / 3600

    def option(self, zero_stage: int, recompute: str = "none") -> FinetuneOption:
        for o in self.options:
            if (o.zero_stage, o.recompute) == (zero_stage, recompute):
                return o
        raise ValueError(f"no option zero_stage={zero_stage!r}, recompute={recompute!r}; "
                         f"allowed: zero_stage 0-3, recompute {memory.RECOMPUTE}")

    def table(self) -> str:
        lines = [f"{'ZeRO':>4} {'recompute':>9} {'states GB':>9} {'activ. GB':>9} "
                 f"{'total GB':>8}  fits"]
        for o in self.options:
            lines.append(f"{o.zero_stage:>4} {o.recompute:>9} {o.model_states / GB:>9.1f} "
                         f"{o.activations / GB:>9.1f} {o.total / GB:>8.1f}  "
                         f"{'yes' if o.fits else 'no'}")
        return "\n".join(lines)


def finetune_run(model="llama3-8b", gpus=8, gpu="h100-sxm", *, seq_len=8192, micro_batch=1,
                 global_batch=64, tokens=1e9, matmul_efficiency=None,
                 gpus_per_node=8) -> FinetuneCase:
    """Full fine-tuning of `model` on `gpus` x `gpu` (bf16-mixed AdamW): the memory per GPU of
    data parallelism over all the GPUs at each ZeRO stage (0: DDP, 3: FSDP) and recompute mode,
    micro-batches of `micro_batch` sequences of `seq_len`; and the planner's fastest layout for
    `global_batch` sequences a step, with the hours `tokens` (the fine-tuning set) take.

    Memory from `labkit.memory.estimate_memory`. LoRA is out of scope: labkit's memory model
    has no frozen-weight policy, so it cannot cost adapters honestly (`LORA_SCOPE`)."""
    spec = get_model(model)
    g = validate.positive_int("gpus", gpus, validate.MAX_RANKS)
    t = validate.positive("tokens", tokens, 1e18)
    capacity = get_gpu(gpu).memory
    matmul_efficiency = _efficiency(matmul_efficiency, gpu)
    options = []
    for stage in memory.ZERO_STAGES:
        for rc in memory.RECOMPUTE:
            m = memory.estimate_memory(spec, batch_size=micro_batch, seq_len=seq_len,
                                       zero_stage=stage, dp=g, recompute=rc)
            options.append(FinetuneOption(stage, rc, m.model_states, m.activations, capacity))
    p = plan(spec, g, gpu=gpu, gpus_per_node=gpus_per_node, global_batch=global_batch,
             seq_len=seq_len, mfu=matmul_efficiency, min_cp_tokens=seq_len)
    if p.best is None:
        raise ValueError(f"no layout of {spec.name} fits on {g} x {gpu}: {p.why()}")
    inputs = dict(model=spec.name, gpus=g, gpu=gpu, seq_len=seq_len, micro_batch=micro_batch,
                  global_batch=global_batch, tokens=t, matmul_efficiency=matmul_efficiency)
    return FinetuneCase(inputs, spec.num_params(), options, p.best)


# ---- long context --------------------------------------------------------------------------------

@dataclass(frozen=True)
class CPRow:
    cp: int
    gpus: int                        # tp x cp (one sequence)
    activations: float               # bytes per GPU (estimate_memory)
    estimate: Estimate               # the planner's price of this layout

    @property
    def memory(self) -> float:
        return self.estimate.memory

    @property
    def fits(self) -> bool:
        return self.estimate.fits


@dataclass
class LongContextCase:
    inputs: dict
    rows: list = field(default_factory=list)      # CPRow for each CP degree tried
    attention_share: float = 0.0                  # of the model FLOPs per token at seq_len
    hop_bytes: float = 0.0                        # K and V blocks one rank sends per ring hop
    hop_seconds: float = 0.0                      # that send over the CP group's link
    hop_compute: float = 0.0                      # the attention it hides behind (one block)
    link: str = ""
    sends_per_step: int = 0
    min_tokens_per_rank: float = 0.0              # below this, a hop takes longer than its block

    @property
    def needed(self) -> CPRow | None:
        """The smallest CP degree that fits."""
        return next((r for r in self.rows if r.fits), None)

    @property
    def hidden(self) -> bool:
        return self.hop_seconds <= self.hop_compute

    def table(self) -> str:
        lines = [f"{'cp':>4} {'GPUs':>5} {'activ. GB':>9} {'total GB':>8} {'step s':>8}  fits"]
        for r in self.rows:
            lines.append(f"{r.cp:>4} {r.gpus:>5} {r.activations / GB:>9.1f} "
                         f"{r.memory / GB:>8.1f} {r.estimate.step_time:>8.1f}  "
                         f"{'yes' if r.fits else 'no'}")
        return "\n".join(lines)


def long_context_run(model="llama3-8b", seq_len=2**20, gpu="h100-sxm", *, tp=8,
                     recompute="full", max_cp=64, matmul_efficiency=None,
                     gpus_per_node=8) -> LongContextCase:
    """One sequence of `seq_len` tokens (default 2**20, "1M": every power-of-two CP degree
    divides it): for cp = 1, 2, 4, ... up to max_cp (dividing seq_len, tp | seq_len / cp), the
    memory per GPU of tp x cp GPUs (tensor + sequence parallel inside a node, FSDP over the CP
    ranks, `recompute`), priced by `labkit.planner.evaluate`; ring attention at the smallest CP
    degree that fits: the K/V block each hop sends, its time on the CP group's link, and the
    attention of one block it hides behind (4 x q_size x (s/cp)^2 / tp FLOPs at
    matmul_efficiency of the peak)."""
    spec = get_model(model)
    s = validate.positive_int("seq_len", seq_len, validate.MAX_SEQ_LEN)
    t = validate.positive_int("tp", tp, validate.MAX_RANKS)
    top = validate.positive_int("max_cp", max_cp, validate.MAX_RANKS)
    validate.choice("recompute", recompute, memory.RECOMPUTE)
    eff = _efficiency(matmul_efficiency, gpu)
    the_gpu = get_gpu(gpu)
    degrees = [c for c in (2**k for k in range(int(math.log2(top)) + 1))
               if s % c == 0 and (s // c) % t == 0]
    if not degrees:
        raise ValueError(f"tp={t} does not divide seq_len={s:,}; allowed: a tp dividing it")
    case = LongContextCase(dict(model=spec.name, seq_len=s, gpu=gpu, tp=t, recompute=recompute,
                                matmul_efficiency=eff, gpus_per_node=gpus_per_node))
    for c in degrees:
        lay = Layout(tp=t, cp=c, dp=1, sharding="fsdp", recompute=recompute,
                     sequence_parallel=t > 1)
        est = evaluate(spec, lay, gpu=gpu, gpus_per_node=gpus_per_node, global_batch=1,
                       seq_len=s, mfu=eff)
        act = memory.estimate_memory(spec, seq_len=s, tp=t, cp=c, dp=c, zero_stage=3,
                                     sequence_parallel=t > 1, recompute=recompute).activations
        case.rows.append(CPRow(c, t * c, act, est))
    case.attention_share = (3 * flops.attention_flops_per_token(spec, s)
                            / flops.flops_per_token(spec, s))
    need = case.needed
    if need is None or need.cp == 1:
        return case
    c = need.cp
    ring = step_communication("cp", spec, tp=t, cp=c, seq_len=s, recompute=recompute)
    hop = ring.collectives[0]
    link = next(k for k in LINKS.values() if k.name == need.estimate.links["cp"])
    case.link, case.hop_bytes, case.sends_per_step = link.name, hop.nbytes, hop.count
    case.hop_seconds = collective_time("send_recv", hop.nbytes, 2, link.bandwidth, link.latency)
    per_layer_token = flops.attention_flops_per_token(spec, s) / spec.num_layers   # 4 q s
    block = per_layer_token / c * (s // c) / t          # s/c queries against s/c keys, / tp
    case.hop_compute = block / (the_gpu.flops("bf16") * eff)
    # the send grows with s/c, the block's attention with (s/c)^2: equal at this many tokens
    case.min_tokens_per_rank = (s // c) * (hop.nbytes / link.bandwidth) / case.hop_compute
    return case
