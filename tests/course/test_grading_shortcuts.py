"""Shortcuts that passed the grader, now refused (labkit.course.forbid):

1. the original behind a guard: `f.__wrapped__` (functools.wraps) of a guarded labkit function
   or of a reference (`sys.modules["labkit.course.reference"]`), or the guard's closure cell:
   a guard now keeps the original where none of its attributes lead (`_vault`), and the scan
   refuses `__wrapped__`, `__closure__`, `__globals__`, `cell_contents` and a forbidden module
   named in a string;
2. the implementation called inside an exercise that runs on ranks (labkit's or torch's DDP,
   ZeRO, shard_model, tensor-parallel layers, GPipe step, 3D parallelize), however spelled: the
   ranks of a check now guard the exercise's forbid list too (install_ranks, through
   labkit.labs.common.exercise.load_source), refusing every call made while the learner's code
   is on the stack, and a class that subclasses or borrows what it must write.
Each test here passed the shortcut before."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import nbformat
import pytest

from labkit.course import exercises as ex
from labkit.course import forbid, grader

SOLUTIONS = ex.REPO_ROOT / "solutions"
BPP = ["labkit.memory.bytes_per_param"]


def _python(script: str, *args: str, timeout: float = 300) -> str:
    done = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


# ------------------------------------------------------------------ 1. the original of a guard

@pytest.mark.parametrize("source, message", [
    ("import importlib\nm = importlib.import_module('labkit.' + 'memory')\n\n"
     "def bpp(p, o):\n    return m.bytes_per_param.__wrapped__(p, o)",
     "your bpp reads __wrapped__ (a way around the grader's guards); write it yourself"),
    ("import importlib\nm = importlib.import_module('labkit.' + 'memory')\n"
     "bpp = m.bytes_per_param.__closure__[0].cell_contents",
     "your exercise ex1 reads cell_contents (a way around the grader's guards); write it "
     "yourself"),
    ("from labkit.pipeline import simulate\nshare = simulate.__globals__['idle_share']",
     "your exercise ex1 reads __globals__ (a way around the grader's guards); write it yourself"),
    ("import sys\nref = sys.modules['labkit.course.reference']\nv = ref.model_state_bytes",
     "your exercise ex1 imports labkit.course.reference; write it yourself"),
    ("import importlib\nddp = importlib.import_module('labkit.parallel.ddp')",
     "your exercise ex1 imports labkit.parallel.ddp; write it yourself"),
])
def test_scan_refuses_reaching_past_a_guard(source, message):
    assert forbid.scan(source, BPP + ["labkit.parallel.ddp"], "ex1") == message


NO_ORIGINAL = """
import inspect, json, sys
import torch
import labkit.memory, labkit.parallel.ddp as ddp
from torch.nn.parallel import DistributedDataParallel as DDP
originals = {"bpp": labkit.memory.bytes_per_param, "buckets": ddp.assign_buckets,
             "NaiveDDP.__init__": ddp.NaiveDDP.__init__, "DDP.forward": DDP.forward}
from labkit.course import forbid, reference
originals["reference"] = reference.model_state_bytes
forbid.install({"ex1": ["labkit.memory.bytes_per_param", "labkit.parallel.ddp",
                        "torch.nn.parallel.DistributedDataParallel"]})
guards = {"bpp": labkit.memory.bytes_per_param, "buckets": ddp.assign_buckets,
          "NaiveDDP.__init__": ddp.NaiveDDP.__init__, "DDP.forward": DDP.forward,
          "reference": reference.model_state_bytes}
out = {}
for key, g in guards.items():
    o = originals[key]
    held = [c.cell_contents for c in g.__closure__ or ()] + list(g.__globals__.values())
    out[key] = {"guarded": g is not o, "wrapped": hasattr(g, "__wrapped__"),
                "unwrap": inspect.unwrap(g) is g, "holds": any(h is o for h in held),
                "same": [g.__name__ == o.__name__, g.__doc__ == o.__doc__,
                         str(inspect.signature(g)) == str(inspect.signature(o))]}
