"""Your mixture-of-experts dispatch and combine, written with all_to_all_single, on real ranks
next to one process: module 10's exercise runner.

    torchrun --nproc-per-node 4 -m labkit.labs.dispatch --source my.py --name dispatch_combine

From a notebook (module 10's exercise "dispatch"; the contract and the checks:
`run_user_dispatch`), pass the function itself:

    from labkit.labs.dispatch import run_user_dispatch
    r = run_user_dispatch(dispatch_combine, nproc=4)    # r.ok, r.problems(), print(r.summary())
"""
from __future__ import annotations

import argparse
import inspect
from dataclasses import dataclass, field

import torch

from labkit.labs.common import exercise as shared
from labkit.labs.common.exercise import check_nproc, run_exported, stub_message, where_raised

HIDDEN = 32                   # a token's width; a row of 32 float32 is 128 bytes
EXPERTS = 8                   # split evenly over 2, 4 or 8 ranks
SEED = 10
DEFAULT_TIMEOUT = 45          # seconds: the deadlock bound (a correct run takes ~2 s, pool warm)
# Each rank's tokens: "random" (a uniform expert per token, more tokens on higher ranks), and
# "skewed" (every token to an expert of rank 0 or 1: the other ranks receive nothing, and
# experts nobody chose).
CASES = ("random", "skewed")
ASPECTS = ("runs", "experts", "output", "collectives")


# ---------------------------------------------------------------------------------------------
# from the notebook

def run_user_dispatch(fn, nproc: int = 4, timeout: float = DEFAULT_TIMEOUT,
                      quiet: bool = True) -> "DispatchCheck":
    """Run `fn(x, expert, num_experts, expert_fn)` (your dispatch and combine, defined in a
    notebook cell or a .py file) on `nproc` ranks (2, 4 or 8) over gloo, against one process.
    NotImplementedError for a stub, ValueError for bad arguments,
    labkit.runtime.launch.LabError when a rank fails outside your code or the run passes
    `timeout` seconds.

    The contract (expert parallelism with k = 1): EXPERTS experts split evenly over the ranks,
    rank r holding experts [r E/ep, (r+1) E/ep). Each rank calls `fn` with its own tokens `x`
    (T, HIDDEN) float32, `expert` (T,) int64 the expert chosen for each token, `num_experts`
    (EXPERTS) and `expert_fn(e, tokens)`, which applies expert e (a global id, one of this
    rank's: it raises ValueError for another) to the rows `tokens` (n, HIDDEN). `fn` returns
    (T, HIDDEN): each token's output of its expert, in the order of `x`. Each expert is a
    linear map with a bias (whole-number weights, so every result is exact in fp32: "equal"
    means equal).

    Checked per rank, for two sets of tokens ("random": a uniform expert per token, 6 + 2r tokens
    on rank r; "skewed": every token to an expert of rank 0 or 1, so the other ranks receive
    nothing and some experts are never chosen): "runs"; "experts" (over every rank, each expert
    applied to exactly the tokens routed to it, once); "output" (equal to one process, in the
    order of x); "collectives" (the tokens travel by all-to-all, there and back once: the
    all-to-alls carry at least this rank's T rows out and its received rows back, at most 1.5
    times that plus room for the counts, and no other collective moves more than counts)."""
    nproc = check_nproc(nproc)
    if not inspect.isfunction(fn):
        raise ValueError(f"run_user_dispatch takes a function fn(x, expert, num_experts, "
                         f"expert_fn) defined in a notebook cell or a .py file; received "
                         f"{fn!r} (a {type(fn).__name__})")
    msg = stub_message(fn.__name__, [lambda: fn(torch.zeros(2, HIDDEN), torch.zeros(
        2, dtype=torch.long), EXPERTS, lambda e, tokens: tokens)])
    if msg:
        raise NotImplementedError(msg)
    res = run_exported(fn, "labkit.labs.dispatch", nproc, timeout, quiet, [],
                       "the ranks did not issue the same all-to-alls in the same order (every "
                       "rank takes part in every exchange, even one that sends or receives "
                       "nothing)")
    return DispatchCheck.from_reports([res.results[r] for r in range(nproc)], name=fn.__name__,
                                      output=res.output)


