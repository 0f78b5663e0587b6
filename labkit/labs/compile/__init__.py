"""Compile lab: torch.compile with DDP and FSDP2 on a small transformers Llama, on gloo ranks.

    labkit run compile -n 2 -- --part ddp        # eager DDP vs torch.compile(ddp_model)
    labkit run compile -n 2 -- --part fsdp       # eager FSDP2 vs compile each block, then shard
    labkit run compile -n 2 -- --part order      # the wrong orders and recompiles, as data

Parts: lab.py (flags, printing), parts.py (ddp, fsdp), order.py, tools.py (backend choice,
dynamo's counters, the timed loop).
"""
from labkit.labs.compile.lab import main, parse_args

__all__ = ['main', 'parse_args']
