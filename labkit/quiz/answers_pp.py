"""Answers of the pipeline-parallel questions (labkit/quiz/data/pp.yaml).

The bubble comes from `labkit.pipeline.simulate` (a discrete-event run of the schedule, which
reproduces Narayanan et al. 2021, §2.2 exactly with uniform stage times) and its closed form
`bubble_formula`; micro-batch counts from `min_microbatches`; in-flight activations from
`activation_in_flight`; sends from `p2p_messages` and `labkit.comm.step_communication("pp")`.
Percentages are returned in % (27.3, not 0.273), the unit the questions ask in.
"""
from __future__ import annotations

from labkit.comm import step_communication
from labkit.models import get_model
from labkit.pipeline import (activation_in_flight, bubble_formula, min_microbatches,
                             p2p_messages, simulate)

MB = 1e6


def idle_share_pct(stages, microbatches, schedule="1f1b"):
    """Share of the step the stages sit idle, in %: (p-1)/(m+p-1) for GPipe and 1F1B."""
    r = simulate(schedule, stages, microbatches)
    share, relative = bubble_formula(schedule, stages, microbatches)
    return {"answer": 100 * r.bubble_fraction, "relative_pct": 100 * r.bubble_ratio,
            "formula_pct": 100 * share, "makespan": r.makespan, "ideal": r.ideal,
            "p1": stages - 1, "units": microbatches + stages - 1,
            "m10": min_microbatches(stages, 0.10, schedule)}


def relative_bubble_pct(stages, microbatches, schedule="1f1b"):
    """Bubble relative to the ideal (no-bubble) step, in %: (p-1)/m for GPipe and 1F1B."""
    r = simulate(schedule, stages, microbatches)
    return {"answer": 100 * r.bubble_ratio, "idle_pct": 100 * r.bubble_fraction}


def microbatches_for(stages, target_pct, schedule="1f1b"):
    """Fewest micro-batches whose idle share of the step is at most target_pct %."""
    m = min_microbatches(stages, target_pct / 100, schedule)
    prev = max(m - 1, 1)
    return {"answer": m, "at_m_pct": 100 * bubble_formula(schedule, stages, m)[0],
            "prev": prev, "prev_pct": 100 * bubble_formula(schedule, stages, prev)[0]}


def interleaved_relative_pct(stages, microbatches, chunks):
    """Interleaved 1F1B's bubble relative to the ideal, in %: (p-1)/(v m)."""
    r = simulate("interleaved-1f1b", stages, microbatches, chunks=chunks)
    plain = simulate("1f1b", stages, microbatches)
    return {"answer": 100 * r.bubble_ratio, "plain_pct": 100 * plain.bubble_ratio,
            "idle_pct": 100 * r.bubble_fraction}


def verify_interleaving(stages, microbatches, chunks):
    """Interleaving with v chunks divides the relative bubble by v and multiplies the busiest
    rank's point-to-point sends by v (the data-parallel gradient all-reduce, once per step, is
    not part of the schedule); the first stage holds no fewer micro-batches' activations."""
    plain = simulate("1f1b", stages, microbatches)
    inter = simulate("interleaved-1f1b", stages, microbatches, chunks=chunks)
    one, many = p2p_messages(stages, microbatches), p2p_messages(stages, microbatches, chunks)
    ratio = inter.bubble_ratio / plain.bubble_ratio
    held_1 = max(activation_in_flight("1f1b", stages, microbatches))
    held_v = max(activation_in_flight("interleaved-1f1b", stages, microbatches, chunks))
    holds = (abs(ratio * chunks - 1) < 1e-9 and many.busiest_rank == chunks * one.busiest_rank
             and held_v >= held_1)
    return {"holds": holds, "plain_pct": 100 * plain.bubble_ratio,
            "inter_pct": 100 * inter.bubble_ratio, "sends_1": one.busiest_rank,
            "sends_v": many.busiest_rank, "held_1": held_1, "held_v": held_v}


def verify_bubble_same(stages, microbatches):
    """GPipe and 1F1B have the same bubble; 1F1B bounds in-flight activations to p - i."""
    g, o = simulate("gpipe", stages, microbatches), simulate("1f1b", stages, microbatches)
    holds = (abs(g.bubble_fraction - o.bubble_fraction) < 1e-12
             and max(o.peak_in_flight) == min(stages, microbatches)
             and max(g.peak_in_flight) == microbatches)
    return {"holds": holds, "gpipe_idle": g.bubble_fraction, "one_f_one_b_idle": o.bubble_fraction,
            "gpipe_peak": int(max(g.peak_in_flight)), "ofob_peak": int(max(o.peak_in_flight))}


def in_flight_1f1b(stages, microbatches, stage):
    """Micro-batches whose activations stage `stage` (0 = first) holds at its peak under 1F1B."""
    held = activation_in_flight("1f1b", stages, microbatches)
    if not 0 <= stage < stages:
        raise ValueError(f"stage={stage!r} must be 0 to stages - 1 = {stages - 1}")
    return {"answer": held[stage], "gpipe": activation_in_flight("gpipe", stages,
                                                                  microbatches)[stage],
            "limit": stages - stage}


def naive_utilisation_pct(stages):
    """Busy share of the GPUs with one micro-batch through k stages (one stage busy at a time)."""
    r = simulate("gpipe", stages, 1)
    return {"answer": 100 * (1 - r.bubble_fraction), "idle_pct": 100 * r.bubble_fraction}


def verify_zero_bubble(stages, microbatches):
    """ZB-H1 at T_F = T_B = T_W: relative bubble (p-1)/(3m), a third of 1F1B's at the same
    f + b + w, with 1F1B's in-flight bound."""
    z = simulate("zero-bubble", stages, microbatches, fwd=1.0, bwd=1.0, wgrad=1.0)
    o = simulate("1f1b", stages, microbatches, fwd=1.0, bwd=2.0)
    holds = (microbatches >= stages and abs(3 * z.bubble_ratio - o.bubble_ratio) < 1e-9
             and z.peak_in_flight == o.peak_in_flight)
    return {"holds": holds, "zb_pct": 100 * z.bubble_ratio, "ofob_pct": 100 * o.bubble_ratio,
            "zb_peak": int(max(z.peak_in_flight))}


def p2p_total(stages, microbatches, chunks=1):
    """Point-to-point sends of one step over all ranks: 2 m (p v - 1)."""
    msgs = p2p_messages(stages, microbatches, chunks)
    return {"answer": msgs.total, "boundaries": stages * chunks - 1,
            "busiest": msgs.busiest_rank}


def send_mb(model, batch_size, seq_len):
    """MB of one activation send between pipeline stages: b s h x 2 bytes (bf16)."""
    spec = get_model(model)
    c = step_communication("pp", model=spec, pp=2, batch_size=batch_size, seq_len=seq_len)
    send = c.collectives[0]
    return {"answer": send.nbytes / MB, "h": spec.hidden_size}
