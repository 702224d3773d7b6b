"""The BGMV kernels as functional ``torch.ops.xla_lora`` custom ops.

Every op takes plain tensors: the activations, the per-slot stacked weights
of one site, and int32 token indices where -1 means "base model only".  The
ops know nothing of graphs or of the metadata object, so the graph pass,
the tests and users can call them alike.

Each op has three pieces:

* a reference implementation (``*_reference``): the obvious per-token gather,
  used by tests as the ground truth;
* a fake implementation, so Dynamo/AOTAutograd can trace through the op;
* the implementation that runs, written for XLA: one matmul over every
  slot's columns at once, then a select on the slot.  A per-token weight
  gather (``w[idx]``) materialises a ``[T, O, R]`` tensor and measured 5.7-8.1x
  the base matmul on the XLA CPU device; the masked form keeps every shape
  static and measured 2.1-2.3x (one 512x512 linear, 512 tokens, 16 adapters,
  r=16, openxla on the CPU).
"""
from __future__ import annotations

import torch

from .common import bgmv_expand_reference, bgmv_shrink_reference, compute_dtype, define_kernel_ops, define_op

__all__ = [
    "bgmv_shrink",
    "bgmv_expand",
    "bgmv_shrink_reference",
    "bgmv_expand_reference",
    "bgmv_embedding_shrink",
    "bgmv_embedding_shrink_reference",
    "bgmv_bias",
    "bgmv_bias_reference",
    "bgmv_dora",
    "bgmv_dora_reference",
]


def _slot_mask(idx: torch.Tensor, num_slots: int) -> torch.Tensor:
    """One-hot ``[T, N]`` bool mask of each token's slot; all False for -1."""
    slots = torch.arange(num_slots, device=idx.device, dtype=idx.dtype)
    return idx.unsqueeze(-1) == slots


def _check_2d(name: str, x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor) -> None:
    torch._check(x.dim() == 2, lambda: f"{name}: x must be [T, D], got {tuple(x.shape)}")
    torch._check(w.dim() == 3, lambda: f"{name}: w must be [N, out, in], got {tuple(w.shape)}")
    torch._check(idx.dim() == 1, lambda: f"{name}: idx must be [T], got {tuple(idx.shape)}")
    torch._check(
        x.shape[0] == idx.shape[0],
        lambda: f"{name}: {x.shape[0]} tokens in x but {idx.shape[0]} indices",
    )
    torch._check(
        x.shape[1] == w.shape[2],
        lambda: f"{name}: x has {x.shape[1]} features, w expects {w.shape[2]}",
    )


# ---------------------------------------------------------------------------
# Reference implementations: per-token gather, the definition of the ops
# (shrink's and expand's, which every kernel shares, are in kernels/common.py).
# ---------------------------------------------------------------------------


# ---------------------------------------------------------------------------
# The implementations that run (masked: static shapes, no gather).
# ---------------------------------------------------------------------------


def _masked_shrink(x, w, idx, scale):
    num_slots, rank, _ = w.shape
    dtype = compute_dtype(w)
    all_cols = x.to(dtype) @ w.reshape(num_slots * rank, -1).t().to(dtype)  # [T, N*R]
    per_slot = all_cols.reshape(-1, num_slots, rank)
    mask = _slot_mask(idx, num_slots).unsqueeze(-1)
    # where() rather than a multiply so a NaN in a padded row stays in that row.
    out = torch.where(mask, per_slot, torch.zeros_like(per_slot)).sum(dim=1)
    if scale != 1.0:
        out = out * scale
    return out


def _masked_expand_delta(x, w, idx):
    num_slots, out_features, rank = w.shape
    mask = _slot_mask(idx, num_slots).unsqueeze(-1)  # [T, N, 1]
    dtype = compute_dtype(w)
    spread = torch.where(mask, x.to(dtype).unsqueeze(1), torch.zeros((), dtype=dtype, device=x.device))
    # [T, N*R] @ [N*R, O]: every slot's B in one matmul, other slots' rows are zero.
    w_cols = w.permute(0, 2, 1).reshape(num_slots * rank, out_features).to(dtype)
    return spread.reshape(x.shape[0], num_slots * rank) @ w_cols


# The masked kernel: ``w`` is ``[N, out, in]`` (A ``[N, R, D]``, B ``[N, O, R]``), ``idx`` one slot per token.
bgmv_shrink, bgmv_expand = define_kernel_ops("", ("idx",), _check_2d, _masked_shrink, _masked_expand_delta,
                                             transposed=False)
bgmv_shrink.__doc__ = "``common.bgmv_shrink_reference(x, w, idx, scale)``: ``scale * w[idx[t]] @ x[t]``, 0 for -1."
bgmv_expand.__doc__ = "``common.bgmv_expand_reference(x, w, y, idx, add_inputs)``: ``y[t] + w[idx[t]] @ x[t]``."


# ---------------------------------------------------------------------------
# Embedding shrink and LoRA bias (patterns 2 and 5).
# ---------------------------------------------------------------------------


