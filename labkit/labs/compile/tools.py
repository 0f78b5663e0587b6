"""What the compile lab's parts share: which backend can run here (`choose_backend`: inductor
needs a C++ compiler), a backend that counts the graphs it is handed (`Counting`), dynamo's
counters read after a run (`dynamo_stats`), and the timed training loop (`train`).

Dynamo's own counts (torch 2.13): counters["stats"]["unique_graphs"] (graphs dynamo traced),
counters["graph_break"] ({reason: count}), torch._dynamo.utils.get_compilation_metrics() (one
entry per frame compile: recompile_reason set on a recompilation, fail_type on a refused one),
counters["inductor"]["fxgraph_cache_hit"/"_miss"] (the FX graph cache).
"""
from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
import sys
import time

import torch

BACKENDS = ("inductor", "aot_eager", "eager")


def find_cxx(names=None) -> str | None:
    """The C++ compiler inductor would build its CPU kernels with (torch._inductor.config.cpp.cxx,
    from $CXX, else g++; clang++ on macOS), or None when none answers `--version`."""
    import torch._inductor.config as ic

    if names is None:
        names = ("cl",) if sys.platform == "win32" else ic.cpp.cxx
    for name in (names if isinstance(names, (list, tuple)) else (names,)):
        path = shutil.which(name) if name else None
        if path is None:
            continue
        try:     # macOS ships /usr/bin/g++ stubs that fail without the command line tools
            if subprocess.run([path, "--version"], capture_output=True, timeout=30,
                              stdin=subprocess.DEVNULL).returncode == 0:
                return path
        except (OSError, subprocess.SubprocessError):
            continue
    return None


def how_to_get_cxx() -> str:
    if sys.platform == "darwin":
        return "install Xcode's command line tools: xcode-select --install"
    if sys.platform == "win32":
        return "install Visual Studio Build Tools (C++), then run from a Developer prompt"
    return "install g++ (sudo apt install g++, or conda install -c conda-forge gxx) or clang++"


def choose_backend(wanted: str, cxx: str | None) -> tuple[str, str | None, str | None]:
    """(backend to use, C++ compiler path, note): inductor without a C++ compiler, or with one
    that fails on a one-line probe, falls back to aot_eager (the same AOTAutograd graphs, run op
    by op) with a note saying what to install.
    `cxx`: a compiler name to use instead of inductor's default (the --cxx flag)."""
    import torch._inductor.config as ic

    if wanted != "inductor":
        return wanted, None, None
    if "TORCHINDUCTOR_COMPILE_THREADS" not in os.environ:
        ic.compile_threads = 1   # a pool of compile workers costs more than it saves on 2 cores
    if cxx:
        ic.cpp.cxx = (None, cxx)
    path = find_cxx(cxx)
    if path is None:
        looked = cxx or ", ".join(n for n in ic.cpp.cxx if n)
        return "aot_eager", None, (
            f"inductor needs a C++ compiler to build its CPU kernels and none was found "
            f"(looked for: {looked}); to use it, {how_to_get_cxx()}. Falling back to "
            f"--backend aot_eager: the same graphs, run by eager kernels.")
    try:     # a compiler found may still fail to build inductor's kernels (macOS: no OpenMP)
        torch.compile(lambda x: x.sin() + 1, backend="inductor")(torch.ones(8))
    except Exception as exc:          # noqa: BLE001 (reported, and the lab goes on)
        extra = "; macOS: also brew install libomp" if sys.platform == "darwin" else ""
        return "aot_eager", path, (
            f"inductor could not build a kernel with {path} ({type(exc).__name__}: "
            f"{first_line(exc, 120)}); {how_to_get_cxx()}{extra}. Falling back to "
            f"--backend aot_eager: the same graphs, run by eager kernels.")
    finally:
        reset()
    return "inductor", path, None


class Counting:
    """A torch.compile backend that records each graph it is handed (under DDP, DDPOptimizer
    hands it one subgraph per bucket: nodes and parameter bytes of each) and passes it on to
    the named backend."""

    def __init__(self, backend: str):
        self.backend, self.graphs = backend, []

    def __call__(self, gm, example_inputs):
        from torch._dynamo import lookup_backend

        params = [x for x in example_inputs if isinstance(x, torch.nn.Parameter)]
        self.graphs.append(dict(nodes=len(gm.graph.nodes), params=len(params),
                                param_bytes=sum(p.numel() * p.element_size() for p in params)))
        return lookup_backend(self.backend)(gm, example_inputs)