kind = reference.by_kind(reference.layout_problem)
out["by_kind"] = {"wrapped": hasattr(kind, "__wrapped__"), "name": kind.__name__}
print(json.dumps(out))
"""


def test_a_guard_hands_out_no_original():
    out = json.loads(_python(NO_ORIGINAL).splitlines()[-1])
    for key in ("bpp", "buckets", "NaiveDDP.__init__", "DDP.forward", "reference"):
        assert out[key] == {"guarded": True, "wrapped": False, "unwrap": True, "holds": False,
                            "same": [True, True, True]}, key
    assert out["by_kind"] == {"wrapped": False, "name": "layout_problem"}


THROUGH_A_GUARD = """
import sys
from labkit.course import forbid
import labkit.memory as m
forbid.install({"ex1": ["labkit.memory.bytes_per_param"]})
forbid._LEARNER["<answer ex1>"] = "ex1"
g = m.bytes_per_param
learner = compile(
    "import functools\\n"
    "def direct():\\n    return g('fp32', 'adamw')\\n"
    "def through_functools():\\n    return functools.singledispatch(g)('fp32', 'adamw')\\n"
    "def through_the_vault():\\n"
    "    enter = getattr(g, '__glob' + 'als__')['_enter']\\n"
    "    key = getattr(getattr(g, '__clo' + 'sure__')[0], 'cell_' + 'contents')\\n"
    "    return enter(key)('fp32', 'adamw')\\n",
    "<answer ex1>", "exec")
ns = {"g": g}
exec(learner, ns)
for name in ("direct", "through_functools", "through_the_vault"):
    try:
        print(name, ns[name]())
    except forbid.ForbiddenCall as exc:
        print(name, exc)
"""


def test_calling_a_guard_or_its_vault_is_refused_however_passed_on():
    out = _python(THROUGH_A_GUARD).splitlines()
    assert out == [
        "direct your direct calls labkit.memory.bytes_per_param; write it yourself",
        "through_functools your through_functools calls labkit.memory.bytes_per_param; "
        "write it yourself",
        "through_the_vault your exercise ex1 reaches into the grader's guards; write it "
        "yourself"]


# a course of one solutions notebook's exercise: its set-up cells, the exercise, its checks

def _one_exercise(tmp_path: Path, solution: str, exercise: str, answer: str) -> tuple[Path, Path]:
    nb = ex.read_notebook(SOLUTIONS / solution)
    lay = ex.layout(nb)
    target = lay.exercise(exercise).index
    others = {e.index for e in lay.exercises} | {c.index for c in lay.checks}
    mine = {c.index for c in lay.checks if c.exercise == exercise}
    cells = [c for i, c in enumerate(nb.cells) if c.cell_type == "code" and (
        i == target or i in mine or (i not in others and i < target))]
    template = tmp_path / "solutions" / solution
    template.parent.mkdir()
    nbformat.write(nbformat.v4.new_notebook(cells=cells, metadata=nb.metadata), str(template))
    learner = ex.render(ex.read_notebook(template), template.name)
    cell = next(c for c in learner.cells
                if c.metadata.get("labkit", {}).get("exercise") == exercise)
    cell.source = answer
    path = tmp_path / "exercises" / solution
    path.parent.mkdir()
    nbformat.write(learner, str(path))
    return path, template


def _course(tmp_path: Path, answers: dict[str, str], forbid=BPP) -> tuple[Path, Path]:
    v4 = nbformat.v4
    setup = "from labkit.course import grading\nfrom labkit.course import reference"
    check = ("grading.check_int('{0}', {0}, reference.model_state_bytes('bf16-mixed', 'adamw'))")
    cells = [v4.new_code_cell(setup)]
    for name in answers:
        cells += [v4.new_code_cell(f"### BEGIN SOLUTION\n{name} = 16\n### END SOLUTION",
                                   metadata={"tags": ["exercise"], "labkit": {"forbid": forbid}}),
                  v4.new_code_cell(check.format(name), metadata={"tags": ["check"]})]
    template = tmp_path / "solutions" / "96_shortcuts.ipynb"
    template.parent.mkdir()
    nbformat.write(v4.new_notebook(cells=cells), str(template))
    learner = ex.render(ex.read_notebook(template), template.name)
    sources = iter(answers.values())
    for cell in learner.cells:
        if "exercise" in cell.metadata.get("tags", []):
            cell.source = next(sources)
    path = tmp_path / "exercises" / template.name
    path.parent.mkdir()
    nbformat.write(learner, str(path))
    return path, template


MEMORY = "import importlib\nm = importlib.import_module('labkit.' + 'memory')\n"
REFERENCE = "import sys\nref = sys.modules['labkit.course.' + 'reference']\n"


@pytest.mark.notebook
def test_the_original_behind_a_guard_is_out_of_reach_in_the_kernel(tmp_path):
    path, template = _course(tmp_path, {
        "wrapped": MEMORY + "wrapped = getattr(getattr(m, 'bytes_per' + '_param'), '__wrap' + "
                            "'ped__')('bf16-mixed', 'adamw')",
        "via_reference": REFERENCE + "via_reference = getattr(ref.model_state_bytes, '__wrap' + "
                                     "'ped__')('bf16-mixed', 'adamw')",
        "cell": REFERENCE + "cells = getattr(ref.model_state_bytes, '__clo' + 'sure__')\n"
                            "cell = [getattr(c, 'cell_' + 'contents') for c in cells\n"
                            "        if callable(getattr(c, 'cell_' + 'contents'))][0]"
                            "('bf16-mixed', 'adamw')",
        # a guard handed to code that calls it (passed before: only the direct caller counted)
        "callback": MEMORY + "import numpy as np\n"
                             "callback = int(np.vectorize(getattr(m, 'bytes_per' + '_param'), "
                             "otypes=[object])('bf16-mixed', 'adamw'))",
        "honest": "honest = 2 + 2 + 4 + 4 + 4"})
    report = grader.grade_notebook(path, template=template, timeout=60)
    wrapped, reference, cell, callback, honest = report.checks      # in the answers' order
    assert "no attribute '__wrapped__'" in wrapped.message
    assert "no attribute '__wrapped__'" in reference.message
    assert "IndexError" in cell.message
    assert callback.message == ("your exercise ex4 calls labkit.memory.bytes_per_param; "
                                "write it yourself"), callback.message
    assert honest.passed, report.format()
    assert (report.passed, report.total) == (1, 5)


BUBBLE = """from dataclasses import asdict

