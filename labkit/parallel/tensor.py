"""Tensor parallelism by hand, Megatron-LM's way (Shoeybi et al. 2019; sequence parallelism:
Korthikanti et al. 2022). Every name of the module lives here; the code is in four short files:

    tensor_comms   the collectives as autograd Functions: f, g, gather, scatter,
                   sp_gather, sp_reduce_scatter, sp_split
    tensor_linear  ColumnParallelLinear, RowParallelLinear, NoAutogradColumnParallelLinear
                   (the broken one, for the pitfall), sync_sequence_parallel_grads
    tensor_blocks  the single-device MLP, SelfAttention, Block and their parallel versions
                   ParallelMLP, ParallelAttention, ParallelBlock
    tensor_vocab   VocabParallelEmbedding, vocab_parallel_cross_entropy

Inside a rank (every rank builds the same full layer, e.g. under the same seed):

    fc1 = ColumnParallelLinear.from_linear(nn.Linear(h, 4 * h))     # f, then X A_r
    fc2 = RowParallelLinear.from_linear(nn.Linear(4 * h, h))        # X_r B_r, then g
    y = fc2(F.gelu(fc1(x)))          # x [s, b, h], whole on every rank; y whole on every rank
    mlp = ParallelMLP.from_mlp(MLP(h))                              # the same, in one module
    block = ParallelBlock.from_block(Block(h, heads), sequence_parallel=True)
    y = block(x_shard)               # x_shard [s/tp, b, h]; then, after backward:
    sync_sequence_parallel_grads(block)

What each rank communicates per transformer block, activations S = b*s*h*bytes
(`labkit.comm.step_communication("tp", ...)` per layer):

| block           | forward                           | backward                           |
|-----------------|-----------------------------------|------------------------------------|
| attention       | 1 all-reduce S (g after proj)     | 1 all-reduce S (f before qkv)      |
| MLP             | 1 all-reduce S (g after fc2)      | 1 all-reduce S (f before fc1)      |
| with SP, each   | all-gather S + reduce-scatter S   | reduce-scatter S + all-gather S    |

A reduce-scatter plus an all-gather put on the wire what one ring all-reduce does, so sequence
parallelism costs the same bytes and saves (tp-1)/tp of the LayerNorm/dropout/residual
activations. Layout: [s, b, h], sequence dim 0. Degrees: tp (the group's size) must divide the
split dimension of each layer: out_features (column), in_features (row), num_heads (attention),
the vocabulary (embedding, loss) and, with sequence parallelism, the sequence length.
"""
from labkit.parallel.tensor_blocks import (Block, MLP, ParallelAttention, ParallelBlock,
                                           ParallelMLP, SelfAttention, attend)
from labkit.parallel.tensor_comms import (f, g, gather, scatter, sp_gather, sp_reduce_scatter,
                                          sp_split, tp_rank, tp_size)
from labkit.parallel.tensor_linear import (ColumnParallelLinear, NoAutogradColumnParallelLinear,
                                           RowParallelLinear, sync_sequence_parallel_grads)
from labkit.parallel.tensor_vocab import VocabParallelEmbedding, vocab_parallel_cross_entropy

__all__ = ["f", "g", "gather", "scatter", "sp_gather", "sp_reduce_scatter", "sp_split",
           "tp_size", "tp_rank", "ColumnParallelLinear", "RowParallelLinear",
           "NoAutogradColumnParallelLinear", "sync_sequence_parallel_grads", "MLP",
           "SelfAttention", "Block", "attend", "ParallelMLP", "ParallelAttention",
           "ParallelBlock", "VocabParallelEmbedding", "vocab_parallel_cross_entropy"]
