"""The builders of labkit.labs.diagnose's two cases whose run fails (labkit.labs.diagnose.cases
has the others and the helpers): an out-of-memory error from activations, and a hang from a rank
that skipped an all-reduce. The evidence is what the launcher gives back: the ranks' output, the
failure message naming the rank, the exception's text, and what the ranks reported before.
"""
from __future__ import annotations

import math
import re

from labkit.labs.diagnose.cases import MS, answered, launch, log_text, med, pct
from labkit.plots.diagnose import fmt_size
from labkit.runtime.launch import PEER_GONE


# ---------------------------------------------------------------------------------------------
# 4. activations out of memory

def activation_oom_plan(rng) -> dict:
    world, seq, batches = 2, rng.choice([128, 192, 256]), [1, 2, 4, 8]
    failed = batches[-1]
    return dict(
        params=dict(world=world, seq=seq, batches=batches),
        title="Out of memory at a larger micro-batch",
        question=(f"A {world}-rank data-parallel run (GPT-2, bf16 with fp32 master weights, "
                  f"AdamW, sequences of {seq} tokens) raised its micro-batch from 1 to "
                  f"{failed}, one step each; it died at micro-batch {failed} with the error in "
                  "the evidence (the GPU's memory is emulated on CPU by a budget per rank). "
                  "What filled the memory, and what fixes it?"),
        options=["Activations saved for backward, which grow with micro-batch x sequence: "
                 "recompute activations, or use a smaller micro-batch with gradient "
                 "accumulation, or sequence parallelism",
                 "The weights and optimizer states: shard them with ZeRO-3 / FSDP",
                 "A memory leak: something from the earlier steps is kept alive",
                 "Fragmentation of the allocator's memory: set "
                 "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"])


