"""A workshop's GPU-hour budget from measured lab times (`labkit workshop budget`): what the
labs use (learners x GPUs x lab time x repeats) and what a reservation bills (learners x GPUs x
session hours). Pure arithmetic over a preflight's `lab_seconds`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from labkit import validate

@dataclass
class Budget:
    learners: int
    gpus_per_learner: int
    repeats: float
    lab_seconds: float           # one learner's labs, run once each
    compute_gpu_hours: float     # learners x GPUs x labs' time x repeats
    reserved_gpu_hours: float | None = None   # learners x GPUs x session hours (what is billed)
    cost: float | None = None
    rows: list[dict] = field(default_factory=list)


def gpu_hours(learners, lab_seconds: dict, gpus_per_learner=1, repeats=1.0,
              session_hours=None, price_per_gpu_hour=None) -> Budget:
    """GPU-hours a workshop needs, from measured lab times.

    lab_seconds: {lab run: wall seconds of one run} (a preflight's `lab_times()`). Each learner
    holds `gpus_per_learner` GPUs while their labs run, and runs each lab `repeats` times (re-runs
    after a fix): compute = learners x gpus_per_learner x sum(lab_seconds) x repeats / 3600.
    session_hours: when each learner keeps the machine for the whole session (the usual cloud
    case), reserved = learners x gpus_per_learner x session_hours, the figure billed.
    price_per_gpu_hour: cost = the billed figure (reserved if given, else compute) x price."""
    n = validate.positive_int("learners", learners)
    g = validate.positive_int("gpus_per_learner", gpus_per_learner)
    rep = validate.positive("repeats", repeats)
    if not isinstance(lab_seconds, dict) or not lab_seconds:
        raise ValueError("lab_seconds must be a non-empty dict {lab: seconds}; e.g. a "
                         "preflight's lab_times() or `labkit workshop check --json`'s lab_seconds")
    for k, s in lab_seconds.items():
        validate.non_negative(f"lab_seconds[{k!r}]", s)
    total = float(sum(lab_seconds.values()))
    compute = n * g * total * rep / 3600
    reserved = None
    if session_hours is not None:
        reserved = n * g * validate.positive("session_hours", session_hours)
        if reserved < compute:
            raise ValueError(f"session_hours={session_hours} is shorter than the labs' own "
                             f"time ({total * rep / 3600:.2f} h per learner with repeats={rep:g});"
                             " allowed: a session at least that long")
    cost = None
    if price_per_gpu_hour is not None:
        price = validate.non_negative("price_per_gpu_hour", price_per_gpu_hour)
        cost = (reserved if reserved is not None else compute) * price
    rows = [{"lab": k, "seconds": float(s),
             "gpu_hours": n * g * float(s) * rep / 3600} for k, s in lab_seconds.items()]
    return Budget(n, g, rep, total, compute, reserved, cost, rows)


def format_budget(b: Budget) -> str:
    lines = [f"{'lab':<20}{'s per run':>10}{'GPU-h, all learners':>22}"]
    lines += [f"{r['lab']:<20}{r['seconds']:>10.1f}{r['gpu_hours']:>22.3f}" for r in b.rows]
    lines += ["", f"{b.learners} learners x {b.gpus_per_learner} GPU(s) x "
                  f"{b.lab_seconds:.0f} s of labs x {b.repeats:g} repeat(s) / 3600 = "
                  f"{b.compute_gpu_hours:.2f} GPU-hours running labs"]
    if b.reserved_gpu_hours is not None:
        lines.append(f"reserved for the session: {b.reserved_gpu_hours:.1f} GPU-hours "
                     f"(each learner holds {b.gpus_per_learner} GPU(s) throughout; billed)")
    if b.cost is not None:
        lines.append(f"cost: {b.cost:,.2f} (at the price per GPU-hour given)")
    return "\n".join(lines)
