"""Module 07's exercises: the GPipe runner (labkit.labs.pp.exercise), where a learner's
hand-built GPipe step reaches the ranks and is compared with the whole model on one process
(loss, gradients), with labkit's simulator (the order of forwards and backwards) and with the
messages a pipeline must send, every usual mistake coming back as a sentence with its numbers;
and the references the check cells use."""
from __future__ import annotations

import pytest
import torch

from labkit.course import reference
from labkit.labs.pp.exercise import run_user_gpipe

# ----------------------------------------------------------------------- learners' answers
# (module level, so that the runner finds their source in this file)

import torch.distributed as dist                                            # noqa: E402


def gpipe(stage, inputs, targets, loss_fn, shape):
    rank, world = dist.get_rank(), dist.get_world_size()
    m, last = len(inputs), dist.get_rank() == dist.get_world_size() - 1
    ins, outs = [], []
    for j in range(m):
        if rank == 0:
            x = inputs[j]
        else:
            x = torch.empty(shape)
            dist.recv(x, rank - 1)
            x.requires_grad_()
        y = stage(x)
        if last:
            y = loss_fn(y, targets[j]) / m
        else:
            dist.send(y.detach(), rank + 1)
        ins.append(x)
        outs.append(y)
    for j in range(m):
        if last:
            outs[j].backward()
        else:
            g = torch.empty(shape)
            dist.recv(g, rank + 1)
            outs[j].backward(g)
        if rank > 0:
            dist.send(ins[j].grad, rank - 1)
    return sum(float(y) for y in outs) if last else None


def gpipe_batched(stage, inputs, targets, loss_fn, shape):
    """The same with dist.P2POp and batch_isend_irecv."""
    rank, world = dist.get_rank(), dist.get_world_size()
    m, last = len(inputs), rank == world - 1

    def move(op, tensor, peer):
        for work in dist.batch_isend_irecv([dist.P2POp(op, tensor, peer)]):
            work.wait()

    ins, outs = [], []
    for j in range(m):
        x = inputs[j] if rank == 0 else torch.empty(shape)
        if rank:
            move(dist.irecv, x, rank - 1)
            x.requires_grad_()
        y = stage(x)
        if last:
            y = loss_fn(y, targets[j]) / m
        else:
            move(dist.isend, y.detach(), rank + 1)
        ins.append(x)
        outs.append(y)
    for j in range(m):
        g = None if last else torch.empty(shape)
        if not last:
            move(dist.irecv, g, rank + 1)
        outs[j].backward(g)
        if rank:
            move(dist.isend, ins[j].grad, rank - 1)
    return torch.stack([y.detach() for y in outs]).sum() if last else None


def gpipe_summed(stage, inputs, targets, loss_fn, shape):
    """Forgets to divide each micro-batch's loss by m."""
    rank, world = dist.get_rank(), dist.get_world_size()
    m, last = len(inputs), rank == world - 1
    ins, outs = [], []
    for j in range(m):
        x = inputs[j] if rank == 0 else torch.empty(shape)
        if rank:
            dist.recv(x, rank - 1)
            x.requires_grad_()
        y = stage(x)
        if last:
            y = loss_fn(y, targets[j])
        else:
            dist.send(y.detach(), rank + 1)
        ins.append(x)
        outs.append(y)
    for j in range(m):
        g = None if last else torch.empty(shape)
        if not last:
            dist.recv(g, rank + 1)
        outs[j].backward(g)
        if rank:
            dist.send(ins[j].grad, rank - 1)
    return sum(float(y) for y in outs) if last else None


def one_at_a_time(stage, inputs, targets, loss_fn, shape):
    """Each micro-batch's forward then its backward (no pipelining): right loss and gradients,
    but not GPipe's order."""
    rank, world = dist.get_rank(), dist.get_world_size()
    m, last, total = len(inputs), rank == world - 1, 0.0
    for j in range(m):
        x = inputs[j] if rank == 0 else torch.empty(shape)
        if rank:
            dist.recv(x, rank - 1)
            x.requires_grad_()
        y = stage(x)
        if last:
            y = loss_fn(y, targets[j]) / m
            total += float(y)
            y.backward()
        else:
            dist.send(y.detach(), rank + 1)
            g = torch.empty(shape)
            dist.recv(g, rank + 1)
            y.backward(g)
        if rank:
            dist.send(x.grad, rank - 1)
    return total if last else None