# ---------------------------------------------------------------------------------------------
# what the ranks found, and what is wrong with it

def _bytes(n) -> str:
    return f"{n:,} B"


@dataclass
class DispatchCheck:
    """What run_user_dispatch measured on every rank (lists indexed by rank), per case."""

    name: str
    world_size: int
    error: str = ""
    cases: dict = field(default_factory=dict)        # case -> [per-rank report]
    output: list = field(default_factory=list, repr=False)

    @classmethod
    def from_reports(cls, rs: list, *, name: str, output=()) -> "DispatchCheck":
        errors = [r.get("error", "") for r in rs]
        # a rank whose exchange broke because another rank raised reports the broken
        # connection: the other rank's own error is the story
        first = next((e for e, r in zip(errors, rs) if e and not r.get("peer_failed")), "") or \
            next((e for e in errors if e), "")
        if first or not all("cases" in r for r in rs):
            return cls(name=name, world_size=len(rs), error=first or "the ranks reported nothing",
                       output=list(output))
        return cls(name=name, world_size=len(rs),
                   cases={c: [r["cases"][c] for r in rs] for c in CASES}, output=list(output))

    @property
    def ok(self) -> bool:
        return not self.problems()

    def problems(self) -> list[str]:
        return list(dict.fromkeys(m for m in self.verdicts().values() if m))

    def verdicts(self) -> dict[str, str]:
        """{aspect: what is wrong, or ""}: "runs", "experts", "output", "collectives" (what each
        means: run_user_dispatch's docstring)."""
        if self.error:
            return dict.fromkeys(ASPECTS, self.error)
        out = dict.fromkeys(ASPECTS, "")
        for case in CASES:
            per = self.cases[case]
            out["experts"] = out["experts"] or self._experts(case, per[0])
            out["output"] = out["output"] or self._output(case, per)
            out["collectives"] = out["collectives"] or self._collectives(case, per)
        return out

    def _experts(self, case, r) -> str:
        for e, (applied, routed) in enumerate(zip(r["applied"], r["assigned"])):
            if applied != routed:
                return (f"case {case!r}: expert {e} was applied to {applied} token"
                        f"{'' if applied == 1 else 's'} over all the ranks; {routed} "
                        f"{'is' if routed == 1 else 'are'} routed to it: apply each expert to "
                        "its own tokens only, once")
        return ""

    def _output(self, case, per) -> str:
        for rank, r in enumerate(per):
            T = r["tokens"]
            if r["shape"] != [T, HIDDEN]:
                got = f"shape {tuple(r['shape'])}" if r["shape"] is not None else \
                    f"a {r['what']}"
                return (f"case {case!r}, rank {rank}: returned {got}; expected a tensor of "
                        f"shape ({T}, {HIDDEN}), one row per token of x")
            if r["bad_rows"]:
                if r["permuted"]:
                    return (f"case {case!r}, rank {rank}: the right outputs, in the wrong order "
                            f"({r['bad_rows']} of {T} rows misplaced, the first at row "
                            f"{r['first_bad']}): return them in the order of x")
                return (f"case {case!r}, rank {rank}: {r['bad_rows']} of {T} rows differ from "
                        f"one process (the first: row {r['first_bad']}, whose expert is "
                        f"{r['first_expert']}; largest difference {r['diff']:g})")
        return ""

    def _collectives(self, case, per) -> str:
        for rank, r in enumerate(per):
            moved, rows = r["a2a"][1], (r["tokens"] + r["received"]) * HIDDEN * 4
            others = {k: v for k, v in r["other"].items() if v[1] > r["counts_room"]}
            if others:
                what = ", ".join(f"{kind} x {count} ({_bytes(nbytes)})"
                                 for kind, (count, nbytes) in sorted(others.items()))
                return (f"case {case!r}, rank {rank}: {what} moved more than counts: the tokens "
                        "and their results travel by all-to-all only, each to the rank that "
                        "needs it")
            if not r["a2a"][0]:
                return (f"case {case!r}, rank {rank}: no all-to-all was issued; the tokens go "
                        "to their experts' ranks and come back by all-to-all "
                        "(dist.all_to_all_single)")
            if moved < rows:
                return (f"case {case!r}, rank {rank}: the all-to-alls carried {_bytes(moved)}; "
                        f"this rank's {r['tokens']} tokens out and the {r['received']} it "
                        f"received back are {_bytes(rows)} ({HIDDEN} float32 each)")
            if moved > 1.5 * rows + r["counts_room"]:
                return (f"case {case!r}, rank {rank}: the all-to-alls carried {_bytes(moved)}, "
                        f"{moved / rows:.2f} x the {_bytes(rows)} of this rank's tokens out "
                        "and its received tokens back: send each token only to its expert's "
                        "rank, and each result only back")
        return ""

    def summary(self) -> str:
        n = self.world_size
        lines = [f"{self.name} on {n} ranks ({EXPERTS} experts, {EXPERTS // n} per rank, "
                 f"tokens of {HIDDEN} float32):"]
        if not self.error:
            for case in CASES:
                per = self.cases[case]
                lines.append(f"  {case}: tokens per rank {', '.join(str(r['tokens']) for r in per)}"
                             f"; received {', '.join(str(r['received']) for r in per)}; "
                             f"all-to-all bytes {', '.join(format(r['a2a'][1], ',') for r in per)}")
        lines += [f"  PROBLEM: {p}" for p in self.problems()] or ["  all correct"]
        return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# inside a rank

