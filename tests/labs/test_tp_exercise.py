"""Module 06's exercises: the tensor-parallel runner (labkit.labs.tp.exercise), where a learner's
f and g, column- and row-parallel layers reach the ranks and are compared with the definition and
with nn.Linear on one process, every usual mistake coming back as a sentence with its numbers;
and the references the check cells use."""
from __future__ import annotations

import pytest
import torch

from labkit.course import reference
from labkit.labs.tp.exercise import run_user_column, run_user_conjugates, run_user_row

# ----------------------------------------------------------------------- learners' answers
# (module level, so that the runner finds their source in this file)

import torch.distributed as dist                                            # noqa: E402
import torch.distributed.nn.functional as dnn                               # noqa: E402
from torch import nn                                                        # noqa: E402


class F(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad)
        return grad


class G(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        x = x.clone()
        dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad


class AllReduceBothWays(torch.autograd.Function):
    """g written with torch.distributed.nn.functional.all_reduce: its backward all-reduces too."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad

    @staticmethod
    def apply(x):                       # noqa: D401 - replaces Function.apply on purpose
        return dnn.all_reduce(x)


class StubF(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        raise NotImplementedError("Exercise conjugates: write ~1 line")

    @staticmethod
    def backward(ctx, grad):
        raise NotImplementedError("Exercise conjugates: write ~3 lines")


def _shard(t, dim):
    r, n = dist.get_rank(), dist.get_world_size()
    return nn.Parameter(t.detach().chunk(n, dim)[r].clone())


class Column(nn.Module):
    def __init__(self, linear):
        super().__init__()
        self.weight, self.bias = _shard(linear.weight, 0), _shard(linear.bias, 0)

    def forward(self, x):
        return nn.functional.linear(F.apply(x), self.weight, self.bias)


class ColumnNoF(Column):
    def forward(self, x):
        return nn.functional.linear(x, self.weight, self.bias)


class ColumnGathered(Column):
    def forward(self, x):
        y = nn.functional.linear(F.apply(x), self.weight, self.bias)
        return torch.cat(dnn.all_gather(y), dim=-1)


class ColumnKeepsWhole(Column):
    def __init__(self, linear):
        super().__init__(linear)
        self.whole = linear


class ColumnWrongDim(Column):
    """The weight split by columns (input features), as if nn.Linear stored (in, out)."""

    def __init__(self, linear):
        super().__init__(linear)
        self.weight = _shard(linear.weight, 1)


class Row(nn.Module):
    def __init__(self, linear):
        super().__init__()
        self.weight = _shard(linear.weight, 1)
        self.bias = nn.Parameter(linear.bias.detach().clone())

    def forward(self, x):
        return G.apply(x @ self.weight.T) + self.bias


class RowBiasEveryRank(Row):
    def forward(self, x):
        return G.apply(x @ self.weight.T + self.bias)


class RowNoG(Row):
    def forward(self, x):
        return x @ self.weight.T + self.bias


class RowWrongDim(Row):
    def __init__(self, linear):
        super().__init__(linear)
        self.weight = _shard(linear.weight, 0)


class StubRow(nn.Module):
    def __init__(self, linear):
        raise NotImplementedError("Exercise row: write ~4 lines")


# ---------------------------------------------------------------- arguments, without ranks

def _reports(shape, want_shape, error):
    cmp = {"shape": shape, "want_shape": want_shape, "diff": float("nan"), "alt": False}
    return [{"error": error, "weight": cmp}, {"error": error, "weight": cmp}]


@pytest.mark.parametrize("kind, shape, want, words", [
    ("column", [32, 4], [16, 8], "a column-parallel layer splits its output features, dim 0: "
                                 "a block of its rows"),
    ("row", [4, 32], [8, 16], "a row-parallel layer splits its input features, dim 1: a "
                              "block of its columns"),
])
def test_a_weight_split_on_the_wrong_dimension_is_diagnosed(kind, shape, want, words):
    """torch says only 'mat1 and mat2 shapes cannot be multiplied (8x8 and 4x32)': the check
    says why, from the weight's shape: nn.Linear's weight is (out, in)."""
    from labkit.labs.tp.check import LinearCheck

    error = ("your Mine raised RuntimeError: mat1 and mat2 shapes cannot be multiplied "
             "(8x8 and 4x32)")
    r = LinearCheck.from_reports(_reports(shape, want, error), kind=kind, name="Mine")
    text = r.verdicts()["runs"]
    assert text.startswith(error) and words in text, text
    assert f"Mine.weight on rank 0 has shape {shape}, not the shard's {want}" in text
    assert "(out_features, in_features)" in text
    right = LinearCheck.from_reports(_reports(want, want, "your Mine raised ValueError: x"),
                                     kind=kind, name="Mine")
    assert right.verdicts()["runs"] == "your Mine raised ValueError: x"    # nothing to add


@pytest.mark.parametrize("args, words", [
    ((F, G, 3), "nproc=3: allowed 2, 4 or 8"),
    ((F, "g", 2), "run_user_conjugates's G takes a subclass of torch.autograd.Function .* "
                  "received 'g' \\(a str\\)"),
    ((nn.Linear, G, 2), "run_user_conjugates's F takes a subclass of torch.autograd.Function"),
])
def test_bad_conjugate_arguments_are_named(args, words):
    with pytest.raises(ValueError, match=words):
        run_user_conjugates(*args)


def test_f_and_g_must_come_from_one_cell():
    with pytest.raises(ValueError, match="define F and _AllReduce in the same cell"):
        run_user_conjugates(F, dnn._AllReduce)            # a Function defined in torch


def test_bad_layer_arguments_are_named():
    with pytest.raises(ValueError, match="run_user_column takes a torch.nn.Module subclass .*"
                                         "received <function"):
        run_user_column(_shard)
    with pytest.raises(ValueError, match="run_user_row's uses= takes a tuple .* received 'F'"):
        run_user_row(Row, uses="F")
    with pytest.raises(ValueError, match="nproc=1: allowed 2, 4 or 8"):
        run_user_row(Row, nproc=1)


def test_stubs_fail_at_once_without_ranks():
    with pytest.raises(NotImplementedError, match="StubF is not written yet"):
        run_user_conjugates(StubF, G)
    with pytest.raises(NotImplementedError, match="StubRow is not written yet"):
        run_user_row(StubRow)


# ---------------------------------------------------------------------------- on real ranks

@pytest.mark.multirank
@pytest.mark.parametrize("nproc", [2, 4])
def test_f_and_g_by_their_definition_and_one_all_reduce_each(nproc):
    r = run_user_conjugates(F, G, nproc=nproc)
    assert r.ok, r.summary()
    size = 4 * 4 * 2 * 8                               # SEQ x ROWS x HIDDEN fp32
    assert r.collectives("F", "fwd") == {} and r.collectives("G", "bwd") == {}
    assert r.collectives("F", "bwd")["all_reduce"][:2] == (1, size)
    assert r.collectives("G", "fwd")["all_reduce"][:2] == (1, size)


@pytest.mark.multirank
@pytest.mark.filterwarnings("ignore:torch.distributed.nn.functional.all_reduce is deprecated")
def test_swapped_and_autograd_all_reduce_mistakes_are_named():
    swapped = run_user_conjugates(G, F, nproc=2).verdicts()
    assert "G's forward (its output) on rank" in swapped["F.forward"]
    assert "it equals the sum over ranks: that is g's forward" in swapped["F.forward"]
    assert "it equals x itself: that is f's forward" in swapped["G.forward"]
    both = run_user_conjugates(F, AllReduceBothWays, nproc=2).verdicts()
    assert not both["G.forward"]
    assert "AllReduceBothWays's backward (x.grad)" in both["G.backward"]
    assert "it equals the sum over ranks: that is f's backward" in both["G.backward"]
    assert ("AllReduceBothWays's backward issued 1 all_reduce (256 B); expected none"
            in both["collectives"])


@pytest.mark.multirank
@pytest.mark.parametrize("nproc", [2, 4])
def test_column_and_row_equal_nn_linear_with_one_all_reduce(nproc):
    col = run_user_column(Column, uses=(F,), nproc=nproc)
    assert col.ok, col.summary()
    assert col.collectives("fwd") == {} and col.collectives("bwd")["all_reduce"][0] == 1
    row = run_user_row(Row, uses=(G,), nproc=nproc)
    assert row.ok, row.summary()
    assert row.collectives("bwd") == {} and row.collectives("fwd")["all_reduce"][0] == 1
    # each rank: 1/N of the weight; the column bias split, the row bias whole
    assert [r["local_bytes"] for r in col.rows] == [4 * (8 * 32 + 32) // nproc] * nproc
    assert [r["local_bytes"] for r in row.rows] == [4 * (8 * 32 // nproc + 8)] * nproc


@pytest.mark.multirank
@pytest.mark.parametrize("cls, uses, aspect, words", [
    (ColumnNoF, (), "input_grad", "it is this rank's partial sum dy_i W_i; the backward must "
                                  "all-reduce it"),
    (ColumnNoF, (), "collectives", "the backward issued none; expected 1 all_reduce (256 B)"),
    (ColumnGathered, (F,), "output", "has shape [4, 2, 32]; expected [4, 2, 16]"),
    (ColumnGathered, (F,), "output", "it was gathered to all 32 columns; Megatron keeps it split"),
    (ColumnGathered, (F,), "collectives", "the forward issued 1 all_gather"),
    (ColumnGathered, (F,), "input_grad", "not checked: the output's shape is wrong"),
    (ColumnKeepsWhole, (F,), "shard", "a rank holds 1,728 B of parameters; expected 576 B "
                                      "(ratio 3.00)"),
])
def test_column_mistakes_are_named_with_their_numbers(cls, uses, aspect, words):
    r = run_user_column(cls, uses=uses, nproc=2)
    assert not r.ok
    assert words in r.verdicts()[aspect], r.summary()
    assert f"PROBLEM: {r.verdicts()[aspect]}" in r.summary()


@pytest.mark.multirank
@pytest.mark.parametrize("cls, nproc, aspect, words", [
    (RowBiasEveryRank, 2, "output", "exactly 1 x the bias too many: add the bias once"),
    (RowBiasEveryRank, 4, "output", "exactly 3 x the bias too many"),
    (RowNoG, 2, "output", "it is this rank's partial sum; all-reduce it (g)"),
    (RowNoG, 2, "collectives", "the forward issued none; expected 1 all_reduce (256 B)"),
])
def test_row_mistakes_are_named_with_their_numbers(cls, nproc, aspect, words):
    r = run_user_row(cls, uses=(G,), nproc=nproc)
    assert not r.ok
    assert words in r.verdicts()[aspect], r.summary()


@pytest.mark.multirank
@pytest.mark.parametrize("run, cls, uses", [(run_user_column, ColumnWrongDim, (F,)),
                                            (run_user_row, RowWrongDim, (G,))])
def test_a_weight_split_on_the_wrong_dimension_is_explained_on_the_ranks(run, cls, uses):
    r = run(cls, uses=uses, nproc=2)
    text = r.verdicts()["runs"]
    assert "mat1 and mat2 shapes cannot be multiplied" in text, r.summary()
    assert "stores its weight as (out_features, in_features)" in text, text


@pytest.mark.multirank
def test_a_layer_that_uses_another_cells_f_is_told_to_pass_it(tmp_path):
    """In a notebook F is in exercise 1's cell and the layer in another: without uses=(F,) the
    ranks do not have F."""
    import importlib.util

    path = tmp_path / "cell2.py"
    path.write_text("from torch import nn\n\n\nclass Lone(nn.Module):\n"
                    "    def __init__(self, linear):\n        super().__init__()\n"
                    "        self.weight = linear.weight\n\n"
                    "    def forward(self, x):\n        return F.apply(x)\n")
    spec = importlib.util.spec_from_file_location("cell2", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    r = run_user_column(module.Lone, nproc=2)
    assert "NameError: name 'F' is not defined" in r.verdicts()["runs"]
    assert "pass it: run_user_column(Lone, uses=(F, G))" in r.verdicts()["runs"]
