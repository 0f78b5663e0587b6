"""labkit: the package the Distributed Training Lab stands on.

Layers, from pure to impure (a lower layer never imports a higher one):

1. cost models (no torch at import): models, hardware, memory, flops, comm, pipeline, planner
2. views: plots, widgets
3. distributed runtime: launch, dist, measure, labs.*
4. course machinery: grading, cli, doctor
"""

__version__ = "0.1.0"


def load_ipython_extension(ipython):
    """`%load_ext labkit` registers the %%torchrun cell magic (imports IPython/torch lazily)."""
    from labkit.magic import load_ipython_extension as load

    load(ipython)
