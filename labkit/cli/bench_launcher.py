"""Launcher overhead: a 4-rank lab from the warm pool (cold and warm) vs torchrun, with ratios.

    labkit bench launcher [--nproc 4] [--repeat 3] [--no-transformers] [--no-nodes]

Median of --repeat, from the call to the result: hello from the cold pool (its `import torch`
included), the warm pool, run_lab(launcher="torchrun"), bare torchrun; hello across two nodes
simulated on loopback (two `labkit run --nnodes 2` commands, --nproc/2 ranks each); a
transformers lab (labkit.labs.memory) from the warm pool and via torchrun. Targets on a 2-core
laptop (issue 12): warm hello <= 1.0 s, cold pool no slower than torchrun, warm transformers
lab <= 2 s. Other work on the cores adds noise: read the ratios.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

HELLO = "labkit.labs.hello"
HF_LAB = "labkit.labs.memory"


def _direct(nproc: int) -> float:
    with tempfile.TemporaryDirectory(prefix="labkit-bench-") as logs:   # torchrun's log dir
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
               "--nproc-per-node", str(nproc), "--rdzv-backend", "c10d",
               "--rdzv-endpoint", "127.0.0.1:0", "--log-dir", logs, "-m", HELLO]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        t = time.monotonic()
        subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL)
        return time.monotonic() - t


def _run(lab: str, nproc: int, launcher: str) -> float:
    from labkit.runtime.launch import run_lab
    t = time.monotonic()
    result = run_lab(lab, nproc=nproc, timeout=300, quiet=True, launcher=launcher)
    elapsed = time.monotonic() - t
    assert result.ok and result.launcher == launcher, result
    if lab == HELLO:
        assert all(r["all_reduce"] == r["expected"] for r in result.results), result.results
    return elapsed


def _two_nodes(nproc: int) -> tuple[float, float]:
    """Seconds each of two `labkit run` commands takes for hello across two nodes simulated on
    loopback (node 1 at 127.0.0.2), both started at once, as the README's commands."""
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    base = [sys.executable, "-m", "labkit", "run", "hello", "-n", str(nproc), "--nnodes", "2",
            "--rdzv-endpoint", f"127.0.0.1:{port}", "--timeout", "120", "--node-rank"]
    t = time.monotonic()
    procs = [subprocess.Popen(base + ["0"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE),
             subprocess.Popen(base + ["1", "--local-addr", "127.0.0.2"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)]
    times = []
    for proc in procs:
        _, err = proc.communicate(timeout=300)
        times.append(time.monotonic() - t)
        if proc.returncode != 0:
            raise RuntimeError(f"two-node hello failed: {err.decode()[-2000:]}")
    return times[0], times[1]


def _median(xs: list[float]) -> str:
    return f"{statistics.median(xs):6.2f} s   (runs: {', '.join(f'{x:.2f}' for x in xs)})"


def main(argv: list[str] | None = None) -> int:
    from labkit.runtime import pool

    parser = argparse.ArgumentParser(prog="labkit bench launcher", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=4, help="ranks (default 4)")
    parser.add_argument("--repeat", type=int, default=3, help="runs of each (default 3)")
    parser.add_argument("--no-transformers", action="store_true",
                        help="skip the transformers lab")
    parser.add_argument("--no-nodes", action="store_true",
                        help="skip the two-node run on loopback")
    args = parser.parse_args(argv or [])
    if not pool.supported():
        print(f"the warm pool needs Linux; this is {sys.platform}")
        return 0
    n = args.nproc
    _direct(n)                   # warm the page cache so that no side pays for it
    cold, warm, via, direct = [], [], [], []
    for _ in range(args.repeat):
        pool.shutdown()
        cold.append(_run(HELLO, n, "pool"))
        warm.append(_run(HELLO, n, "pool"))
        via.append(_run(HELLO, n, "torchrun"))
        direct.append(_direct(n))
    warm += [_run(HELLO, n, "pool") for _ in range(args.repeat)]
    m = {k: statistics.median(v) for k, v in
         dict(cold=cold, warm=warm, via=via, direct=direct).items()}
    print(f"hello lab, {n} ranks, {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}, "
          f"median of {args.repeat} (warm: {len(warm)}):")
    print(f"  pool, cold (starts it)         {_median(cold)}")
    print(f"  pool, warm                     {_median(warm)}")
    print(f"  run_lab(launcher='torchrun')   {_median(via)}")
    print(f"  torchrun directly              {_median(direct)}")
    print(f"  ratio warm pool / torchrun     {m['warm'] / m['direct']:6.3f}")
    print(f"  ratio cold pool / torchrun     {m['cold'] / m['direct']:6.3f}   (target <= 1)")
    print(f"  warm target <= 1.0 s:          {'met' if m['warm'] <= 1.0 else 'not met'}")
    if not args.no_nodes:
        half = max(1, n // 2)
        pairs = [_two_nodes(half) for _ in range(args.repeat)]
        slowest = [max(p) for p in pairs]
        print(f"hello across 2 nodes on loopback (labkit run --nnodes 2, {half} ranks each; "
              "each node its own command):")
        print(f"  node 0                         {_median([p[0] for p in pairs])}")
        print(f"  node 1 (--local-addr 127.0.0.2){_median([p[1] for p in pairs])}")
        print(f"  ratio to {n} ranks on one node   "
              f"{statistics.median(slowest) / m['via']:6.3f}   (run_lab via torchrun)")
    if not args.no_transformers:
        _run(HF_LAB, n, "pool")                  # the lab imports transformers ...
        pool.current().sync()                    # ... so the pool does too: wait for it
        hf_warm = [_run(HF_LAB, n, "pool") for _ in range(args.repeat)]
        hf_torchrun = [_run(HF_LAB, n, "torchrun") for _ in range(args.repeat)]
        ratio = statistics.median(hf_warm) / statistics.median(hf_torchrun)
        print(f"{HF_LAB} (transformers' GPT-2 from a config, 3 steps), {n} ranks:")
        print(f"  pool, warm (transformers in)   {_median(hf_warm)}")
        print(f"  run_lab(launcher='torchrun')   {_median(hf_torchrun)}")
        print(f"  ratio warm pool / torchrun     {ratio:6.3f}")
        print(f"  warm target <= 2 s:            "
              f"{'met' if statistics.median(hf_warm) <= 2 else 'not met'}")
    return 0
