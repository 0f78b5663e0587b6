"""The distributed runtime (layer 3): starting labs and what runs inside a rank.

Launcher side: `launch` (`run_lab`), `pool` and `zygote` (the warm pool), `results`
(`LabResult`, `LabError`), `verdict`, `teardown`, `postmortem`, `rundir`, `guard`; `progress`
(a lab's live line in a notebook) with `lab_times` (measured laptop times); `noise`.
Inside a rank: `bootstrap`, `dist`, `measure`, `rankserver`. Also `magic` (`%%torchrun`,
`%ranks`) with `world` and `ranks_view` (ranks that stay), and `system`.
What each does, and why so: docs/runtime.md.
May import: layer 1 (labkit.models, .memory, .comm, ..., .validate) and itself. Never plots/,
widgets/, parallel/, labs/, course/ or cli/. torch is imported inside functions where a module
must stay cheap to import (launch, system).
"""