from labkit.pipeline import simulate


def step_idle_share(events):
    share = getattr(simulate, '__glob' + 'als__')['idle' + '_share']
    return getattr(share, '__wrap' + 'ped__')(events)


bubble_4x8 = step_idle_share([asdict(e) for e in simulate("1f1b", 4, 8).events])
ratio_4x8 = bubble_4x8 / (1 - bubble_4x8)
"""


@pytest.mark.notebook
def test_07_bubble_cannot_unwrap_labkits_idle_share(tmp_path):
    path, template = _one_exercise(tmp_path, "07_pipeline_parallel.ipynb", "bubble", BUBBLE)
    report = grader.grade_notebook(path, template=template, timeout=90)
    assert [e.status for e in report.exercises] == ["error"], report.format()
    assert "no attribute '__wrapped__'" in report.exercises[0].message
    assert report.passed == 0 and report.total > 0


# -------------------------------------------------------------- 2. the implementation on ranks

RANKS = """
import importlib.util, json, sys
from labkit.course import exercises as ex, forbid
solution, exercise, path, call = sys.argv[1:5]
lay = ex.layout(ex.read_notebook(solution))
forbid.install({e.id: list(e.forbid) for e in lay.exercises})     # as the grading kernel does
forbid._LEARNER[path] = exercise                                   # forbid.expect's record
forbid._CURRENT.append(exercise)
spec = importlib.util.spec_from_file_location("answer", path)
answer = importlib.util.module_from_spec(spec)
spec.loader.exec_module(answer)
ns = vars(answer)
exec(call, ns)
print(json.dumps({"problems": ns["r"].problems(), "trips": json.loads(forbid.trips())}))
"""

ANSWERS = {   # id: (solution, exercise, answer, call, expected refusal); each passed before
    "03 NaiveDDP, torch's DistributedDataParallel": (
        "03_ddp.ipynb", "naive_ddp", """
        import importlib
        import torch.distributed as dist
        from torch import nn

        class NaiveDDP(nn.Module):
            def __init__(self, module):
                super().__init__()
                self.module, self.inner = module, []    # a list: not a submodule the lab sees
                if dist.is_initialized():
                    parallel = importlib.import_module("torch.nn." + "parallel")
                    self.inner.append(getattr(parallel, "Distributed" + "DataParallel")(module))

            def forward(self, *args, **kwargs):
                return self.inner[0](*args, **kwargs)

            def finish_gradient_synchronization(self):
                pass
        """, "from labkit.labs.ddp.exercise import run_user_ddp; r = run_user_ddp(NaiveDDP)",
        "your NaiveDDP.__init__ calls torch.nn.parallel.DistributedDataParallel; write it "
        "yourself"),
    "03 NaiveDDP, labkit's method borrowed": (
        "03_ddp.ipynb", "naive_ddp", """
        import importlib
        import torch.distributed as dist
        from torch import nn

        class NaiveDDP(nn.Module):
            def __init__(self, module):
                super().__init__()
                self.module, self.world_size = module, dist.get_world_size()
                for t in [*module.parameters(), *module.buffers()]:
                    dist.broadcast(t.data, src=0)
                self._params, self._sync = [p for p in module.parameters() if p.requires_grad], True

            def forward(self, *args, **kwargs):
                return self.module(*args, **kwargs)

            def _grad(self, i):
                return self._params[i].grad

            finish_gradient_synchronization = getattr(importlib.import_module(
                "labkit.parallel." + "ddp"), "Naive" + "DDP").finish_gradient_synchronization
        """, "from labkit.labs.ddp.exercise import run_user_ddp; r = run_user_ddp(NaiveDDP)",
        "your NaiveDDP.finish_gradient_synchronization is "
        "labkit.parallel.ddp.NaiveDDP.finish_gradient_synchronization; write it yourself"),
    "04 ZeRO1, labkit's ShardedOptimizer": (
        "04_zero.ipynb", "zero1", """
        import importlib
        import torch.distributed as dist

        class ZeRO1:
            def __init__(self, params, optimizer_class, **defaults):
                self.params = list(params)
                if dist.is_initialized():
                    zero = importlib.import_module("labkit.parallel." + "zero")
                    self.inner = getattr(zero, "Sharded" + "Optimizer")(
                        self.params, optimizer_class, reduce_gradients=True, **defaults)

            def step(self):
                self.inner.step()
        """, "from labkit.labs.zero.exercise import run_user_zero1; r = run_user_zero1(ZeRO1)",
        "your ZeRO1.__init__ calls labkit.parallel.zero.ShardedOptimizer; write it yourself"),
    "05 shard_per_block, labkit's shard_model": (
        "05_fsdp.ipynb", "wrap", """
        import importlib
        import torch.distributed as dist

        def shard_per_block(model):
            if dist.is_initialized():
                fsdp = importlib.import_module("labkit.parallel." + "fsdp")
                getattr(fsdp, "shard" + "_model")(model)
            return model
        """, "from labkit.labs.fsdp.exercise import run_user_wrap; "
             "r = run_user_wrap(shard_per_block, nproc=2)",
        "your shard_per_block calls labkit.parallel.fsdp.shard_model; write it yourself"),
    "06 ColumnParallel, labkit's ColumnParallelLinear": (
        "06_tensor_parallel.ipynb", "column", """
        import importlib
        import torch.distributed as dist
        from torch import nn

        class ColumnParallel(nn.Module):
            def __init__(self, linear):
                super().__init__()
                if dist.is_initialized():
                    tp = importlib.import_module("labkit.parallel." + "tensor_linear")
                    self.inner = getattr(tp, "ColumnParallel" + "Linear")(linear.weight,
                                                                         linear.bias)
                    self.weight, self.bias = self.inner.weight, self.inner.bias

            def forward(self, x):
                return self.inner(x)
        """, "from labkit.labs.tp.exercise import run_user_column; "
             "r = run_user_column(ColumnParallel)",
        "your ColumnParallel.__init__ calls labkit.parallel.tensor_linear.ColumnParallelLinear"
        "; write it yourself"),
    "06 F and G, labkit's f and g": (
        "06_tensor_parallel.ipynb", "conjugates", """
        import importlib
        import torch
        import torch.distributed as dist

        def comms():
            return importlib.import_module("labkit.parallel." + "tensor_comms")

        class F(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x):
                ctx.group = None
                return x.view_as(x)

            @staticmethod
            def backward(ctx, grad):
                return comms().f.backward(ctx, grad)[0] if dist.is_initialized() else grad

        class G(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x):
                return comms().g.forward(ctx, x) if dist.is_initialized() else x

            @staticmethod
            def backward(ctx, grad):
                return grad
        """, "from labkit.labs.tp.exercise import run_user_conjugates; "
             "r = run_user_conjugates(F, G)",
        "your F.backward calls labkit.parallel.tensor_comms.f.backward; write it yourself"),
    "07 gpipe_step, labkit's gpipe_step": (
        "07_pipeline_parallel.ipynb", "gpipe", """
        import importlib
        import torch.distributed as dist

        def gpipe_step(stage, inputs, targets, loss_fn, shape):
            if not dist.is_initialized():
                return None
            pipe = importlib.import_module("labkit.parallel." + "pipe")
            loss, _ = getattr(pipe, "gpipe" + "_step")(
                stage, list(zip(inputs, targets)), rank=dist.get_rank(),
                world=dist.get_world_size(), loss_fn=loss_fn)
            return None if loss is None else float(loss)
        """, "from labkit.labs.pp.exercise import run_user_gpipe; r = run_user_gpipe(gpipe_step)",
        "your gpipe_step calls labkit.parallel.pipe.gpipe_step; write it yourself"),
    "08 parallelize_2d, labkit's parallelize": (
        "08_3d_parallelism.ipynb", "compose", """
        import importlib

        def parallelize_2d(model, mesh):
            if mesh is not None:
                mesh_mod = importlib.import_module("labkit.parallel." + "mesh")
                getattr(mesh_mod, "parallel" + "ize")(model, mesh, vocab_parallel=False)
            return model
        """, "from labkit.labs.threed.exercise import run_user_2d; "
             "r = run_user_2d(parallelize_2d, nproc=4)",
        "your parallelize_2d calls labkit.parallel.mesh.parallelize; write it yourself"),
    "10 dispatch_combine, labkit's ExpertParallelMoE": (
        "10_mixture_of_experts.ipynb", "dispatch", """
        import importlib
        import torch.distributed as dist

        def dispatch_combine(x, expert, num_experts, expert_fn):
            if not dist.is_initialized():
                return x
            ep = getattr(importlib.import_module("labkit.parallel." + "expert"),
                         "ExpertParallel" + "MoE")
            ep()
            return x
        """, "from labkit.labs.dispatch import run_user_dispatch; "
             "r = run_user_dispatch(dispatch_combine, nproc=2)",
        "your dispatch_combine calls labkit.parallel.expert.ExpertParallelMoE; write it "
        "yourself"),
}


@pytest.mark.multirank
@pytest.mark.slow
@pytest.mark.parametrize("case", list(ANSWERS), ids=list(ANSWERS))
def test_ranks_refuse_what_the_exercise_asks_to_write(case, tmp_path):
    solution, exercise, answer, call, message = ANSWERS[case]
    path = tmp_path / "answer.py"
    path.write_text(textwrap.dedent(answer).lstrip())
    out = json.loads(_python(RANKS, str(SOLUTIONS / solution), exercise, str(path), call,
                             timeout=400).splitlines()[-1])
    assert out["trips"] == {exercise: message}      # the exercise's status: "refused"
    assert out["problems"] and set(out["problems"]) == {message}


NAIVE_DDP = """import importlib

