"""Cutting a model into pipeline stages (labkit.parallel.pipe re-exports every name here).

`split_model(model, stages)` takes a transformers LlamaForCausalLM or GPT2LMHeadModel built from
a config, or a list of blocks, and returns one nn.Module per stage:

    stage 0         embeddings (+ GPT-2's position table and dropout) + its blocks
    stage 1..p-2    its blocks
    stage p-1       its blocks + final norm + LM head; `stage.loss_fn` = causal_lm_loss

The rules of the cut (equal stages, shared parameters, known boundary shapes): `split_model`.
"""
from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch import nn

from labkit import validate

MAX_SLEEP = 60.0        # seconds one SleepLayer may sleep per forward


def causal_lm_loss(logits, labels):
    """transformers' causal-LM loss: token t predicts labels[t + 1] (the labels are the inputs,
    shifted inside the loss as HF does), mean over the predicted tokens, -100 ignored."""
    vocab = logits.shape[-1]
    return F.cross_entropy(logits[:, :-1].reshape(-1, vocab).float(),
                           labels[:, 1:].reshape(-1), ignore_index=-100)


class BlockStage(nn.Module):
    """A stage of a plain block stack: its blocks in order. The blocks must keep the shape of
    the activation (as transformer blocks keep [b, s, h]): every boundary carries the
    micro-batch's input shape."""

    def __init__(self, blocks, index: int, stages: int):
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.index, self.stages = index, stages
        self.first, self.last = index == 0, index == stages - 1

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x

    def boundary(self, batch):
        """(shape, dtype) of the activation between two stages for a micro-batch input."""
        return tuple(batch.shape), batch.dtype


class CausalLMStage(nn.Module):
    """A stage of a transformers Llama or GPT-2: what the model's forward does for its blocks.
    Every stage rebuilds the causal mask and (Llama) the rotary position embeddings from the
    shape of its input, as the whole model does once (they hold no parameters)."""

    def __init__(self, model, blocks, index: int, stages: int):
        super().__init__()
        from transformers.masking_utils import create_causal_mask

        self._mask = create_causal_mask
        # transformers 5 calls the cache argument `cache` (4.x: `past_key_values`, now deprecated
        # with a FutureWarning); no stage keeps a cache, so it is None either way
        import inspect

        self._no_cache = ({"cache": None} if "cache" in inspect.signature(create_causal_mask).parameters
                          else {"past_key_values": None})
        self.config = model.config
        self.llama = hasattr(model, "model")
        inner = model.model if self.llama else model.transformer
        self.index, self.stages = index, stages
        self.first, self.last = index == 0, index == stages - 1
        self.hidden = self.config.hidden_size
        if self.first:
            if self.llama:
                self.embed_tokens = inner.embed_tokens
            else:
                self.wte, self.wpe, self.drop = inner.wte, inner.wpe, inner.drop
        self.layers = nn.ModuleList(blocks)
        if self.llama:
            self.rotary_emb = inner.rotary_emb            # buffers only
        if self.last:
            self.norm = inner.norm if self.llama else inner.ln_f
            self.lm_head = model.lm_head
            self.loss_fn = causal_lm_loss

    def forward(self, x):
        seq = x.shape[1]
        positions = torch.arange(seq, device=x.device).unsqueeze(0)
        if not self.first:
            hidden = x                                   # the previous stage's [b, s, h]
        elif self.llama:
            hidden = self.embed_tokens(x)
        else:
            hidden = self.drop(self.wte(x) + self.wpe(positions))
        mask = self._mask(config=self.config, inputs_embeds=hidden, attention_mask=None,
                          position_ids=positions, **self._no_cache)
        extra = {"position_ids": positions}
        if self.llama:
            extra["position_embeddings"] = self.rotary_emb(hidden, position_ids=positions)
        for layer in self.layers:
            hidden = layer(hidden, attention_mask=mask, **extra)
        if self.last:
            return self.lm_head(self.norm(hidden))
        return hidden

    def boundary(self, batch):
        """(shape, dtype) of the activation between two stages for micro-batch token ids
        [b, s]: [b, s, hidden] in the model's dtype."""
        return (*batch.shape, self.hidden), next(self.layers[0].parameters()).dtype


def _blocks_of(model):
    """(kind, blocks) of what split_model accepts; ValueError naming what it got otherwise."""
    if isinstance(model, (list, tuple, nn.ModuleList, nn.Sequential)):
        blocks = list(model)
        for i, b in enumerate(blocks):
            if not isinstance(b, nn.Module):
                raise ValueError(f"model[{i}]={type(b).__name__} is not an nn.Module; allowed: "
                                 "a list of nn.Module blocks")
        return "blocks", blocks
    inner = getattr(model, "model", None) or getattr(model, "transformer", None)
    layers = getattr(inner, "layers", None) or getattr(inner, "h", None)
    if not isinstance(layers, nn.ModuleList) or not hasattr(model, "lm_head"):
        raise ValueError(f"model={type(model).__name__} is not supported; allowed: a "
                         "transformers LlamaForCausalLM or GPT2LMHeadModel (built from a config), "
                         "or a list of nn.Module blocks")
    embed = getattr(inner, "embed_tokens", None) or getattr(inner, "wte", None)
    if model.lm_head.weight is embed.weight:
        raise ValueError("model has tie_word_embeddings=True: the first stage (embedding) and "
                         "the last (LM head) would each hold a copy of the shared matrix, and "
                         "their gradients would need a sum across the two stages; allowed: a "
                         "model built with tie_word_embeddings=False")
    return "causal_lm", list(layers)


