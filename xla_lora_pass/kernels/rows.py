"""Row BGMV: one adapter per row of the token grid (each request on its own adapter).

The same semantics as ``bgmv_shrink`` / ``bgmv_expand`` in
:mod:`xla_lora_pass.kernels.masked` for a mapping that is constant along each row of the
graph's ``[B, S]`` token layout, which is how multi-LoRA serving and PEFT's
``adapter_names=`` assign adapters: per request.  Registered as
``torch.ops.xla_lora.bgmv_*_rows``; the graph pass emits them when
the setting ``kernel`` is ``"auto"`` (the default; the kernel table's first entry), and the backend
runs them only for mappings that are constant per row (``LoRAMetadata.rows_uniform``).

The tokens are ``T = B * L`` rows of x, row b holding tokens ``[b*L, (b+1)*L)``;
``row_slots[b]`` is row b's slot or -1.  Semantics, against the references in
common.py (w_t^T: ``w_t.transpose(1, 2)``, the stack in the references' layout)::

    idx[t] = row_slots[t // L]                               # L = T // B
    bgmv_shrink_rows(x, w_t, row_slots, scale) == bgmv_shrink_reference(x, w_t^T, idx, scale)
    bgmv_expand_rows(x, w_t, y, row_slots, add) == bgmv_expand_reference(x, w_t^T, y, idx, add)
  The weights come with their last two
dims swapped against the other ops (A ``[N, D, R]``, B ``[N, R, O]``:
``LoRAMetadata.stacked_a(site, device, transposed=True)``), so each batched
matmul reads the gathered slots in the layout it multiplies in; on one site
the ``[N, out, in]`` layout's transposed operand measured about 1.5x the
kernel time here.  Each row gathers ITS slot's weights
once (``[B, R, D]`` and ``[B, O, R]``) and multiplies its L tokens by them in
one batched matmul: ``T * R * (D + O)`` FLOPs, the LoRA's own, against
``T * N * R * (D + O)`` for the masked form (every slot's columns for every
token), and no token reordering.  Measured here (XLA
on the CPU, docs/benchmarks.md): 1.08-1.22x the base model where masked is 1.37-1.53x.
"""
from __future__ import annotations

import torch

from .common import compute_dtype, define_kernel_ops

__all__ = ["bgmv_shrink_rows", "bgmv_expand_rows", "rows_shrink", "rows_expand_delta"]



def _check(name: str, x: torch.Tensor, w: torch.Tensor, row_slots: torch.Tensor) -> None:
    torch._check(x.dim() == 2, lambda: f"{name}: x must be [T, D], got {tuple(x.shape)}")
    torch._check(w.dim() == 3, lambda: f"{name}: w must be [N, in, out], got {tuple(w.shape)}")
    torch._check(row_slots.dim() == 1, lambda: f"{name}: row_slots must be [B], got {tuple(row_slots.shape)}")
    torch._check(x.shape[1] == w.shape[1], lambda: f"{name}: x has {x.shape[1]} features, w expects {w.shape[1]}")
    torch._check(
        x.shape[0] % row_slots.shape[0] == 0,
        lambda: f"{name}: {x.shape[0]} tokens do not split into {row_slots.shape[0]} equal rows",
    )


def _zero_unused_rows(rows: torch.Tensor, row_slots: torch.Tensor) -> torch.Tensor:
    """``rows`` ``[B, L, F]`` with the rows whose slot is -1 set to zero (where, so a NaN stays put)."""
    return torch.where((row_slots >= 0).view(-1, 1, 1), rows, torch.zeros((), dtype=rows.dtype, device=rows.device))


def _rows(x: torch.Tensor, row_slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x ``[B * L, F]`` as ``[B, L, F]`` in ``dtype``."""
    return x.to(dtype).reshape(row_slots.shape[0], -1, x.shape[1])


def _row_weights(w: torch.Tensor, row_slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Each row's slot's weights ``[B, in, out]`` (slot 0's for -1 rows, zeroed around the matmul)."""
    return w.index_select(0, row_slots.clamp(min=0).long()).to(dtype)


def rows_shrink(x: torch.Tensor, w: torch.Tensor, row_slots: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """``[T, R] = scale * x @ w[slot of the token's row]`` for w ``[N, D, R]``; zero on rows with slot -1."""
    dtype = compute_dtype(w)
    # -1 rows zeroed on the [B, L, R] output, not the [B, L, D] input: a pass over R columns, not D.
    out = _zero_unused_rows(torch.bmm(_rows(x, row_slots, dtype), _row_weights(w, row_slots, dtype)), row_slots)
    out = out.reshape(x.shape[0], w.shape[2])
    return out * scale if scale != 1.0 else out


def rows_expand_delta(x: torch.Tensor, w: torch.Tensor, row_slots: torch.Tensor) -> torch.Tensor:
    """``[T, O] = x @ w[slot of the token's row]`` for w ``[N, R, O]``; zero on rows with slot -1."""
    dtype = compute_dtype(w)
    # -1 rows zeroed on the [B, L, R] input, not the [B, L, O] output.
    delta = torch.bmm(_zero_unused_rows(_rows(x, row_slots, dtype), row_slots), _row_weights(w, row_slots, dtype))
    return delta.reshape(x.shape[0], w.shape[2])


# ``bgmv_shrink`` / ``bgmv_expand`` for a mapping constant per row: ``row_slots`` ``[B]``, x ``[B * L, D]``,
# w ``[N, D, R]`` / ``[N, R, O]``; rows with slot -1 add nothing.
bgmv_shrink_rows, bgmv_expand_rows = define_kernel_ops("_rows", ("row_slots",), _check, rows_shrink,
                                                       rows_expand_delta, transposed=True)
