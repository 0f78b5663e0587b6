"""CPU offload priced per training step: what one GPU moves over its host link, how long that
takes, and how much of it the forward and backward can hide.

    >>> c = offload_cost("llama2-7b", "optimizer", zero_stage=2, dp=8, compute_seconds=1.0)
    >>> c.transfer, c.exposed, c.step          # seconds: on the link, not hidden, whole step
    >>> offload_cost(7e9, "params", zero_stage=3, dp=8, microbatches=4, link="pcie4").table()

The bytes come from `labkit.placement.offload_traffic`; this module adds the time and the
overlap (`offload_cost`: ZeRO-Offload, Ren et al. 2021, arXiv:2101.06840, §4.1; DeepSpeed's
`offload_optimizer` / `offload_param`; FSDP2's `CPUOffloadPolicy`). Pure Python, no torch.
"""
from __future__ import annotations

from dataclasses import dataclass

from labkit import validate
from labkit.placement import OffloadTraffic, offload_traffic
from labkit.scaling import BACKWARD_FRACTION, MAX_STEP_SECONDS, compute_time

OFFLOAD_MODES = ("optimizer", "params")


@dataclass
class OffloadCost:
    """One GPU's step under CPU offload: bytes over the host link (`traffic`), seconds on it
    (`up`, `down`, `transfer`), the part the compute hides and the rest (`exposed`)."""

    offload: str
    zero_stage: int
    traffic: OffloadTraffic
    compute: float          # seconds of forward + backward
    overlap: float          # share of the compute (optimizer: of the backward) copies run beside
    cpu_step: float         # seconds of the optimizer step on the CPU (given, not modelled)

    @property
    def up(self) -> float:
        """Seconds of host-to-device copies (weights)."""
        return self.traffic.host_to_device / self.traffic.link.bandwidth

    @property
    def down(self) -> float:
        """Seconds of device-to-host copies (gradients)."""
        return self.traffic.device_to_host / self.traffic.link.bandwidth

    @property
    def backward(self) -> float:
        return BACKWARD_FRACTION * self.compute

    @property
    def transfer(self) -> float:
        """Seconds the link is busy: up then down for "optimizer" (the weights wait for the step
        the gradients feed), both at once for "params" (full duplex)."""
        return self.up + self.down if self.offload == "optimizer" else max(self.up, self.down)

    @property
    def hidden(self) -> float:
        """Seconds of copies that run beside the compute."""
        if self.offload == "optimizer":
            return min(self.down, self.overlap * self.backward)
        return min(self.transfer, self.overlap * self.compute)

    @property
    def exposed(self) -> float:
        """Seconds the step waits for the host: copies not hidden + the CPU step."""
        return self.transfer - self.hidden + self.cpu_step

    @property
    def step(self) -> float:
        return self.compute + self.exposed

    @property
    def slowdown(self) -> float:
        """step / compute: 1.0 when offload costs nothing."""
        return self.step / self.compute

    def table(self) -> str:
        """A readable summary, one line per quantity."""
        t = self.traffic
        rows = [("host -> GPU (weights)", f"{t.host_to_device / 1e9:,.3f} GB", f"{self.up:,.4f} s"),
                ("GPU -> host (gradients)", f"{t.device_to_host / 1e9:,.3f} GB",
                 f"{self.down:,.4f} s"),
                ("on the link", "", f"{self.transfer:,.4f} s"),
                ("hidden behind compute", "", f"{self.hidden:,.4f} s"),
                ("CPU optimizer step (given)", "", f"{self.cpu_step:,.4f} s"),
                ("exposed", "", f"{self.exposed:,.4f} s"),
                ("step = compute + exposed", "", f"{self.step:,.4f} s")]
        head = f"offload={self.offload!r}, ZeRO-{self.zero_stage}, {t.link.name}: {t.explain}"
        return "\n".join([head] + [f"{a:<28}{b:>12}{c:>14}" for a, b, c in rows])


