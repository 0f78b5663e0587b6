"""The distributed runtime (layer 3): starting labs and what runs inside a rank.

- `launch`: `run_lab` starts a lab from a notebook or the shell, on the warm pool (`pool`, the
  launcher side, and `zygote`, the warm process that forks the ranks) or under torchrun; `results`
  holds what it returns (`LabResult`, `LabError`); `verdict` says how the lab ended and which
  rank failed first; `teardown` stops everything; `postmortem` reads what the ranks left
  behind; `rundir` owns each run's directory; `guard` makes torchrun and the ranks die with the
  process that launched them.
- `bootstrap`: what each rank runs around the lab (records, error files, the launcher watchdog).
- `dist`: inside a rank: process group, device, seeding, `report()`, clean shutdown.
- `measure`: inside a rank: bytes held, activations saved, collectives sent, step time.
- `magic`: the `%%torchrun` cell magic. `system`: backend and rank-count defaults.

May import: layer 1 (labkit.models, .memory, .comm, ..., .validate) and itself. Never plots/,
widgets/, parallel/, labs/, course/ or cli/. torch is imported inside functions where a module
must stay cheap to import (launch, system).
"""
