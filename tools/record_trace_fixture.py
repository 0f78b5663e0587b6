"""Record the real gloo traces that tests/cost/test_trace.py checks labkit.trace against.

    python tools/record_trace_fixture.py     # writes tests/fixtures/traces/gloo-rank{0,1}.json

Two gloo ranks on CPU (torch.multiprocessing.spawn), one thread each, a 256x256 nn.Linear whose
gradients are all-reduced by hand (one all_reduce per parameter) and a DDP-wrapped one (one
bucket, so one all_reduce), profiled with torch.profiler (CPU activity) for 2 active steps after
a wait and a warm-up step (DDP rebuilds its buckets in its first step). Each rank's Chrome trace
is trimmed to its complete ("X") events and thread names, and gets a "labkit" key saying what the
script issued (steps, all_reduce calls per step), so a test can check the trace independently.
Timings differ on every run; the test checks only what holds on any machine.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "traces"
WAIT, WARMUP, ACTIVE = 1, 1, 2
ALL_REDUCES_PER_STEP = 3        # 2 by hand (weight, bias) + 1 DDP bucket


def worker(rank: int, world: int, tmp: str, port: int) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.profiler import ProfilerActivity, profile, schedule

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model, ddp = nn.Linear(256, 256), nn.parallel.DistributedDataParallel(nn.Linear(256, 256))
    opt = torch.optim.SGD([*model.parameters(), *ddp.parameters()], lr=0.01)
    x = torch.randn(32, 256)
    done = lambda prof: prof.export_chrome_trace(os.path.join(tmp, f"rank{rank}.json"))  # noqa: E731
    sched = schedule(wait=WAIT, warmup=WARMUP, active=ACTIVE, repeat=1)
    with profile(activities=[ProfilerActivity.CPU], schedule=sched, on_trace_ready=done) as prof:
        for _ in range(WAIT + WARMUP + ACTIVE):
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            for p in model.parameters():        # the naive way: one all_reduce per parameter
                dist.all_reduce(p.grad)
                p.grad /= world
            ddp(x).pow(2).mean().backward()     # DDP: one bucket, all-reduced during backward
            opt.step()
            prof.step()
    dist.destroy_process_group()


def main() -> int:
    import torch.multiprocessing as mp

    from labkit.labs.common.tracing import dumps, trim

    OUT.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(worker, args=(2, tmp, 29500 + os.getpid() % 1000), nprocs=2)
        for rank in range(2):
            trace = trim(json.loads(Path(tmp, f"rank{rank}.json").read_text()),
                         {"script": "tools/record_trace_fixture.py", "steps": ACTIVE,
                          "all_reduce_per_step": ALL_REDUCES_PER_STEP, "backend": "gloo"})
            path = OUT / f"gloo-rank{rank}.json"
            path.write_text(dumps(trace))
            print(f"{path}: {len(trace['traceEvents'])} events, {path.stat().st_size} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