def offload_cost(model, offload="optimizer", zero_stage=2, dp=1, *, tp=1, pp=1,
                 precision="bf16-mixed", grad_accum="param", microbatches=1, link="pcie5",
                 compute_seconds=None, flops=None, gpu=None, mfu=None, overlap=1.0,
                 cpu_step_seconds=0.0) -> OffloadCost:
    """The host-link cost of one GPU's training step under CPU offload (the model: below).

    model, zero_stage, dp, tp, pp, precision, grad_accum, microbatches, link: as
    `labkit.placement.offload_traffic` (link: a `labkit.hardware.LINKS` key or a Link).
    offload: "optimizer" (needs zero_stage >= 1) or "params" (needs zero_stage = 3).
    compute_seconds, or flops with gpu and mfu: one GPU's forward + backward per step
    (`labkit.scaling.compute_time`). overlap: the share (0 to 1) of the backward ("optimizer") or
    of the compute ("params") the copies may run beside. cpu_step_seconds: the optimizer step on
    the CPU, measured (default 0: only the link is priced).

    The bytes are `offload_traffic`'s (the same placement `labkit.memory.estimate_memory(...,
    offload=...)` counts); this adds the time and the overlap:
    - offload="optimizer" (ZeRO-Offload, Ren et al. 2021, arXiv:2101.06840, its single-GPU
      schedule, §4.1; DeepSpeed `offload_optimizer`): the GPU runs forward and backward, sends
      this rank's gradient shard down to the host, the CPU runs the optimizer step on its
      shard, and the updated 16-bit weight shard comes back up (then the usual ZeRO all-gather
      over dp). Down: the gradient shard, once per step under ZeRO-1, after every micro-batch
      under ZeRO-2/3; up: the weight shard, once. With fp16 weights and gradients that is the
      paper's 2M bytes each way for M parameters (here M/dp per rank). The gradient copy can
      overlap the backward (DeepSpeed: `overlap_comm` with `pin_memory`, "Pinning is required
      for the asynchronous GPU->CPU gradient offload to run as a full-bandwidth DMA that
      overlaps with backward compute", docs/_pages/config-json.md); the weights come up only
      after the CPU step, before the next forward needs them, so their copy is never hidden
      here (the paper's one-step delayed parameter update, which would hide it, is not
      modelled, nor is the CPU step itself: pass its measured seconds as cpu_step_seconds).
      exposed = max(0, down - overlap x backward) + up + cpu_step_seconds.
    - offload="params" (ZeRO-Infinity / DeepSpeed `offload_param`, with the optimizer offloaded
      too; FSDP2 `CPUOffloadPolicy`): weight shards live on the host and are copied up before
      every all-gather (forward and backward of every micro-batch), gradient shards go down
      after every reduce-scatter; the weights stay on the host for the CPU step, so nothing
      else comes up. Both directions stream beside the compute (prefetching,
      `stage3_prefetch_bucket_size`), and PCIe is full duplex: transfer = max(up, down) /
      bandwidth; exposed = max(0, transfer - overlap x compute) + cpu_step_seconds.

    Times are bytes / the link's per-direction bandwidth (`labkit.hardware.LINKS`, PCIe 4.0 x16
    31.5 GB/s, PCIe 5.0 x16 63.0 GB/s); latency is not counted (a few large copies per step).
    The backward is `labkit.scaling.BACKWARD_FRACTION` (2/3) of the compute."""
    validate.choice("offload", offload, OFFLOAD_MODES)
    share = validate.non_negative("overlap", overlap, 1.0)
    cpu = validate.non_negative("cpu_step_seconds", cpu_step_seconds, MAX_STEP_SECONDS)
    compute = compute_time(compute_seconds, flops, gpu, mfu)
    traffic = offload_traffic(model, offload=offload, zero_stage=zero_stage, dp=dp, tp=tp, pp=pp,
                              precision=precision, grad_accum=grad_accum,
                              microbatches=microbatches, link=link)
    return OffloadCost(offload, zero_stage, traffic, compute, share, cpu)