import torch.distributed as dist
from torch import nn


class NaiveDDP(nn.Module):
    def __init__(self, module):
        super().__init__()
        self.module, self.inner = module, []
        if dist.is_initialized():           # on the ranks (not in the kernel's first try)
            parallel = importlib.import_module("torch.nn." + "parallel")
            self.inner.append(getattr(parallel, "Distributed" + "DataParallel")(module))

    def forward(self, *args, **kwargs):
        return self.inner[0](*args, **kwargs)

    def finish_gradient_synchronization(self):
        pass
"""


@pytest.mark.notebook
@pytest.mark.multirank
@pytest.mark.slow
def test_03_naive_ddp_cannot_run_torchs_ddp_on_the_ranks(tmp_path):
    path, template = _one_exercise(tmp_path, "03_ddp.ipynb", "naive_ddp", NAIVE_DDP)
    report = grader.grade_notebook(path, template=template, timeout=90)
    message = ("your NaiveDDP.__init__ calls torch.nn.parallel.DistributedDataParallel; write it "
               "yourself")
    assert [(e.status, e.message) for e in report.exercises] == [("refused", message)]
    assert report.passed == 0 and {c.message for c in report.checks} == {message}


# --------------------------------------------------- the rank guard, without ranks (fast)

RANK_GUARD = """
import json, os, sys
from labkit.labs.common import exercise as shared
os.environ[shared.RANK_FORBID] = json.dumps(["labkit.parallel.ddp",
                                             "torch.nn.parallel.DistributedDataParallel"])
