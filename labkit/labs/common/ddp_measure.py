"""What the DDP lab (labkit.labs.ddp --part compare) measures with and predicts from: the
timeline of one step (when each gradient was ready, when each all-reduce was issued and
completed), this run's all-reduce fitted to the ring model, and the step time
`labkit.scaling.ddp_step_time` predicts from them.
"""
from __future__ import annotations

import sys
import time

import torch
import torch.distributed as tdist
from torch.utils._python_dispatch import TorchDispatchMode

from labkit.labs.common.training import barrier, median, synchronize


# ---------------------------------------------------------------------------------------------
# the timeline of one step

class _AllReduceTimes(TorchDispatchMode):
    """Records each all-reduce the dispatcher sees (torch DDP's reducer and the references'
    dist.all_reduce alike): [issued, completed, bytes]; completion comes from the work's future,
    so an async all-reduce is timed when it finished, not when someone waited for it."""

    def __init__(self, now, sink):
        super().__init__()
        self.now, self.sink = now, sink

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        start = self.now()
        out = func(*args, **(kwargs or {}))
        name = func._schema.name
        if name in ("c10d::allreduce_", "c10d::allreduce_coalesced_"):
            event = [start, None, sum(t.numel() * t.element_size() for t in args[0])]
            self.sink.append(event)
            work = torch._C._distributed_c10d.Work.unbox(out[1])
            if work is not None:       # else (seen: NCCL, torch 2.11) completed = sync_end
                work.get_future().add_done_callback(
                    lambda _f, e=event: e.__setitem__(1, self.now()))
        return out


class Timeline:
    """`with Timeline(module) as tl: train_step(..., mark=tl.mark)`; then `tl.events` (the
    format `labkit.plots.timeline` documents).

    A completion is timed by a Python callback on the communication thread, which needs the
    GIL: while the main thread runs Python (a hook, the optimizer) the callback waits for the
    interpreter to switch threads (inside the block every 10 us instead of Python's 5 ms), and
    a waiter wakes before the callbacks run. So a completion time is at most "sync_end" (when
    the step had every gradient averaged, each wait returned): a later callback is clamped
    to it (seen: torch DDP's last bucket, by up to ~1 ms on 2 busy cores). On CUDA (NCCL) the
    times are the host's: kernels and their futures run ahead of the GPU, so there the picture
    shows when work was queued, not when the GPU did it (use torch.profiler for that)."""

    SWITCH_INTERVAL = 1e-5

    def __init__(self, module):
        self.module = module

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def mark(self, key: str) -> None:
        self.events[key] = self.now()

    def __enter__(self):
        self.events = {"grads": [], "allreduce": []}
        grads = self.events["grads"]
        self._hooks = [p.register_post_accumulate_grad_hook(
            lambda _p, n=name: grads.append([n, self.now()]))
            for name, p in self.module.named_parameters() if p.requires_grad]
        self._mode = _AllReduceTimes(self.now, self.events["allreduce"])
        self._interval = sys.getswitchinterval()
        sys.setswitchinterval(self.SWITCH_INTERVAL)
        self.t0 = time.perf_counter()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        self._mode.__exit__(*exc)
        sys.setswitchinterval(self._interval)
        for h in self._hooks:
            h.remove()
        deadline = time.monotonic() + 1     # a future's callback may run just after the wait
        while any(e[1] is None for e in self.events["allreduce"]) and time.monotonic() < deadline:
            time.sleep(0.001)
        done = self.events.get("sync_end")
        if done is not None:
            for e in self.events["allreduce"]:
                e[1] = done if e[1] is None else min(e[1], done)
        return False


# ---------------------------------------------------------------------------------------------
# the prediction

def calibrate(ctx, nbytes: int, iters: int = 5) -> dict:
    """This run's all-reduce as the ring model sees it: latency and per-direction bandwidth
    fitted (labkit.labs.collectives) to the median time of `iters` all-reduces of 1 KiB,
    nbytes / 4 and nbytes (the slowest rank's; every rank gets the same figures)."""
    from labkit.labs.common.wire import fit_alpha_beta, model_parameters

    sizes = [1024, max(2048, nbytes // 16 * 4), max(4096, nbytes // 4 * 4)]
    times = []
    for size in sizes:
        x = torch.zeros(size // 4, device=ctx.device)
        samples = []
        for _ in range(iters):
            barrier(ctx)
            t = time.perf_counter()
            tdist.all_reduce(x)
            synchronize(ctx.device)
            samples.append(time.perf_counter() - t)
        times.append(median(samples))
    slowest = torch.tensor(times, dtype=torch.float64)
    tdist.all_reduce(slowest, op=tdist.ReduceOp.MAX)
    fit = fit_alpha_beta(sizes, slowest.tolist())
    m = model_parameters("all_reduce", ctx.world_size, fit)
    return dict(name="measured", sizes=sizes, times=slowest.tolist(),
                latency=max(m["latency"], 0.0), bandwidth=m["bandwidth"])


def link_figures(args, ctx, nbytes: int) -> dict:
    """--link: 'measured' (calibrate) or a labkit.hardware.LINKS entry's figures."""
    from labkit.hardware import LINKS

    if args.link == "measured" and ctx.world_size > 1:
        fit = calibrate(ctx, nbytes)
        if 0 < fit["bandwidth"] < float("inf"):
            return fit
    name = "loopback" if args.link == "measured" else args.link     # one rank: nothing to fit
    return dict(name=name, latency=LINKS[name].latency, bandwidth=LINKS[name].bandwidth)


def predicted_step(kind: str, n_params: int, calls: int, compute: float, link: dict, args,
                   world: int) -> float:
    """labkit.scaling.ddp_step_time for this implementation, from the measured compute step:
    overlap 0 for naive, 1 for the others; naive's and overlapped's per-tensor all-reduces as
    that many equal buckets."""
    from labkit.scaling import MiB, ddp_step_time

    if kind == "local" or world == 1:
        return compute
    per_call_mb = 4 * n_params / max(calls, 1) / MiB
    mb = args.bucket_mb if kind in ("bucketed", "torch") else per_call_mb
    return ddp_step_time(n_params, world, None, compute_seconds=compute, grad_bytes=4,
                         bucket_size_mb=mb, overlap=0.0 if kind == "naive" else 1.0,
                         bandwidth=link["bandwidth"], latency=link["latency"]).total