def weights() -> tuple[torch.Tensor, torch.Tensor]:
    """Every expert's (HIDDEN, HIDDEN) matrix and bias: small whole numbers in fp32."""
    g = torch.Generator().manual_seed(SEED)
    w = torch.randint(-2, 3, (EXPERTS, HIDDEN, HIDDEN), generator=g).float()
    b = torch.randint(-3, 4, (EXPERTS, HIDDEN), generator=g).float()
    return w, b


def tokens(case: str, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(x (T, HIDDEN), expert (T,)) of `rank` in `case`: whole numbers, the same every run."""
    g = torch.Generator().manual_seed(SEED + 100 * rank + CASES.index(case))
    local = EXPERTS // world
    if case == "random":
        T = 6 + 2 * rank
        expert = torch.randint(0, EXPERTS, (T,), generator=g)
    else:
        T = 5 + rank
        choices = torch.tensor([0, local - 1, local] if world > 1 else [0])
        expert = choices[torch.randint(0, len(choices), (T,), generator=g)]
    x = torch.randint(-3, 4, (T, HIDDEN), generator=g).float()
    return x, expert


def expert_fn_of(rank: int, world: int, seen: torch.Tensor):
    """expert_fn(e, tokens) of this rank: its own experts only (it keeps no other weights);
    counts in `seen` the tokens each expert is applied to."""
    w, b = weights()
    local = EXPERTS // world
    lo, hi = rank * local, (rank + 1) * local
    mine_w, mine_b = w[lo:hi].clone(), b[lo:hi].clone()
    del w, b

    def expert_fn(e, tokens):
        try:
            e = int(e)
        except (TypeError, ValueError):
            raise ValueError(f"expert_fn(e, tokens): e must be an expert's number; received "
                             f"{e!r}") from None
        if not lo <= e < hi:
            where = f"rank {e // local}" if 0 <= e < EXPERTS else "no rank (no such expert)"
            raise ValueError(f"expert_fn({e}, ...) was called on rank {rank}, which holds "
                             f"experts {lo} to {hi - 1}: expert {e} lives on {where}; its tokens "
                             "must be sent there")
        if not (isinstance(tokens, torch.Tensor) and tokens.dim() == 2
                and tokens.shape[1] == HIDDEN):
            what = (tuple(tokens.shape) if isinstance(tokens, torch.Tensor)
                    else type(tokens).__name__)
            raise ValueError(f"expert_fn({e}, tokens): tokens must be rows of shape (n, {HIDDEN}); "
                             f"received {what}")
        seen[e] += tokens.shape[0]
        return tokens.float() @ mine_w[e - lo] + mine_b[e - lo]

    return expert_fn


def _compare(y, want: torch.Tensor, expert: torch.Tensor) -> dict:
    if not isinstance(y, torch.Tensor):
        return {"shape": None, "what": type(y).__name__}
    out = {"shape": list(y.shape), "what": "tensor", "bad_rows": 0}
    if tuple(y.shape) != tuple(want.shape):
        return out
    y = y.detach().to(torch.float32)
    bad = (y != want).any(1).nonzero().flatten()
    if len(bad):
        first = int(bad[0])
        out.update(bad_rows=len(bad), first_bad=first, first_expert=int(expert[first]),
                   diff=float((y - want).abs().nan_to_num(nan=float("inf")).max()),
                   permuted=sorted(map(tuple, y.tolist())) == sorted(map(tuple, want.tolist())))
    return out


def _peer_failed(exc: BaseException) -> bool:
    """An exchange broken because another rank stopped (gloo's connection errors)."""
    text = str(exc).lower()
    return type(exc).__name__ in ("RuntimeError", "DistBackendError") and any(
        w in text for w in ("connection closed", "connection reset", "gloo", "broken pipe"))


def _case(fn, case: str, ctx, out: dict) -> None:
    import torch.distributed as dist

    from labkit.runtime.measure import CollectiveCounter

    rank, world = ctx.rank, ctx.world_size
    local = EXPERTS // world
    x, expert = tokens(case, rank, world)
    w, b = weights()
    want = torch.bmm(x[:, None, :], w[expert]).squeeze(1) + b[expert]
    seen = torch.zeros(EXPERTS, dtype=torch.long)
    with CollectiveCounter() as counter:
        y = fn(x.clone(), expert.clone(), EXPERTS, expert_fn_of(rank, world, seen))
    assigned = torch.bincount(expert, minlength=EXPERTS)
    every = [torch.empty_like(assigned) for _ in range(world)]
    dist.all_gather(every, assigned)
    applied = seen.clone()
    dist.all_reduce(applied)
    a2a = [e.bytes for e in counter.events if e.kind == "all_to_all"]
    other: dict = {}
    for e in counter.events:
        if e.kind not in ("all_to_all", "barrier"):
            row = other.setdefault(e.kind, [0, 0])
            row[0] += 1
            row[1] += e.bytes
    row = {"tokens": len(x), "received": int(torch.stack(every)[:, rank * local:
                                                                 (rank + 1) * local].sum()),
           "applied": applied.tolist(), "assigned": torch.stack(every).sum(0).tolist(),
           "a2a": [len(a2a), sum(a2a)], "other": other,
           "counts_room": 2 * world * EXPERTS * 8}   # counts exchanged as int64, twice
    row.update(_compare(y, want, expert))
    out["cases"][case] = row


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description="check a learner's MoE dispatch and combine on ranks")
    p.add_argument("--source", required=True, help="a .py file defining the function")
    p.add_argument("--name", required=True, help="fn(x, expert, num_experts, expert_fn)")
    args = p.parse_args(argv)

    from labkit.runtime import dist
    ctx = dist.setup(backend="gloo")
    torch.set_num_threads(1)
    out = {"error": "", "cases": {}}
    try:
        fn = shared.load_source(args.source, args.name)
        for case in CASES:
            _case(fn, case, ctx, out)
    except Exception as exc:  # noqa: BLE001 - the learner's code may raise anything
        out["error"] = f"your {args.name} raised {where_raised(exc, args.source)}"
        out["peer_failed"] = _peer_failed(exc)
        out.pop("cases")
    shared.note_refusal(out)         # the rank guard's (labkit.course.forbid), if any
    dist.report(**out)
    dist.print0(f"dispatch on {ctx.world_size} ranks: {'raised' if out['error'] else 'ran'}")
    dist.shutdown(wait=not out["error"])    # after an error a peer may wait in an exchange
                                             # this rank left: it fails once this rank is gone


__all__ = ["run_user_dispatch", "DispatchCheck", "weights", "tokens", "expert_fn_of", "main"]

if __name__ == "__main__":
    main()