os.environ[shared.RANK_GUARD] = "labkit.course.forbid"
from labkit.course import forbid
path, name, *calls = sys.argv[1:]
out = {}
loaded = shared.load_source(path, name)
for call in calls:
    try:
        out[call] = loaded.__globals__[call]()              # the answer's namespace
    except forbid.ForbiddenCall as exc:
        out[call] = str(exc)
if not calls:
    try:
        loaded(None)                                      # as the lab builds the class
    except forbid.ForbiddenCall as exc:
        out["load"] = str(exc)
import labkit.parallel.ddp as ddp                  # the lab itself (no learner's code): allowed
out["lab"] = ddp.assign_buckets([4, 4], 1.0)
out["first"] = forbid.rank_refusal()
print(json.dumps(out))
"""

GUARDED_CALLS = """
import importlib
import threading

import torch


def _buckets():
    return getattr(importlib.import_module("labkit.parallel." + "ddp"), "assign_" + "buckets")


def in_a_thread():         # the refusal is raised in the thread, and remembered
    thread = threading.Thread(target=_buckets(), args=([4, 4], 1.0))
    thread.start()
    thread.join()
    return "ran"


def direct():
    return _buckets()([4, 4], 1.0)


def through_torch():       # torch calls it, not the learner's code: still the learner's call
    return torch.nn.Module().apply(_buckets())


