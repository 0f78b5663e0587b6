"""Reports what a rank sees of its process (tests/test_pool.py): the torchrun variables, its
working directory and sys.path[0], a random number, torch's thread count, whether a previous
lab's state leaked in, a module it imports (--import NAME; its VALUE if it has one), and
writes --atexit PATH from an exit handler."""
import argparse
import atexit
import importlib
import os
import random
import sys

import torch

from labkit.runtime import dist

TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                 "GROUP_WORLD_SIZE", "ROLE_NAME", "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR",
                 "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT",
                 "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_USE_AGENT_STORE",
                 "TORCHELASTIC_ERROR_FILE", "TORCH_NCCL_ASYNC_ERROR_HANDLING", "OMP_NUM_THREADS")



def np_random():
    import numpy
    return numpy.random.random()


parser = argparse.ArgumentParser()
parser.add_argument("--import", dest="module", default=None)
parser.add_argument("--atexit", default=None)
parser.add_argument("--leak", action="store_true", help="leave a mark on torch for the next lab")
args = parser.parse_args()

imported = None
if args.module:
    was_loaded = args.module in sys.modules
    mod = importlib.import_module(args.module)
    imported = {"was_loaded": was_loaded, "value": getattr(mod, "VALUE", None)}
if args.atexit:
    path = f"{args.atexit}.{os.environ['RANK']}"
    atexit.register(lambda: open(path, "w").write("bye"))
with open("/proc/self/environ", "rb") as f:
    visible = [e.decode(errors="replace") for e in f.read().split(b"\0") if e]
leaked = hasattr(torch, "_labkit_test_leak")
if args.leak:
    torch._labkit_test_leak = True
dist.report(vars={k: os.environ.get(k) for k in TORCHRUN_VARS}, cwd=os.getcwd(),
            path=sys.path[:2], random=[random.random(), np_random()], threads=torch.get_num_threads(),
            leaked=leaked, imported=imported, launcher=dist.launcher(), pid=os.getpid(),
            ppid=os.getppid(), visible_run_id=any(e.startswith("LABKIT_RUN_ID=") for e in visible),
            cuda_initialised=torch.cuda.is_initialized())