def broadcast_pipeline(stage, inputs, targets, loss_fn, shape):
    """Moves activations with a collective."""
    x = torch.empty(shape)
    dist.broadcast(x, 0)
    return None


def loss_everywhere(stage, inputs, targets, loss_fn, shape):
    out = gpipe(stage, inputs, targets, loss_fn, shape)
    return 0.0 if out is None else out


def no_backward_sends(stage, inputs, targets, loss_fn, shape):
    """Never sends the gradients back: the earlier stages wait forever."""
    rank, world = dist.get_rank(), dist.get_world_size()
    for j in range(len(inputs)):
        x = inputs[j] if rank == 0 else torch.empty(shape)
        if rank:
            dist.recv(x, rank - 1)
        y = stage(x)
        if rank < world - 1:
            dist.send(y.detach(), rank + 1)
    if rank < world - 1:
        g = torch.empty(shape)
        dist.recv(g, rank + 1)
    return None


def stub(stage, inputs, targets, loss_fn, shape):
    raise NotImplementedError("Exercise gpipe: write ~20 lines")


# ---------------------------------------------------------------- arguments, without ranks

def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="nproc=3: allowed 2, 4 or 8"):
        run_user_gpipe(gpipe, nproc=3)
    with pytest.raises(ValueError, match="microbatches=0 must be a whole number >= 1 and <= 32"):
        run_user_gpipe(gpipe, microbatches=0)
    with pytest.raises(ValueError, match="run_user_gpipe takes a function .* received 'f' "
                                         "\\(a str\\)"):
        run_user_gpipe("f")


def test_a_stub_fails_at_once_without_ranks():
    with pytest.raises(NotImplementedError, match="stub is not written yet"):
        run_user_gpipe(stub)


# ---------------------------------------------------------------------------- on real ranks

@pytest.mark.multirank
@pytest.mark.parametrize("fn, nproc, m", [(gpipe, 2, 4), (gpipe, 4, 3), (gpipe_batched, 4, 2)])
def test_gpipe_equals_one_process_and_holds_m_micro_batches(fn, nproc, m):
    r = run_user_gpipe(fn, nproc=nproc, microbatches=m)
    assert r.ok, r.summary()
    assert r.peak_in_flight() == [m] * nproc
    # rank 0 sends m activations to rank 1 and receives m gradients from it
    moved = sorted((kind.lstrip("i"), peer, n) for kind, peer, n in r.rows[0]["p2p"])
    assert moved == [("recv", 1, 32)] * m + [("send", 1, 32)] * m


@pytest.mark.multirank
@pytest.mark.parametrize("fn, aspect, words", [
    (gpipe_summed, "loss", "exactly 4 x the mean, the sum of the micro-batches' losses"),
    (gpipe_summed, "grads", "(scale 4 x): exactly 4 x: each micro-batch's loss must be divided"),
    (one_at_a_time, "schedule", "stage 0 ran F0 B0 F1 B1 F2 B2 F3 B3; GPipe "
                                "(labkit.pipeline.simulate) runs F0 F1 F2 F3 B0 B1 B2 B3"),
    (loss_everywhere, "loss", "rank 0 returned a float; only the last rank (1) computes"),
    (broadcast_pipeline, "runs", "your broadcast_pipeline calls torch.distributed.broadcast; "
                                 "write it yourself with dist.isend/dist.irecv"),
])
def test_mistakes_are_named_with_their_numbers(fn, aspect, words):
    r = run_user_gpipe(fn, nproc=2)
    assert not r.ok
    assert words in r.verdicts()[aspect], r.summary()
    assert f"PROBLEM: {r.verdicts()[aspect]}" in r.summary()


@pytest.mark.multirank
def test_one_at_a_time_still_matches_the_loss_and_holds_one_micro_batch():
    r = run_user_gpipe(one_at_a_time, nproc=2)
    v = r.verdicts()
    assert not v["loss"] and not v["grads"] and not v["p2p"], r.summary()
    assert r.peak_in_flight() == [1, 1]


