"""Parallelism by hand (layer 4): reference implementations that run inside ranks.

One file per axis, picotron-style, the naive version beside the optimised one, each tested
against a single-device reference: `ddp` (NaiveDDP, OverlappedDDP, BucketedDDP), `zero`
(ShardedOptimizer, ZeRO-2, FullyShardedModel), `tensor` (Megatron f/g, column/row parallel
layers, sequence parallelism), `pipe` (GPipe and 1F1B over send/recv), `mesh` (validated degrees,
named DeviceMesh axes, the ordered composition TP -> activation checkpointing -> FSDP).
Modules 03-08 of the course fill this folder.

May import: torch, layer 1 and runtime/. Never labs/, course/, cli/ or the views.
"""