def activation_oom(plan: dict, seed: int, timeout: float, env=None) -> dict:
    import argparse

    from labkit.labs.common.models import lab_spec
    from labkit.memory import activation_bytes_per_layer, estimate_memory

    world, seq, batches = (plan["params"][k] for k in ("world", "seq", "batches"))
    layers, hidden, heads = 2, 64, 4
    ok, failed = batches[-2], batches[-1]
    spec = lab_spec(argparse.Namespace(model="debug-gpt2", layers=layers, hidden=hidden,
                                       heads=heads, kv_heads=heads, vocab=1024, seq=seq))

    def estimate(b, recompute="none"):
        return estimate_memory(spec, batch_size=b, seq_len=seq, precision="bf16-mixed",
                               optimizer="adamw", recompute=recompute,
                               implementation="megatron", attention="eager")

    # the emulated GPU: every model state and half again the activations of micro-batch `ok`
    budget = int(estimate(ok).model_states + 1.5 * estimate(ok).activations)
    result, error = launch("labkit.labs.diagnose.oom", world,
                           ["--budget", budget, "--seq", seq, "--layers", layers, "--hidden",
                            hidden, "--heads", heads, "--batches", ",".join(map(str, batches)),
                            "--seed", seed], timeout, env, fails=True)
    if error.exc_type != "OutOfMemoryError":
        raise error                   # the lab broke otherwise: nothing to diagnose
    r = result.results[error.rank if error.rank is not None else 0]
    steps = {s["batch"]: s for s in r["steps"]}
    held = r["last_attempt"]["held"]
    states = sum(held.values())
    per_layer = activation_bytes_per_layer(seq, failed, hidden, heads)
    need = estimate(failed)
    by_batch = {b: {**s["held"], "activations": s["activations"]} for b, s in steps.items()}
    by_batch[failed] = {**held, "activations": int(need.activations)}
    numbers = dict(
        world_size=world, budget=budget, seq=seq, failed_batch=failed, fitted_batch=ok,
        model_states=states, activations={b: s["activations"] for b, s in steps.items()},
        activations_per_sample={b: s["activations"] / b for b, s in steps.items()},
        peak={b: s["peak"] for b, s in steps.items()},
        predicted_activations={b: estimate(b).activations for b in batches},
        ratio={b: s["activations"] / estimate(b).activations for b, s in steps.items()},
        layer_activations_predicted=per_layer, layers=layers,
        needed=states + need.activations, sharded_needed=states / world + need.activations,
        over_budget=states + need.activations - budget,
        full_recompute_needed=states + estimate(failed, "full").activations,
        error_rank=error.rank, error_type=error.exc_type)
    evidence = dict(
        log=log_text(result, error), error=error.exc_message,
        memory=dict(budget=budget, by_batch=by_batch, failed=failed,
                    note=f"micro-batch {failed}: model states as held, activations as "
                         "labkit.memory predicts (the forward stopped before it saved them "
                         "all)"),
        note="On CPU there is no CUDA out-of-memory error: the lab gives each rank a budget "
             "that stands for its GPU and raises torch.OutOfMemoryError, as CUDA's allocator "
             "does, when model states plus the activations saved for backward would pass it "
             "(labkit.labs.diagnose.oom). Every byte in it is measured, except the activations "
             f"drawn for micro-batch {failed}: predicted, as the forward stopped.")
    a_ok = steps[ok]["activations"]
    why = [
        f"activations saved for backward were {fmt_size(a_ok)} at micro-batch {ok} "
        f"({pct(a_ok / budget)} of the budget) and grow with it "
        f"({', '.join(f'{s / 1e6:.2f}' for s in numbers['activations_per_sample'].values())} MB "
        f"per sequence at micro-batch {', '.join(map(str, steps))}); labkit.memory predicts "
        f"{fmt_size(need.activations)} at {failed} ({layers} layers x "
        f"{fmt_size(per_layer)}, Korthikanti et al., plus embeddings and logits; measured/"
        f"predicted at {ok}: {numbers['ratio'][ok]:.3f}). With full recomputation the step "
        f"would need {fmt_size(numbers['full_recompute_needed'])}, "
        + ("within" if numbers["full_recompute_needed"] <= budget else "still over")
        + f" the {fmt_size(budget)}; micro-batch {ok} with gradient accumulation ({failed // ok} "
        f"micro-batches per step) fitted at {fmt_size(steps[ok]['peak'])}.",
        f"the model states were {fmt_size(states)} ({pct(states / budget)} of the budget) at "
        f"every micro-batch; sharded over the {world} ranks (ZeRO-3, FSDP) they would be "
        f"{fmt_size(states / world)}, and micro-batch {failed} would still need "
        f"{fmt_size(numbers['sharded_needed'])}, over the {fmt_size(budget)}.",
        "nothing grew from step to step: from micro-batch 2 on, the rank held the same "
        f"{fmt_size(states)} of model states before each step (the first optimizer step "
        f"created AdamW's moments), and the activations per sequence stayed "
        f"{min(numbers['activations_per_sample'].values()) / 1e6:.2f} to "
        f"{max(numbers['activations_per_sample'].values()) / 1e6:.2f} MB: the memory follows "
        "the micro-batch, as activations do.",
        f"the step needs {fmt_size(numbers['needed'])} (the states held plus the activations "
        f"labkit.memory predicts for micro-batch {failed}): {fmt_size(numbers['over_budget'])} "
        "more than the budget; no allocator setting makes that fit.",
    ]
    return answered(why, evidence, numbers)


# ---------------------------------------------------------------------------------------------
# 5. a rank skipped a collective

def skipped_collective_plan(rng) -> dict:
    world, timeout_s = 2, 3.0
    return dict(
        params=dict(world=world, batch=2, timeout_s=timeout_s, steps=rng.choice([3, 4, 5])),
        title="A hang, then a gloo timeout",
        question=(f"A {world}-rank data-parallel run (GPT-2, gloo, a hand-written data split "
                  f"and gradient all-reduce, {timeout_s:g} s collective timeout) stopped "
                  "making progress near its end; the ranks then raised the error in the "
                  "evidence. What happened?"),
        options=["One rank ran one step fewer (its share of the data was smaller) and never "
                 "entered the last gradient all-reduce the other rank waits in",
                 "The network is too slow: raise the collective timeout",
                 "One rank crashed (e.g. killed by the OOM killer) and the other lost its peer",
                 "A NaN in the gradients made the all-reduce hang"])


