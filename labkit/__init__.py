"""labkit: the package the Distributed Training Lab stands on.

Layers, from pure to impure; a lower layer never imports a higher one (tests/test_layers.py):
1 cost models (`models`, `memory`, `flops`, `comm`, `pipeline`, ...: pure Python, no torch at
import), 2 views (`plots/`, `widgets/`), 3 `runtime/`, 4 `parallel/` (by hand, inside ranks),
5 `labs/` (`python -m labkit.labs.X`), 6 `course/` (grading, exercises, doctor), 7 `cli/`.
docs/labkit.md has the table; docs/runtime.md the runtime, course, command line and views.

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
    raise AttributeError(f"module 'labkit' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + list(_LAZY))


def load_ipython_extension(ipython):
    """`%load_ext labkit` registers the %%torchrun cell magic (imports IPython/torch lazily)."""
    from labkit.runtime.magic import load_ipython_extension as load

    load(ipython)
