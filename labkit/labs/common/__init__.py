"""Helpers the labs share, and only those: a lab imports from here, never from another lab.
training (the debug GPT-2, batches, one step, timing), flags (argparse types and model flags),
models (transformers models from a ModelSpec), wire (bytes written, alpha-beta fits),
pipeline (the pipeline labs' model and measured steps), zero_stages (ZeRO stages around one
model), ddp_measure (a DDP step's timeline), fsdp_lm (the checkpoint labs' model), resume
(resuming it from the newest intact checkpoint: the crash and elastic labs), exercise,
checks, tiny_lm and tiny_llama (what the exercise runners share).
"""
