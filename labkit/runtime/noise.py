"""Warnings from torch and transformers that say nothing to a learner, silenced one at a time.

    with noise.ignoring(noise.PAST_KEY_VALUES):
        schedule.step(...)

Each entry is a category and a message pattern; `ignoring` filters only those, only inside the
`with`. The warnings a lesson explains (DDP's find_unused_parameters, module 03) are not here.
"""
from __future__ import annotations

import contextlib
import warnings

# transformers 5 renamed create_causal_mask's `past_key_values` to `cache`; labkit.parallel's
# pipeline stages pass None (training keeps no cache), so nothing changes for the labs.
PAST_KEY_VALUES = (FutureWarning, r"`past_key_values` is deprecated")
# FSDP2 warns when the wrapped root returns a view (a Llama's logits, a last pipeline stage's):
# an in-place op on it would skip the all-gather. The labs take the loss out of place.
FSDP2_VIEW = (UserWarning, r"FSDP2-wrapped module \(\w+\) returned a view tensor")
# torch 2.13 deprecates `isinstance(spec, LeafSpec)`, which its own pipeline() tracer still does
# while it copies the traced program (torch.distributed.pipelining._IR).
LEAF_SPEC = (FutureWarning, r"`isinstance\(treespec, LeafSpec\)` is deprecated")


@contextlib.contextmanager
def ignoring(*known: tuple[type[Warning], str]):
    """Ignore the `known` warnings (category, message regex) inside the `with`; every other
    warning is shown as before. Not thread-safe (warnings filters are global): use it around a
    call on the thread that makes the call."""
    with warnings.catch_warnings():
        for category, message in known:
            warnings.filterwarnings("ignore", message=message, category=category)
        yield
