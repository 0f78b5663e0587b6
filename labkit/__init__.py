"""labkit: the package the Distributed Training Lab stands on.

Layers, from pure to impure. A lower layer never imports a higher one (tests/test_layers.py):

1. cost models, pure Python, no torch at import: `models`, `hardware`, `memory`, `flops`, `comm`,
   `pipeline`, `validate` (top level: the names learners type, `from labkit.memory import ...`)
2. views: `plots/` (matplotlib figures), `widgets/` (ipywidgets calculators)
3. runtime: `runtime/` (launcher, what runs inside a rank, measurement)
4. parallelism by hand: `parallel/` (reference implementations that run inside ranks)
5. labs: `labs/` (`python -m labkit.labs.X`)
6. course machinery: `course/` (grading, exercise generator, course map, doctor)
7. the `labkit` command: `cli/`

`from labkit import run_lab, LabError` works without importing torch until it is called.
"""

__version__ = "0.2.0"

# Names re-exported lazily (PEP 562), so `import labkit` stays free of torch.
_LAZY = {"run_lab": "labkit.runtime.launch", "LabError": "labkit.runtime.launch",
         "LabResult": "labkit.runtime.launch"}

__all__ = ["run_lab", "LabError", "LabResult", "__version__"]


def __getattr__(name):
    import importlib
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    module = importlib.import_module("labkit._moved").resolve(name) if name != "_moved" else None
    if module is not None:
        return module
    raise AttributeError(f"module 'labkit' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + list(_LAZY))


def load_ipython_extension(ipython):
    """`%load_ext labkit` registers the %%torchrun cell magic (imports IPython/torch lazily)."""
    from labkit.runtime.magic import load_ipython_extension as load

    load(ipython)


import labkit._moved  # noqa: E402  (old module paths, one release; see _moved.py)

labkit._moved.install()