def split_model(model, stages) -> list[nn.Module]:
    """Cut `model` into `stages` pipeline stages of equal block counts (the module docstring
    shows what each holds). Raises ValueError when stages does not divide the number of blocks.

    Each stage gets layers/stages consecutive blocks, so stages must divide the block count
    (equal stages are what the schedules' bubble formulas assume). The stages share the model's
    parameters (nothing is copied): on rank r keep stages[r] and let the rest go. A stage knows
    the shape of the activation it receives and sends (`boundary`), so the schedules post
    receives of the right size without a message about shapes first."""
    kind, blocks = _blocks_of(model)
    if not blocks:
        raise ValueError("model has no blocks to split; allowed: at least one block")
    p = validate.divides("stages", stages, "the number of blocks", len(blocks))
    per = len(blocks) // p
    parts = [blocks[i * per:(i + 1) * per] for i in range(p)]
    if kind == "blocks":
        return [BlockStage(part, i, p) for i, part in enumerate(parts)]
    return [CausalLMStage(model, part, i, p) for i, part in enumerate(parts)]


def split_batch(inputs, targets, microbatches) -> list[tuple]:
    """[(input, target)] * m: the batch cut along dim 0 into `microbatches` equal parts, the
    form gpipe_step and one_f_one_b_step take. microbatches must divide the batch size. Each
    part is a copy (its own memory, as a data loader gives it), so the activation bytes a stage
    holds grow with each micro-batch in flight, its input included."""
    if inputs.shape[0] != targets.shape[0]:
        raise ValueError(f"targets has batch size {targets.shape[0]} and inputs "
                         f"{inputs.shape[0]}; allowed: the same batch size")
    m = validate.divides("microbatches", microbatches, "the batch size", inputs.shape[0])
    return [(x.clone(), y.clone()) for x, y in zip(inputs.chunk(m), targets.chunk(m))]


def _sleep(seconds: float) -> None:
    """time.sleep under a profiler range named labkit::compute_sleep: in a trace the sleep is
    the stage's (emulated) compute, which labkit.trace counts as compute."""
    if seconds > 0:
        with torch.profiler.record_function("labkit::compute_sleep"):
            time.sleep(seconds)


class _SleepInput(torch.autograd.Function):
    """y = x * w (w a plain value here) after sleeping `seconds`; the backward, the input
    gradient's pass, sleeps `seconds` and returns grad * w for x only."""

    @staticmethod
    def forward(ctx, x, weight, seconds):
        _sleep(seconds)
        ctx.seconds = seconds
        ctx.save_for_backward(weight)
        return x * weight

    @staticmethod
    def backward(ctx, grad):
        _sleep(ctx.seconds)
        (weight,) = ctx.saved_tensors
        return grad * weight, None, None


class _SleepWeight(torch.autograd.Function):
    """The weight's part of y = x * w (x detached or needing no gradient: this node is not on
    the input gradient's path): forward sleeps `forward_seconds` and returns x * w when it is
    the whole layer (`whole`), else 0 (added to _SleepInput's x * w); the backward, the weight
    gradient's pass, sleeps `seconds` and returns d(x * w)/dw = sum(grad * x) for w only."""

    @staticmethod
    def forward(ctx, weight, x, seconds, forward_seconds, whole):
        if whole:
            _sleep(forward_seconds)
        ctx.seconds = seconds
        ctx.save_for_backward(x)
        return x * weight if whole else torch.zeros_like(x)

    @staticmethod
    def backward(ctx, grad):
        _sleep(ctx.seconds)
        (x,) = ctx.saved_tensors
        return (grad * x).sum().reshape(()), None, None, None, None


class SleepLayer(nn.Module):
    """A compute layer that sleeps instead of computing: forward `seconds`, backward 2 x
    `seconds`: `seconds` for the input gradient and `seconds` for the weight gradient, in two
    autograd nodes, so that a backward split into its two passes (torch's zero-bubble schedules:
    backward_one_chunk(full_backward=False), then backward_weight_one_chunk) sleeps `seconds` in
    each, as labkit.pipeline's zero-bubble assumes (Qi et al. 2023: B = W), and a full backward
    sleeps both. Sleeping takes no CPU, so the timelines of 4 ranks on 2 shared cores come out as
    clean as on 4 GPUs. Multiplies by a weight (1 at the start) so it has a gradient to compute
    and its backward runs even on the first stage."""

    def __init__(self, seconds: float):
        super().__init__()
        self.seconds = validate.non_negative("seconds", seconds, MAX_SLEEP)
        self.weight = nn.Parameter(torch.ones(()))

    def forward(self, x):
        if not x.requires_grad:          # no input gradient: the weight's pass sleeps both
            return _SleepWeight.apply(self.weight, x, 2 * self.seconds, self.seconds, True)
        return _SleepInput.apply(x, self.weight.detach(), self.seconds) + \
            _SleepWeight.apply(self.weight, x.detach(), self.seconds, 0.0, False)

    def extra_repr(self) -> str:
        return f"seconds={self.seconds:g}"