@pytest.mark.multirank
def test_a_hang_names_the_unmatched_recv():
    from labkit.runtime.launch import LabError

    with pytest.raises(LabError, match="a rank waits in recv for a message its neighbour never "
                                       "sends"):
        run_user_gpipe(no_backward_sends, nproc=2, timeout=8)


# ------------------------------------------------------------- the references the checks use

def test_reference_min_microbatches_is_the_closed_form_away_from_boundaries():
    """The simulator's bisection agrees with (p - 1)/(v m + p - 1) <= target solved for m."""
    from labkit import pipeline

    for p, target, v in [(4, 0.08, 1), (8, 0.06, 1), (2, 0.03, 1), (16, 0.13, 1), (4, 0.9, 1),
                         (4, 0.08, 2), (8, 0.06, 4), (8, 0.3, 2)]:
        schedule = "interleaved-1f1b" if v > 1 else "1f1b"
        got = reference.pp_min_microbatches(p, target, chunks=v)
        assert got == pipeline.min_microbatches(p, target, schedule, v), (p, target, v)
        share = pipeline.simulate(schedule, p, got, chunks=v).bubble_fraction
        assert share <= target
        fewer = got - (p if v > 1 else 1)
        assert fewer < 1 or pipeline.simulate(schedule, p, fewer, chunks=v).bubble_fraction > target


def test_reference_events_keep_the_idle_share_when_shifted_or_listed_by_rank():
    plain = reference.pp_events("interleaved-1f1b", 4, 8, 2)
    moved = reference.pp_events("interleaved-1f1b", 4, 8, 2, shift=2.5, by_rank=True)
    assert [e["stage"] for e in moved] == sorted(e["stage"] for e in moved)
    assert min(e["start"] for e in moved) == 2.5
    share, ratio = reference.pp_bubble("interleaved-1f1b", 4, 8, 2)
    assert reference.pp_idle_share(plain) == pytest.approx(share, rel=1e-12)
    assert reference.pp_idle_share(moved) == pytest.approx(share, rel=1e-12)
    assert share == pytest.approx(3 / (2 * 8 + 3)) and ratio == pytest.approx(3 / 16)


@pytest.mark.parametrize("p, m", [(4, 8), (4, 3), (8, 16), (2, 1)])
def test_reference_1f1b_order_warms_up_alternates_and_bounds_memory(p, m):
    for r in range(p):
        order = reference.pp_1f1b_order(r, p, m)
        assert sorted(order) == sorted([("F", j) for j in range(m)] + [("B", j) for j in range(m)])
        warm = min(p - r - 1, m)
        assert order[:warm] == [("F", j) for j in range(warm)]
        held = [sum(1 if k == "F" else -1 for k, _ in order[:i + 1]) for i in range(2 * m)]
        assert max(held) == min(p - r, m)


def test_reference_stage_bytes_follow_the_in_flight_micro_batches():
    from labkit import pipeline

    for schedule in ("gpipe", "1f1b"):
        got = reference.pp_stage_activation_bytes(schedule, 3, 8, 10, 5.0)
        held = pipeline.activation_in_flight(schedule, 3, 8)
        assert got == [n * 5.0 * k for n, k in zip([4, 3, 3], held)]
    assert reference.pp_gpt3_stage0_gb("gpipe") / reference.pp_gpt3_stage0_gb("1f1b") == 8


# ------------------------------------------------------------------ the notebook, graded

def fresh_exercise(root, name: str = "07_pipeline_parallel.ipynb"):
    """The exercise notebook as labkit.course.exercises generates it from `root`/solutions:
    never the learner's exercises/ file, which holds their answers (issue 28, item 13: a correct
    answer there made this test fail)."""
    from labkit.course import exercises as ex

    return ex.parse_notebook(ex.render_path(root / "solutions" / name))