def bgmv_embedding_shrink_reference(ids, w, idx):
    """ids ``[T]``, w ``[N, R, V]`` (embedding A), idx ``[T]`` -> ``[T, R]``::

        out[t] = w[idx[t], :, ids[t]] if idx[t] >= 0 else 0
    """
    valid = idx >= 0
    rows = w[idx.clamp(min=0).long(), :, ids.long()]  # [T, R]
    return torch.where(valid.unsqueeze(-1), rows, torch.zeros_like(rows))


def bgmv_bias_reference(y, bias, idx):
    """y ``[T, O]``, bias ``[N, O]`` (scaled) -> ``[T, O]``::

        out[t] = y[t] + bias[idx[t]] if idx[t] >= 0 else y[t]
    """
    valid = idx >= 0
    rows = bias[idx.clamp(min=0).long()].to(y.dtype)
    return y + torch.where(valid.unsqueeze(-1), rows, torch.zeros_like(rows))


def _embedding_shrink(ids: torch.Tensor, w: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """The embedding LoRA's A lookup for every token's own slot: ``[T, R]``, zero for -1."""
    torch._check(ids.shape == idx.shape, lambda: f"bgmv_embedding_shrink: ids {tuple(ids.shape)} vs idx {tuple(idx.shape)}")
    num_slots, rank, vocab = w.shape
    # One gather of T rows from a [N*V, R] table: row slot*V + id.  Static shapes.
    table = w.permute(0, 2, 1).reshape(num_slots * vocab, rank)
    flat = idx.clamp(min=0).long() * vocab + ids.long()
    rows = table.index_select(0, flat)
    return torch.where((idx >= 0).unsqueeze(-1), rows, torch.zeros((), dtype=rows.dtype, device=rows.device))


def _embedding_shrink_fake(ids, w, idx):
    return w.new_empty((ids.shape[0], w.shape[1]))


bgmv_embedding_shrink = define_op("bgmv_embedding_shrink", _embedding_shrink, _embedding_shrink_fake)


def _bias(y: torch.Tensor, bias: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``y + bias[idx]`` per token (bias ``[N, O]`` already scaled); -1 rows unchanged."""
    torch._check(y.shape[0] == idx.shape[0], lambda: f"bgmv_bias: {y.shape[0]} rows but {idx.shape[0]} indices")
    # One-hot [T, N] @ [N, O]: a matmul instead of a per-token gather; -1 is an all-zero row.
    onehot = _slot_mask(idx, bias.shape[0]).to(bias.dtype)
    return y + (onehot @ bias).to(y.dtype)


def _bias_fake(y, bias, idx):
    return torch.empty_like(y)


bgmv_bias = define_op("bgmv_bias", _bias, _bias_fake)


# ---------------------------------------------------------------------------
# DoRA's per-slot output rescaling (pattern 6).
# ---------------------------------------------------------------------------


def bgmv_dora_reference(y, dora, idx):
    """y ``[T, O]``, dora ``[N, 2, O]`` -> ``[T, O]``::

        out[t] = y[t] * (1 + dora[idx[t], 0]) - dora[idx[t], 1] if idx[t] >= 0 else y[t]

    ``dora[k] = (m/||W + s B A|| - 1, (m/||W + s B A|| - 1) * base bias)`` for a
    DoRA slot, zeros for any other: with ``y`` = base output + LoRA delta, a
    DoRA row becomes ``m/||.|| * (W x + s B A x) + bias``, PEFT's formula.
    """
    valid = (idx >= 0).unsqueeze(-1)
    rows = dora[idx.clamp(min=0).long()].to(torch.float32)  # [T, 2, O]
    out = y.to(torch.float32) * (1 + rows[:, 0]) - rows[:, 1]
    return torch.where(valid, out.to(y.dtype), y)


def _dora(y: torch.Tensor, dora: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """DoRA's rescaling per token: ``y + g[idx] * y - c[idx]`` with ``dora = [N, 2, O]`` = (g, c); -1 rows unchanged."""
    torch._check(y.shape[0] == idx.shape[0], lambda: f"bgmv_dora: {y.shape[0]} rows but {idx.shape[0]} indices")
    torch._check(dora.dim() == 3 and dora.shape[1] == 2, lambda: f"bgmv_dora: dora must be [N, 2, O], got "
                                                                  f"{tuple(dora.shape)}")
    # Two row gathers from the [2N, O] table, fused by XLA into the multiply-add: one pass over y.  Not a
    # one-hot matmul (a second dot writing [T, 2*O]) nor a slice of gathered [T, 2, O] rows: on XLA a slice
    # or select at a nonzero offset there became a gather through a host-built int64 index table of the
    # full [T, O] size, one more graph input per site (docs/benchmarks.md, DoRA).  -1 rows read slot 0 and
    # are put back by the where().
    num_slots, _, out_features = dora.shape
    table = dora.reshape(2 * num_slots, out_features).to(torch.float32)  # row 2k: slot k's g, 2k + 1: its c
    first = idx.clamp(min=0).long() * 2
    gain, shift = table.index_select(0, first), table.index_select(0, first + 1)
    y32 = y.to(torch.float32)  # a no-op for fp32 y: no round trip
    out = (y32 + gain * y32 - shift).to(y.dtype)
    return torch.where((idx >= 0).unsqueeze(-1), out, y)


def _dora_fake(y, dora, idx):
    return torch.empty_like(y)


bgmv_dora = define_op("bgmv_dora", _dora, _dora_fake)
