"""labkit.parallel.tensor against one device on 2 and 4 gloo ranks (tests/fixtures/labs/tp_parity.py, one
launch per world size): outputs, input gradients and every weight shard's gradient (equal to the
matching slice of the reference's) for the column and row layers, the MLP, the attention block,
a whole block, the vocab-parallel embedding and cross-entropy, each with sequence parallelism
too; the collectives counted against labkit.comm.step_communication("tp"); the no-autograd
pitfall; bad inputs. In this process (one rank): arguments checked before any collective."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as tdist
from torch import nn

from labkit.comm import step_communication
from labkit.models import get_model
from labkit.parallel import tensor as tp

LABS = Path(__file__).resolve().parents[1] / "fixtures" / "labs"
S, B, H, HEADS, V = 8, 2, 16, 4, 32        # tests/fixtures/labs/tp_parity.py's sizes
ELEMENT = 8                                # float64
ACT = S * B * H * ELEMENT                  # one activation [s, b, h]: step_communication's S
TOL = 1e-12                                # float64 rounding (seen: <= 3e-15)

CASES = ["functions", "column", "column_gathered", "row", "row_full_input", "mlp", "mlp_sp", "attention",
         "attention_sp", "block", "block_sp", "model", "model_sp", "embedding", "embedding_sp",
         "cross_entropy"]
# each case's parameter names: every one's gradient is compared (a shard's with its slice)
PARAMS = {"column": {"weight", "bias"}, "row": {"weight", "bias"},
          "mlp": {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"},
          "attention": {"qkv.weight", "qkv.bias", "proj.weight", "proj.bias"},
          "cross_entropy": set(), "embedding": {"weight"},
          "functions": {"f_input_grad", "g_out", "g_input_grad", "sp_split_out",
                        "sp_split_input_grad"}}
PARAMS["block"] = ({"ln1.weight", "ln1.bias", "ln2.weight", "ln2.bias"}
                   | {"attn." + n for n in PARAMS["attention"]}
                   | {"mlp." + n for n in PARAMS["mlp"]})
PARAMS["model"] = ({"emb.weight", "norm.weight", "norm.bias", "head.weight"}
                   | {"block." + n for n in PARAMS["block"]})


@pytest.fixture(scope="module", params=[2, 4], ids=["2ranks", "4ranks"])
def ranks(request):
    from labkit.runtime.launch import run_lab
    return run_lab(LABS / "tp_parity.py", nproc=request.param, timeout=180, quiet=True).results


def params_of(case: str) -> set:
    base = case.removesuffix("_sp").removesuffix("_gathered").removesuffix("_full_input")
    return PARAMS[base]


@pytest.mark.multirank
@pytest.mark.parametrize("case", CASES)
def test_each_layer_equals_one_device(ranks, case):
    for rank in ranks:
        diff = rank[case]["diff"]
        extra = ({"loss"} if case.startswith("model") else {"out"} if case.startswith("embedding")
                 else set() if case == "functions" else {"out", "input_grad"})
        assert set(diff) == params_of(case) | extra, diff        # every gradient compared
        assert max(diff.values()) < TOL, (case, diff)


@pytest.mark.multirank
def test_shards_are_contiguous_slices_of_the_right_dimension(ranks):
    n = len(ranks)
    shapes = ranks[-1]["block"]["shapes"]
    assert shapes["attn.qkv.weight"] == [3 * H // n, H]      # column: output features (heads)
    assert shapes["attn.qkv.bias"] == [3 * H // n]
    assert shapes["attn.proj.weight"] == [H, H // n]         # row: input features
    assert shapes["attn.proj.bias"] == [H]                   # whole, added once
    assert shapes["mlp.fc1.weight"] == [4 * H // n, H]
    assert shapes["mlp.fc2.weight"] == [H, 4 * H // n]
    assert ranks[0]["column"]["shapes"] == {"weight": [2 * H // n, H], "bias": [2 * H // n]}


@pytest.mark.multirank
@pytest.mark.parametrize("case", ["mlp", "attention"])
def test_mlp_and_attention_one_all_reduce_each_way(ranks, case):
    for rank in ranks:
        comm = rank[case]["comm"]
        assert comm["forward"] == {"all_reduce": [1, ACT]}     # g after the row layer
        assert comm["backward"] == {"all_reduce": [1, ACT]}    # f before the column layer
        sp = rank[case + "_sp"]["comm"]
        assert sp["forward"] == sp["backward"] == {"all_gather": [1, ACT],
                                                   "reduce_scatter": [1, ACT]}


def predicted(n: int, sequence_parallel: bool) -> dict:
    spec = get_model("debug-llama").with_(hidden_size=H, num_heads=HEADS, num_kv_heads=HEADS,
                                          num_layers=1)
    comm = step_communication("tp", model=spec, tp=n, batch_size=B, seq_len=S,
                              activation_bytes=ELEMENT, sequence_parallel=sequence_parallel)
    return {op: [count, nbytes] for op, (count, nbytes) in comm.payload.items()}


@pytest.mark.multirank
@pytest.mark.parametrize("sp", [False, True], ids=["allreduce", "sequence_parallel"])
def test_a_block_sends_what_step_communication_predicts(ranks, sp):
    n = len(ranks)
    expected = predicted(n, sp)
    for rank in ranks:
        comm = rank["block_sp" if sp else "block"]["comm"]
        measured = {}
        for phase in ("forward", "backward"):
            for op, (count, nbytes) in comm[phase].items():
                c, b = measured.get(op, [0, 0])
                measured[op] = [c + count, b + nbytes]
        assert measured == expected                            # counts and bytes: ratio 1.000
        assert sum(c for c, _ in measured.values()) == (8 if sp else 4)
        half = ({"all_gather": [2, 2 * ACT], "reduce_scatter": [2, 2 * ACT]} if sp
                else {"all_reduce": [2, 2 * ACT]})             # attention's and the MLP's
        assert comm["forward"] == comm["backward"] == half


@pytest.mark.multirank
def test_sequence_parallel_gradients_are_summed_once(ranks):
    # LayerNorms (4 H) and the two row biases (2 H) saw one sequence shard each: one all-reduce
    for rank in ranks:
        assert rank["block"]["comm"]["sync"] == {}
        assert rank["block_sp"]["comm"]["sync"] == {"all_reduce": [1, 6 * H * ELEMENT]}
        assert rank["mlp_sp"]["comm"]["sync"] == {"all_reduce": [1, H * ELEMENT]}


@pytest.mark.multirank
def test_embedding_sums_the_owners_rows_once(ranks):
    for rank in ranks:
        assert rank["embedding"]["comm"]["forward"] == {"all_reduce": [1, ACT]}
        assert rank["embedding_sp"]["comm"]["forward"] == {"reduce_scatter": [1, ACT]}


@pytest.mark.multirank
def test_cross_entropy_three_small_all_reduces_forward_none_backward(ranks):
    for rank in ranks:
        comm = rank["cross_entropy"]["comm"]
        assert comm == {"forward": {"all_reduce": [3, 3 * S * B * ELEMENT]}, "backward": {}}


@pytest.mark.multirank
def test_no_autograd_all_gather_gives_silently_wrong_input_gradients(ranks):
    for rank in ranks:
        out = rank["no_autograd_column"]
        diff = out["diff"]
        assert diff["out"] < TOL and diff["weight"] < TOL and diff["bias"] < TOL   # looks fine
        assert diff["input_grad"] > 0.1                        # but dL/dX is one rank's term
        assert out["summed_input_grad"] < TOL                  # the all-reduce f would have done


# argument named, what was given, what is allowed (fragments); {n}: the world size
EXPECTED = {
    "column_out": ("tp={n}", "out_features=5", "allowed: 1, 5"),
    "row_in": ("tp={n}", "in_features=5", "allowed: 1, 5"),
    "heads": ("tp={n}", "num_heads=3", "allowed: 1, 3"),
    "vocab": ("tp={n}", "vocabulary", "=5", "allowed: 1, 5"),
    "sequence": ("tp={n}", "sequence length", "=5", "allowed: 1, 5"),
    "not_linear": ("linear=Conv1d", "nn.Linear"),
    "flag": ("input_is_parallel='yes'", "True or False"),
    "gather_sp": ("gather_output=True", "sequence_parallel=True", "allowed"),
    "row_sp_full": ("sequence_parallel=True", "input_is_parallel=True", "allowed"),
    "target": ("target", "32", "0 to 31", "tp={n}"),
}


@pytest.mark.multirank
@pytest.mark.parametrize("case", sorted(EXPECTED))
def test_bad_inputs_are_refused_with_a_clear_message(ranks, case):
    n = len(ranks)
    for rank in ranks:
        message = rank["errors"][case]
        assert message is not None and message.startswith("ValueError: "), (case, message)
        for fragment in EXPECTED[case]:
            assert fragment.format(n=n) in message, (case, fragment, message)


# ---------------------------------------------------------------------------------------------
# in this process


def test_needs_a_process_group():
    with pytest.raises(RuntimeError, match="ColumnParallelLinear needs the process group"):
        tp.ColumnParallelLinear.from_linear(nn.Linear(4, 4))
    with pytest.raises(RuntimeError, match="vocab_parallel_cross_entropy needs"):
        tp.vocab_parallel_cross_entropy(torch.zeros(2, 4), torch.zeros(2, dtype=torch.long))


@pytest.fixture
def one_rank():
    tdist.init_process_group("gloo", store=tdist.HashStore(), rank=0, world_size=1)
    yield
    tdist.destroy_process_group()


@pytest.mark.parametrize("call, words", [
    (lambda: tp.ColumnParallelLinear(torch.zeros(4)), ["weight=", "2-D floating-point"]),
    (lambda: tp.ColumnParallelLinear(torch.zeros(4, 3), torch.zeros(3)), ["bias=", "(4,)"]),
    (lambda: tp.RowParallelLinear.from_linear(nn.Linear(4, 4), sequence_parallel=1),
     ["sequence_parallel=1", "True or False"]),
    (lambda: tp.ParallelMLP.from_mlp(nn.Linear(4, 4)), ["mlp=Linear", "fc1, fc2"]),
    (lambda: tp.ParallelBlock.from_block(tp.MLP(4)), ["block=MLP", "Block"]),
    (lambda: tp.VocabParallelEmbedding.from_embedding(nn.Linear(4, 4)), ["nn.Embedding"]),
    (lambda: tp.vocab_parallel_cross_entropy(torch.zeros(2, 4), torch.zeros(3, dtype=torch.long)),
     ["target=", "shape (2,)"]),
    (lambda: tp.vocab_parallel_cross_entropy(torch.zeros(2, 4), torch.tensor([0, -1])),
     ["from -1 to 0", "0 to 3"]),
    (lambda: tp.sync_sequence_parallel_grads("block"), ["module='block'", "torch.nn.Module"]),
])
def test_bad_arguments_in_one_rank(one_rank, call, words):
    with pytest.raises(ValueError) as err:
        call()
    for w in words:
        assert w in str(err.value), (w, str(err.value))


def test_a_mlp_like_module_is_accepted_by_its_linears(one_rank):
    class HF(nn.Module):                       # any module with fc1 / fc2 Linears
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(4, 8), nn.Linear(8, 4)

    ref = HF()
    par = tp.ParallelMLP.from_mlp(ref)
    x = torch.randn(3, 2, 4)
    torch.testing.assert_close(par(x), ref.fc2(torch.nn.functional.gelu(ref.fc1(x))))