def skipped_collective(plan: dict, seed: int, timeout: float, env=None) -> dict:
    from labkit.scaling import sampler_num_samples

    world, batch, timeout_s, steps = (plan["params"][k] for k in
                                      ("world", "batch", "timeout_s", "steps"))
    samples = world * batch * steps - 1          # the last rank gets one sample fewer
    for attempt in (1, 2):
        result, error = launch("labkit.labs.diagnose.hang", world,
                               ["--samples", samples, "--batch", batch, "--timeout", timeout_s,
                                "--seed", seed], timeout, env, fails=True)
        if error.reason == "exception" and "Timed out" in (error.exc_message or ""):
            break
        # On a busy machine gloo may close the timed-out rank's connections before that rank
        # has recorded its timeout: its peer's "Connection closed by peer" is then the first
        # error, and the launcher stops the rank that timed out (seen once in 7 loaded full
        # test runs). The case's evidence is the timeout: run it once more.
        if attempt == 2 or not PEER_GONE.search(error.exc_message or ""):
            raise error               # not gloo's timeout: the lab broke otherwise
    r = result.results
    ran = [len([c for c in x.get("collectives", []) if c["kind"] == "all_reduce"])
           for x in r]
    last = [x["collectives"][-1] for x in r]
    waits = [c["kind"] for c in last]
    ar = [t for x in r for t in x.get("allreduce_s", [])]
    short = min(range(world), key=lambda k: r[k]["steps"])
    full = 1 - short
    losses = r[full].get("losses", [])
    finite = all(math.isfinite(v) for x in r for v in x.get("losses", []))
    padded = sampler_num_samples(samples, world)

    def said(kind, text):        # one line, without gloo's "[path/file.cc:78] " prefix
        text = re.sub(r"^\[[^\]]*\.(cc|cpp|h):\d+\]\s*", "", text.splitlines()[0] if text else "")
        return f"{kind}: {text[:100]}"

    raised = {error.rank: said(error.exc_type, error.exc_message)}
    for rank, kind, text in re.findall(r"^rank (\d+) then raised (\w+): (.*)$", error.args[0],
                                       re.M):
        raised[int(rank)] = said(kind, text)
    numbers = dict(
        world_size=world, samples=samples, batch=batch, timeout_s=timeout_s,
        samples_per_rank=[x["samples"] for x in r], steps_per_rank=[x["steps"] for x in r],
        allreduces_entered=ran, waiting_in=waits, skipping_rank=short,
        allreduce_median_s=med(ar), timeout_over_allreduce=timeout_s / med(ar),
        sampler_samples_per_rank=padded, sampler_steps_per_rank=padded // batch,
        error_rank=error.rank, error_type=error.exc_type, losses=[x.get("losses") for x in r],
        losses_finite=finite, exit_codes=[rr.exit_code for rr in result.ranks])
    timeline = []
    for k, x in enumerate(r):
        for c in x["collectives"]:
            done = "end" in c
            timeline.append(dict(rank=k, kind=c["kind"] if done else f"waiting in {c['kind']}",
                                 start=c["start"], end=c["end"] if done else c["start"] + timeout_s,
                                 step=c["step"]))
    evidence = dict(log=log_text(result, error), error=error.exc_message, timeline=timeline,
                    timeline_title="collectives each rank entered (hatched: never completed; "
                                   f"gloo gives up after {timeout_s:g} s)")
    why = [
        f"rank {short} had {r[short]['samples']} of the {samples} samples, {r[short]['steps']} "
        f"steps of {batch}; rank {full} had {r[full]['samples']}, {r[full]['steps']} steps. Rank "
        f"{full} waits in all_reduce #{ran[full]} (step {r[full]['steps']}), which rank "
        f"{short} never enters: it is at the checkpoint barrier. Collectives must be entered by "
        f"every rank in the same order; torch's DistributedSampler pads every rank to "
        f"{padded} samples (labkit.scaling.sampler_num_samples), drop_last or torch's Join "
        "context manager also keep the ranks in step.",
        f"each earlier all-reduce took {MS * med(ar):.1f} ms (median); the {timeout_s:g} s "
        f"timeout is {numbers['timeout_over_allreduce']:,.0f} times that. The ranks wait in "
        f"different collectives ({waits[0]} on rank 0, {waits[1]} on rank 1), which never "
        "match: a longer timeout only waits longer.",
        f"rank {short} did not crash: it printed that it finished its {r[short]['steps']} steps, "
        f"entered a {waits[short]}, and ended with a Python exception there ("
        f"{raised.get(short, 'see the log')}); no rank was killed by a signal (exit codes "
        + ", ".join(str(c) for c in numbers["exit_codes"]) + ").",
        f"{'every loss was finite' if finite else 'a loss was not finite, but'} "
        f"({', '.join(f'{v:.3f}' for v in losses)} on rank {full}), and a collective never "
        "looks at the values it sums: a NaN is added like any other number (it spreads to "
        "every rank; it does not stop one).",
    ]
    return answered(why, evidence, numbers)