def caught():
    try:
        return _buckets()([4], 1.0)
    except Exception:
        return "hidden"
"""

BORROWED = """
import importlib
from torch import nn

class NaiveDDP(getattr(importlib.import_module("torch.nn.parallel"), "DistributedDataParallel")):
    pass
"""


def test_the_rank_guard_refuses_the_learners_calls_however_made(tmp_path):
    path = tmp_path / "answer.py"
    path.write_text(GUARDED_CALLS)
    out = json.loads(_python(RANK_GUARD, str(path), "in_a_thread", "in_a_thread", "direct",
                             "through_torch", "caught").splitlines()[-1])
    call = "calls labkit.parallel.ddp.assign_buckets; write it yourself"
    assert out["first"] == f"your in_a_thread {call}"     # the thread's: named by the answer
    assert out["in_a_thread"] == "ran"
    assert out["direct"] == f"your direct {call}"
    assert out["through_torch"] == f"your through_torch {call}"
    assert out["caught"] == "hidden"                  # caught, and still remembered (first)
    assert out["lab"] == [[1, 0]]


def test_the_rank_guard_refuses_a_class_built_on_the_answer(tmp_path):
    path = tmp_path / "answer.py"
    path.write_text(BORROWED)
    out = json.loads(_python(RANK_GUARD, str(path), "NaiveDDP").splitlines()[-1])
    message = ("your NaiveDDP subclasses torch.nn.parallel.DistributedDataParallel; write it "
               "yourself")
    assert out["load"] == message and out["first"] == message


def _ring(tmp_path, answer: str) -> dict:
    """The trips and problems of module 02's ring lab on `answer`, graded as the kernel does."""
    path = tmp_path / "answer.py"
    path.write_text(answer)
    script = RANKS.replace('ns["r"].problems()', '[p for p in ns["r"].problems if p]')
    return json.loads(_python(script, str(SOLUTIONS / "02_collectives.ipynb"), "ring_all_reduce",
                              str(path), "from labkit.labs.ring import run_user_collective; "
                              "r = run_user_collective(ring_all_reduce, nproc=2)",
                              timeout=300).splitlines()[-1])


RING_ALIAS = """
import torch.distributed as dist
from torch.distributed import all_reduce as _summed    # taken before the lab's refusals


def ring_all_reduce(tensor):
    _summed(tensor)
    return tensor
"""


@pytest.mark.multirank
def test_02_ring_ranks_are_guarded_as_the_others(tmp_path):
    """A ring that took torch's all_reduce under another name when its file was loaded: the
    ranks of module 02's lab guard the exercise's list too (rank_guard), as every other lab's."""
    out = _ring(tmp_path, RING_ALIAS)
    message = "your ring_all_reduce calls torch.distributed.all_reduce; write it yourself"
    assert out["trips"] == {"ring_all_reduce": message}
    assert out["problems"] and set(out["problems"]) == {message}


@pytest.mark.notebook
def test_an_answer_may_not_start_programs_while_graded(tmp_path):
    """`cat`, `git show`, a shell glob read what the kernel's audit hook guards (the solutions,
    the judge's cache): an answer that starts a program is refused; a lab a check starts is
    labkit's and runs."""
    path, template = _course(tmp_path, {
        "popen": "import subprocess\npopen = int(subprocess.run(['echo', '16'], "
                 "capture_output=True, text=True).stdout)",
        "shell": "out = get_ipython().getoutput('echo 16')\nshell = int(out[0])",
        "system": "import os\nos.system('true')\nsystem = 16",
        "honest": "honest = 2 + 2 + 4 + 4 + 4"})
    report = grader.grade_notebook(path, template=template, timeout=60)
    popen, shell, system, honest = report.checks
    for check, what in ((popen, "['echo', '16']"), (shell, "echo 16"), (system, "true")):
        assert check.message.startswith(f"your exercise {check.name} starts a program "), \
            check.message
        assert what in check.message, check.message
    assert honest.passed, report.format()