def test_the_graded_notebook_is_generated_not_the_learners(tmp_path):
    """A learner's answered (and run) exercise file in a course copy changes nothing here."""
    import shutil

    import nbformat

    from labkit.course import exercises as ex

    name = "07_pipeline_parallel.ipynb"
    course = tmp_path / "course"
    (course / "solutions").mkdir(parents=True)
    (course / "exercises").mkdir()
    shutil.copy(ex.REPO_ROOT / "solutions" / name, course / "solutions" / name)
    before = ex.dumps(fresh_exercise(course))
    answered = ex.read_notebook(course / "solutions" / name)     # every answer right, and run
    for cell in answered.cells:
        if cell.cell_type == "code":
            cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text="ok\n")]
    (course / "exercises" / name).write_text(ex.dumps(answered))
    assert ex.dumps(fresh_exercise(course)) == before
    assert "raise NotImplementedError" in before and "### BEGIN SOLUTION" not in before


# Seconds a cell of the graded notebook may run. The grade checks refusals and stubs, not speed:
# under load (8-15 on 2 cores) starting the kernel and the set-up cells' imports took most of the
# old 60 s. A cell that still runs past this is named by the grader ("ran longer than").
CELL_TIMEOUT = 300


@pytest.mark.notebook
@pytest.mark.multirank
def test_untouched_exercises_fail_and_shortcuts_are_refused(tmp_path):
    """Every stub fails; an answer that calls labkit's own idle share, reads 1F1B's order off
    the simulator or ZB-H1's off torch's schedule is refused, naming what it called."""
    import nbformat

    from labkit.course import exercises as ex, grader

    solution = ex.REPO_ROOT / "solutions" / "07_pipeline_parallel.ipynb"
    nb = fresh_exercise(ex.REPO_ROOT)
    lay = ex.layout(nb)
    nb.cells[lay.exercise("bubble").index].source = (
        "from labkit.pipeline import idle_share\n\nstep_idle_share = idle_share\n"
        "bubble_4x8 = ratio_4x8 = 0.0")
    nb.cells[lay.exercise("order").index].source = (
        "from labkit.pipeline import simulate\n\n\ndef one_f_one_b(stage, stages, microbatches):\n"
        "    return [(e.kind, e.microbatch) for e in simulate('1f1b', stages, microbatches).events"
        "\n            if e.stage == stage]")
    nb.cells[lay.exercise("write_zbh1").index].source = (
        "from torch.distributed.pipelining.schedules import ScheduleInterleavedZeroBubble\n\n\n"
        "def write_zbh1(stages, microbatches):\n    return ScheduleInterleavedZeroBubble")
    path = tmp_path / "07_pipeline_parallel.ipynb"
    nbformat.write(nb, str(path))
    report = grader.grade_notebook(path, template=solution, timeout=CELL_TIMEOUT)
    verdict = {c.name: c for c in report.checks}
    slow = [e.message for e in report.exercises if e.status == "timeout"] + [
        c.message for c in report.checks if "longer than" in c.message or "time limit" in c.message]
    assert not slow, (f"cells ran past {CELL_TIMEOUT} s (a loaded machine?): {slow}\n"
                      f"{report.format()}")
    assert not report.ok and not any(c.passed for c in report.checks), report.format()
    assert "bubble imports labkit.pipeline.idle_share; write it yourself" in verdict["bubble"].message
    assert "order imports labkit.pipeline; write it yourself" in verdict["order"].message
    for name in ("write_zbh1.split", "write_zbh1.memory", "write_zbh1.ranks"):
        assert ("write_zbh1 imports torch.distributed.pipelining.schedules."
                "ScheduleInterleavedZeroBubble; write it yourself") in verdict[name].message
    for name in ("microbatches", "gpipe", "memory", "write_1f1b.torch", "write_1f1b.order",
                 "write_1f1b.ranks"):
        assert "not attempted yet" in verdict[name].message, verdict[name].message


def test_a_fatal_error_is_one_problem_not_one_per_aspect():
    from labkit.labs.pp.check import ASPECTS, GPipeCheck

    check = GPipeCheck("gpipe_step", 4, 8, error="rank 1 raised ValueError: boom")
    assert check.verdicts() == dict.fromkeys(ASPECTS, "rank 1 raised ValueError: boom")
    assert check.problems() == ["rank 1 raised ValueError: boom"] and not check.ok
