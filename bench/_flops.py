"""FLOP and byte floors for a Llama-style decoder: what LoRA adds over the base model, per token or per step.

A rewrite at the base model's cost runs at ``1 + LoRA FLOPs / base FLOPs``
of the base model's time at best; every table prints its ratios beside that
floor, so a ratio is read against what the work allows, not against 1.
Attention's score and value products are counted (they grow with the
context), norms, activations and the softmax are not (a few percent at most).
"""
from __future__ import annotations

from typing import Sequence


def linear_shapes(hidden: int, intermediate: int, kv_hidden: int) -> Sequence[tuple]:
    """(in, out) of every linear of one decoder layer: q, k, v, o, gate, up, down."""
    return [(hidden, hidden), (hidden, kv_hidden), (hidden, kv_hidden), (hidden, hidden),
            (hidden, intermediate), (hidden, intermediate), (intermediate, hidden)]


def base_flops_per_token(hidden: int, intermediate: int, layers: int, vocab: int, context: int,
                         kv_hidden: int = None) -> float:
    """Multiply-adds x 2 of one token through the decoder and ``lm_head``, attending to ``context`` tokens."""
    kv = hidden if kv_hidden is None else kv_hidden
    per_layer = sum(2 * i * o for i, o in linear_shapes(hidden, intermediate, kv)) + 4 * context * hidden
    return layers * per_layer + 2 * hidden * vocab


def lora_flops_per_token(hidden: int, intermediate: int, layers: int, rank: int, kv_hidden: int = None) -> float:
    """What LoRA of ``rank`` on every linear of the decoder layers adds per token: shrink and expand."""
    kv = hidden if kv_hidden is None else kv_hidden
    return layers * sum(2 * rank * (i + o) for i, o in linear_shapes(hidden, intermediate, kv))


def flop_floor(hidden: int, intermediate: int, layers: int, vocab: int, rank: int, context: int,
               kv_hidden: int = None) -> float:
    """``1 + LoRA FLOPs / base FLOPs``: the least a LoRA step can cost, as a multiple of the base step."""
    base = base_flops_per_token(hidden, intermediate, layers, vocab, context, kv_hidden)
    return 1 + lora_flops_per_token(hidden, intermediate, layers, rank, kv_hidden) / base


def lora_bytes_per_adapter(hidden: int, intermediate: int, layers: int, rank: int, kv_hidden: int = None,
                           itemsize: int = 4) -> float:
    """Bytes of one adapter's A and B over every linear of the decoder layers."""
    kv = hidden if kv_hidden is None else kv_hidden
    return itemsize * layers * sum(rank * (i + o) for i, o in linear_shapes(hidden, intermediate, kv))


def decode_byte_floor(hidden: int, intermediate: int, layers: int, vocab: int, rank: int, adapters_read: int,
                      batch: int, cache_len: int, kv_hidden: int = None, itemsize: int = 4) -> float:
    """``1 + LoRA bytes / base bytes`` of one decode step, whose time is the bytes it reads: the base step reads
    every linear's weight, ``lm_head`` and the K and V cache of every row once; LoRA adds the A and B of the
    ``adapters_read`` distinct adapters of the batch (activations, a few KB, are not counted)."""
    kv = hidden if kv_hidden is None else kv_hidden
    weights = layers * sum(i * o for i, o in linear_shapes(hidden, intermediate, kv)) + hidden * vocab
    cache = 2 * layers * batch * cache_len * kv
    base = itemsize * (weights + cache)
    return 1 + adapters_read * lora_bytes_per_adapter(hidden, intermediate, layers, rank, kv, itemsize) / base