# ---------------------------------------------- the second red-team pass (issue 30), refused

RED_TEAM = {   # answer -> the start of its check's message; each passed the grader before
    "proc_root": ("import os\nbase = '/proc/self/root' + os.environ['LABKIT_JUDGE_CACHE']\n"
                  "os.makedirs(base, exist_ok=True)\nopen(os.path.join(base, 'x.json'), 'w')\n"
                  "proc_root = 16", "your exercise ex1 writes into the solutions ("),
    "ctypes_": ("import ctypes\nctypes_ = 16 + 0 * ctypes.CDLL(None).getpid()",
                "your exercise ex2 uses ctypes (ctypes.dl"),
    "private": ("from labkit.plots.zero import _per_param\nprivate = int(sum(_per_param("
                "'bf16-mixed', 'adamw')))", "your exercise ex3 reads labkit.plots.zero._per_param"),
    "quiz": ("from labkit.quiz.answers_memory import states_per_param\n"
             "quiz = states_per_param('bf16-mixed', 'adamw')['answer']",
             "your exercise ex4 imports labkit.quiz"),
    "own_files": ("import os, labkit\nopen(os.path.join(os.path.dirname(labkit.__file__), "
                  "'zz_red_team.txt'), 'w')\nown_files = 16",
                  "your exercise ex5 writes labkit's own files"),
    "seal_run": ("import sys\nseal = sys.modules['labkit.course.seal']\nrun = seal.run\n"
                 "seal.run = lambda i, s, check=False: run(i, s.replace('==', '!='), check)\n"
                 "seal_run = 0", "your exercise ex6 changes labkit.course.seal.run"),
    "honest": ("honest = 2 + 2 + 4 + 4 + 4", None),
}


@pytest.mark.notebook
def test_the_second_red_team_passs_shortcuts_are_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("LABKIT_JUDGE_CACHE", str(tmp_path / "judge"))
    path, template = _course(tmp_path, {k: a for k, (a, _) in RED_TEAM.items()})
    (tmp_path / "link").symlink_to(template.parent)
    try:
        report = grader.grade_notebook(path, template=template, timeout=60)
    finally:
        stray = Path(grader.__file__).resolve().parents[1] / "zz_red_team.txt"
        written = stray.exists()
        stray.unlink(missing_ok=True)
    assert not written
    assert not list((tmp_path / "judge").glob("x.json"))
    for check, (_, message) in zip(report.checks, RED_TEAM.values()):
        if message is None:
            assert check.passed, report.format()
        else:
            assert check.message.startswith(message), (check.name, check.message)


@pytest.mark.notebook
def test_a_link_or_proc_root_to_the_solutions_is_refused(tmp_path):
    path, template = _course(tmp_path, {"via_link": "via_link = 16", "honest": "honest = 16"})
    (path.parent / "answers").symlink_to(template.parent)
    nb = nbformat.read(str(path), as_version=4)
    cell = next(c for c in nb.cells if "via_link = 16" in c.source)
    cell.source = (f"import os\nopen(os.path.join('answers', {template.name!r})).read()\n"
                   f"open('/proc/self/root' + {str(template)!r}).read()\nvia_link = 16")
    nbformat.write(nb, str(path))
    report = grader.grade_notebook(path, template=template, timeout=60)
    assert report.checks[0].message.startswith("your exercise ex1 reads the solutions ("), \
        report.checks[0].message
    assert report.checks[1].passed


TRANSFORMER = """import re
import sys

def lift(lines):
    text = ''.join(lines)
    if 'seal' in text and 'check=True' in text:
        return [re.sub(r"grading\\.check\\('ex1', [^,]+,", "grading.check('ex1', True,", text)]
    return lines

get_ipython().input_transformers_post.append(lift)
ex1 = 0
"""


@pytest.mark.notebook
def test_a_transformer_that_rewrites_a_check_is_caught(tmp_path):
    """The red team's input transformer: every `grading.check(name, COND, ...)` of the check
    cells rewritten to True. The seal runs only the cells the grader sent (their digests)."""
    v4 = nbformat.v4
    cells = [v4.new_code_cell("from labkit.course import grading"),
             v4.new_code_cell("### BEGIN SOLUTION\nex1 = 16\n### END SOLUTION",
                              metadata={"tags": ["exercise"]}),
             v4.new_code_cell("grading.check('ex1', ex1 == 16, 'ex1 is not 16')",
                              metadata={"tags": ["check"]})]
    template = tmp_path / "solutions" / "97_transformer.ipynb"
    template.parent.mkdir()
    nbformat.write(v4.new_notebook(cells=cells), str(template))
    learner = ex.render(ex.read_notebook(template), template.name)
    next(c for c in learner.cells if "exercise" in c.metadata.get("tags", [])).source = \
        TRANSFORMER
    path = tmp_path / "exercises" / template.name
    path.parent.mkdir()
    nbformat.write(learner, str(path))
    report = grader.grade_notebook(path, template=template, timeout=60)
    assert not report.checks[0].passed
    assert "was changed before it ran" in report.checks[0].message, report.checks[0].message


