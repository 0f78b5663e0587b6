"""FSDP lab: FSDP2 `fully_shard` on a transformers model, measured beside its predictions.

    torchrun --nproc-per-node 4 -m labkit.labs.fsdp                     # --part compare
    labkit run fsdp -n 4 -- --part timeline                            # one step, unit by unit
    labkit run fsdp -n 4 -- --part options --model gpt2                # every option, measured
    labkit run fsdp -n 2 -- --part fsdp1                               # FSDP1 beside FSDP2
    labkit bench fsdp                                                  # step time per option

Parts: build.py, check.py, exercise.py, lab.py, options.py, timeline.py.
"""
from labkit.labs.fsdp.lab import main, parse_args, tied

__all__ = ['main', 'parse_args', 'tied']