def reset() -> None:
    """Forget every compiled graph, counter and guard failure (each run starts cold)."""
    import torch._dynamo
    from torch._dynamo.utils import clear_compilation_metrics, counters, guard_failures

    torch._dynamo.reset()
    counters.clear()
    guard_failures.clear()
    clear_compilation_metrics()


def first_line(text: str, n: int = 160) -> str:
    line = str(text).strip().splitlines()[0] if str(text).strip() else ""
    return line if len(line) <= n else line[:n - 3] + "..."


def break_reason(text: str) -> str:
    """A graph break's reason in one line: its first line and the first `name` its
    explanation quotes (dynamo's reasons run to a dozen lines of hints)."""
    named = re.search(r"`([^`]+)`", str(text))
    head = first_line(text, 80)
    return f"{head}: {named.group(1)}" if named and named.group(1) not in head else head


class _DropProfilerNote(logging.Filter):
    def filter(self, record) -> bool:
        return "Profiler record function" not in str(record.msg)


def quiet() -> None:
    """Drop dynamo's note that DDP's record_function is ignored inside a compiled forward (once
    per rank, it reads like a failure; what it says does not change the run)."""
    logging.getLogger("torch._dynamo.variables.ctx_manager").addFilter(_DropProfilerNote())


def dynamo_stats(counting: Counting | None = None) -> dict:
    """Dynamo's counts since the last reset(): graphs traced, graph breaks (total and by
    reason), frames compiled, recompilations (a frame compiled again because a guard failed,
    torch._dynamo.utils.get_compilation_metrics) and compiles refused (the recompile limit hit),
    what the backend was handed, the FX graph cache's hits and misses."""
    from torch._dynamo.utils import counters, get_compilation_metrics

    breaks: dict = {}
    for reason, n in counters["graph_break"].items():
        key = break_reason(reason)
        breaks[key] = breaks.get(key, 0) + n
    metrics = get_compilation_metrics()
    done = [m for m in metrics if not m.fail_type]
    again = [m for m in done if m.recompile_reason]
    refused = [m for m in metrics if m.fail_type]
    return dict(graphs=counters["stats"]["unique_graphs"], breaks=sum(breaks.values()),
                break_reasons=breaks, frames=len(done), recompiles=len(again),
                recompile_reasons=[first_line(m.recompile_reason.split("  # ")[0].rstrip())
                                   for m in again][:4],
                refused=len(refused),
                refused_reasons=[first_line(m.fail_reason or m.fail_type) for m in refused][:2],
                backend_graphs=len(counting.graphs) if counting else None,
                subgraphs=list(counting.graphs) if counting else None,
                cache_hits=counters["inductor"]["fxgraph_cache_hit"],
                cache_misses=counters["inductor"]["fxgraph_cache_miss"])


def train(model, opt, batches, ctx, counting: Counting | None = None, loss_of=None) -> dict:
    """One training step per batch: losses, each step's seconds (the first, compile included,
    apart; median and spread of the others) and the graphs the backend got during each step.
    loss_of(model, batch): the loss (default model(batch))."""
    from labkit.labs.common.training import barrier, median

    losses, secs, new = [], [], []
    for ids in batches:
        barrier(ctx)
        before = len(counting.graphs) if counting else 0
        t = time.perf_counter()
        loss = loss_of(model, ids) if loss_of else model(ids)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        secs.append(time.perf_counter() - t)
        new.append(len(counting.graphs) - before if counting else 0)
    rest = secs[1:]
    return dict(losses=losses, secs=secs, new_graphs=new, first_s=secs[0], step_s=median(rest),
                step_min_s=min(rest, default=float("nan")),
                step_max_s=max(rest, default=float("nan")))


def inductor_env() -> dict:
    """Where inductor keeps its FX graph cache, and whether it is on."""
    import torch._inductor.config as ic
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return dict(fx_graph_cache=bool(ic.fx_graph_cache), cache_dir=cache_dir(),
                cache_dir_env=os.environ.get("TORCHINDUCTOR_CACHE_DIR"))