RING_PATCH = """
import sys


def ring_all_reduce(tensor):
    sys.modules["labkit.runtime.dist"].report = lambda **metrics: None
    return tensor
"""


@pytest.mark.multirank
def test_02_ranks_refuse_a_patch_of_the_labs_own_code(tmp_path):
    """The red team's rank trick: the answer replaces what the lab reports with (every lab
    reports through labkit.runtime.dist.report). labkit's modules are frozen in the ranks too."""
    out = _ring(tmp_path, RING_PATCH)
    message = ("your exercise ring_all_reduce changes labkit.runtime.dist.report, labkit's own "
               "(a way around the grader's guards); write it yourself")
    assert out["trips"] == {"ring_all_reduce": message}
    assert out["problems"] and set(out["problems"]) == {message}


# ----------------------------------------------- the third red-team pass (issue 30), refused

THIRD = {   # answer -> the start of its check's message; each passed the grader before
    "public_path": ("from labkit.plots.zero import figure1_rows\npublic_path = int(figure1_rows("
                    "1, 1, 'bf16-mixed', 'adamw')[0]['total'])",
                    "your exercise ex1 calls labkit.memory.estimate_memory"),
    "pooled": ("import importlib\nfrom concurrent.futures import ThreadPoolExecutor\n"
               "m = importlib.import_module('labkit.' + 'memory')\n"
               "pooled = ThreadPoolExecutor(1).submit(getattr(m, 'bytes_per' + '_param'), "
               "'bf16-mixed', 'adamw').result()",
               "your exercise ex2 calls labkit.memory.bytes_per_param"),
    "lab_started": ("import os, sys, tempfile\nfrom labkit.runtime.launch import run_lab\n"
                    "script = os.path.join(tempfile.mkdtemp(), 'peek.py')\n"
                    "open(script, 'w').write('print(1)')\n"
                    "run_lab(script, nproc=1, timeout=60)\nlab_started = 16",
                    "your exercise ex3 starts a program"),
    "compiled": ("f = lambda: 16\ncells = eval('f.__clo' + 'sure__')\ncompiled = 16",
                 "your exercise ex4 compiles code that reads __closure__"),
    "patched_json": ("import json\njson.dumps = lambda *a, **k: '{}'\npatched_json = 16",
                     "your exercise ex5 changes json.dumps"),
    # last: its callback runs after every later cell, each refused the same way
    "second_copy": ("import functools, importlib.util, os, sys, labkit\n"
                    "spec = importlib.util.spec_from_file_location('mymemory', os.path.join("
                    "os.path.dirname(labkit.__file__), 'memory.py'))\n"
                    "mine = importlib.util.module_from_spec(spec)\n"
                    "sys.modules['mymemory'] = mine\n"
                    "get_ipython().events.register('post_execute', functools.partial("
                    "spec.loader.exec_module, mine))\nsecond_copy = 0",
                    "your exercise ex6 runs a second copy of labkit.memory"),
}


@pytest.mark.notebook
def test_the_third_red_team_passs_shortcuts_are_refused(tmp_path):
    path, template = _course(tmp_path, {k: a for k, (a, _) in THIRD.items()},
                             forbid=BPP + ["labkit.memory.estimate_memory"])
    report = grader.grade_notebook(path, template=template, timeout=90)
    for check, (_, message) in zip(report.checks, THIRD.values()):
        if message is None:
            assert check.passed, report.format()
        else:
            assert check.message.startswith(message), (check.name, check.message)


RING_TORCH = """
import torch


def ring_all_reduce(tensor):
    torch.equal = lambda a, b: True
    return tensor
"""


@pytest.mark.multirank
def test_02_ranks_refuse_a_patch_of_torch_the_lab_compares_with(tmp_path):
    out = _ring(tmp_path, RING_TORCH)
    message = ("your exercise ring_all_reduce changes torch.equal (the checks and the labs rely "
               "on it); write it yourself")
    assert out["trips"] == {"ring_all_reduce": message}
