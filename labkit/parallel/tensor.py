"""Tensor parallelism by hand, Megatron-LM's way (Shoeybi et al. 2019; sequence parallelism:
Korthikanti et al. 2022). Every name lives here; the code is in four short files (below).

    fc1 = ColumnParallelLinear.from_linear(nn.Linear(h, 4 * h))     # f, then X A_r
    fc2 = RowParallelLinear.from_linear(nn.Linear(4 * h, h))        # X_r B_r, then g
    y = fc2(F.gelu(fc1(x)))          # x [s, b, h], whole on every rank; y whole on every rank
    block = ParallelBlock.from_block(Block(h, heads), sequence_parallel=True)
    loss_fn(block(x_shard)).backward(); sync_sequence_parallel_grads(block)  # x_shard [s/tp, b, h]

Every rank builds the same full layer; what each block sends, the degrees: docs/labkit.md.
"""
# tensor_blocks: the single-device MLP, SelfAttention, Block and their parallel versions
# ParallelMLP, ParallelAttention, ParallelBlock
from labkit.parallel.tensor_blocks import (Block, MLP, ParallelAttention, ParallelBlock,
                                           ParallelMLP, SelfAttention, attend)
# tensor_comms: the collectives as autograd Functions: f, g, gather, scatter, sp_gather,
# sp_reduce_scatter, sp_split
from labkit.parallel.tensor_comms import (f, g, gather, scatter, sp_gather, sp_reduce_scatter,
                                          sp_split, tp_rank, tp_size)
# tensor_linear: ColumnParallelLinear, RowParallelLinear, NoAutogradColumnParallelLinear (the
# broken one, for the pitfall), sync_sequence_parallel_grads
from labkit.parallel.tensor_linear import (ColumnParallelLinear, NoAutogradColumnParallelLinear,
                                           RowParallelLinear, sync_sequence_parallel_grads)
# tensor_vocab: VocabParallelEmbedding, vocab_parallel_cross_entropy
from labkit.parallel.tensor_vocab import VocabParallelEmbedding, vocab_parallel_cross_entropy

__all__ = ["f", "g", "gather", "scatter", "sp_gather", "sp_reduce_scatter", "sp_split",
           "tp_size", "tp_rank", "ColumnParallelLinear", "RowParallelLinear",
           "NoAutogradColumnParallelLinear", "sync_sequence_parallel_grads", "MLP",
           "SelfAttention", "Block", "attend", "ParallelMLP", "ParallelAttention",
           "ParallelBlock", "VocabParallelEmbedding", "vocab_parallel_cross_entropy"]
