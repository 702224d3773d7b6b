"""Sorted BGMV: any token mapping, the tokens ordered by slot on the host into blocks of one slot each.

The same semantics as ``bgmv_shrink`` / ``bgmv_expand`` in
:mod:`xla_lora_pass.kernels.masked`, registered as ``torch.ops.xla_lora.bgmv_*_sorted``,
for ANY mapping (a random per-token mix, short segments, base-model tokens),
at about the LoRA's own FLOPs instead of the masked kernel's N times them:
Punica's SGMV idea, laid out the way vLLM's ``LoRAKernelMeta`` sorts tokens
by LoRA id.

Once per step on the host (``build_sorted_layout``), the tokens are ordered
by slot (the base model's -1 being one more group) and each group is padded
up to a multiple of BS tokens, so every block of BS sorted rows holds one
slot.  Three int32 tensors describe it:

* ``gather`` ``[T']``: the token each sorted row reads (pad rows read token 0; nothing reads them back);
* ``block_slots`` ``[NB']``: each block's slot, -1 for the base group and for unused blocks;
* ``inverse`` ``[T]``: each token's sorted row.

Semantics, against the references in common.py (``sorted_token_indices``;
w_t^T: ``w_t.transpose(1, 2)``)::

    idx[t] = block_slots[inverse[t] // BS]
    bgmv_shrink_sorted(x, w_t, gather, block_slots, inverse, scale) == bgmv_shrink_reference(x, w_t^T, idx, scale)
    bgmv_expand_sorted(x, w_t, y, gather, block_slots, inverse, add) == bgmv_expand_reference(x, w_t^T, y, idx, add)

With G groups at most (the slots and the base), the groups fill at most
``NB' = (T + G * (BS - 1)) // BS`` blocks (``sorted_blocks``): a size that
depends on the bucket and the slot count alone, so a new mapping within a
bucket compiles nothing.  On the device, per site, the shrink gathers x into
sorted order, multiplies each block by its slot's A in one batched matmul
and brings the R columns back to token order; the expand gathers those R
columns into sorted order, multiplies each block by its slot's B and brings
the delta back by ``inverse``.  Blocks of slot -1 contribute nothing.
"""
from __future__ import annotations

from typing import NamedTuple, Tuple

import numpy as np
import torch

from .common import bgmv_expand_reference, bgmv_shrink_reference, compute_dtype, define_kernel_ops

__all__ = ["SortedLayout", "sorted_blocks", "build_sorted_layout", "sorted_buffers", "sorted_token_indices",
           "bgmv_shrink_sorted", "bgmv_expand_sorted", "bgmv_shrink_sorted_reference",
           "bgmv_expand_sorted_reference"]


class SortedLayout(NamedTuple):
    gather: torch.Tensor  # [NB' * BS] int32: the token each sorted row reads
    block_slots: torch.Tensor  # [NB'] int32: each block's slot, -1 = nothing added
    inverse: torch.Tensor  # [T] int32: each token's sorted row


def sorted_blocks(num_tokens: int, block_tokens: int, groups: int) -> int:
    """NB': the blocks that hold ``num_tokens`` tokens in at most ``groups`` groups, each padded to whole
    blocks of ``block_tokens`` (each group wastes at most ``block_tokens - 1`` rows)."""
    return (num_tokens + groups * (block_tokens - 1)) // block_tokens  # >= 1 for T >= 1


def build_sorted_layout(idx, block_tokens: int, groups: int) -> SortedLayout:
    """The layout of int32 token indices ``idx`` ``[T]`` (-1 = base) in ``sorted_blocks(T, BS, groups)`` blocks.

    ``groups`` bounds the distinct values of ``idx`` (the slot count plus one
    for -1); more raise ``ValueError``.  Plain numpy: a stable sort and a few
    vector ops on T ints.
    """
    idx = np.asarray(idx.cpu() if isinstance(idx, torch.Tensor) else idx, dtype=np.int64).reshape(-1)
    bs = block_tokens
    values, counts = np.unique(idx, return_counts=True)
    if values.size > groups:
        raise ValueError(f"the mapping uses {values.size} distinct slots (with -1), more than the {groups} the "
                         "sorted layout was sized for")
    blocks = sorted_blocks(idx.size, bs, groups)
    group_blocks = -(-counts // bs)
    block_start = np.concatenate([[0], np.cumsum(group_blocks)[:-1]])  # each group's first block
    order = np.argsort(idx, kind="stable")  # tokens by slot; np.unique's values are in the same order
    group_of = np.repeat(np.arange(values.size), counts)  # the group of each token of ``order``
    rank_in_group = np.arange(idx.size) - np.repeat(np.cumsum(counts) - counts, counts)
    rows = block_start[group_of] * bs + rank_in_group  # each sorted token's row
    gather = np.zeros(blocks * bs, dtype=np.int32)
    gather[rows] = order
    inverse = np.empty(idx.size, dtype=np.int32)
    inverse[order] = rows
    block_slots = np.full(blocks, -1, dtype=np.int32)
    block_slots[np.repeat(block_start, group_blocks) + _ranks(group_blocks)] = np.repeat(values, group_blocks)
    return SortedLayout(torch.from_numpy(gather), torch.from_numpy(block_slots), torch.from_numpy(inverse))


def _ranks(counts: np.ndarray) -> np.ndarray:
    """0..c-1 for each c in ``counts``, concatenated."""
    return np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)


def sorted_buffers(layout: SortedLayout, block_tokens: int, max_blocks: int,
                   max_num_tokens: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``layout`` in the fixed-size buffers a graph narrows to its bucket: gather ``[max_blocks * BS]`` (0 past
    the layout), block slots ``[max_blocks]`` (-1 past it) and inverse ``[max_num_tokens]`` (0 past it)."""
    gather = torch.zeros(max_blocks * block_tokens, dtype=torch.int32)
    gather[: layout.gather.numel()] = layout.gather
    block_slots = torch.full((max_blocks,), -1, dtype=torch.int32)
    block_slots[: layout.block_slots.numel()] = layout.block_slots
    inverse = torch.zeros(max_num_tokens, dtype=torch.int32)
    inverse[: layout.inverse.numel()] = layout.inverse
    return gather, block_slots, inverse


def sorted_token_indices(gather: torch.Tensor, block_slots: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """The per-token slot indices ``[T]`` a layout stands for: the slot of each token's sorted row's block."""
    block_tokens = gather.shape[0] // block_slots.shape[0]
    return block_slots[inverse.long() // block_tokens]


def bgmv_shrink_sorted_reference(x, w_t, gather, block_slots, inverse, scale: float = 1.0):
    """The definition: ``bgmv_shrink_reference`` on the indices the layout stands for (w_t ``[N, D, R]``)."""
    return bgmv_shrink_reference(x, w_t.transpose(1, 2), sorted_token_indices(gather, block_slots, inverse), scale)


def bgmv_expand_sorted_reference(x, w_t, y, gather, block_slots, inverse, add_inputs: bool = True):
    """The definition: ``bgmv_expand_reference`` on the layout's indices (w_t ``[N, R, O]``)."""
    return bgmv_expand_reference(x, w_t.transpose(1, 2), y, sorted_token_indices(gather, block_slots, inverse),
                                 add_inputs)


def _check(name: str, x: torch.Tensor, w: torch.Tensor, gather: torch.Tensor, block_slots: torch.Tensor,
           inverse: torch.Tensor) -> None:
    torch._check(x.dim() == 2, lambda: f"{name}: x must be [T, D], got {tuple(x.shape)}")
    torch._check(w.dim() == 3, lambda: f"{name}: w must be [N, in, out], got {tuple(w.shape)}")
    torch._check(block_slots.dim() == 1, lambda: f"{name}: block_slots must be [NB], got {tuple(block_slots.shape)}")
    torch._check(gather.dim() == 1 and gather.shape[0] % block_slots.shape[0] == 0,
                 lambda: f"{name}: gather must be [NB * BS] with NB={block_slots.shape[0]}, got {tuple(gather.shape)}")
    torch._check(inverse.dim() == 1 and inverse.shape[0] == x.shape[0],
                 lambda: f"{name}: inverse must be [T] with T={x.shape[0]}, got {tuple(inverse.shape)}")
    torch._check(x.shape[1] == w.shape[1], lambda: f"{name}: x has {x.shape[1]} features, w expects {w.shape[1]}")


def _sorted_blocks(t: torch.Tensor, gather: torch.Tensor, block_slots: torch.Tensor, dtype) -> torch.Tensor:
    """``t`` ``[T, F]`` in sorted order as ``[NB', BS, F]``."""
    return t.index_select(0, gather.long()).to(dtype).view(block_slots.shape[0], -1, t.shape[1])


def _zero_base_blocks(blocks: torch.Tensor, block_slots: torch.Tensor) -> torch.Tensor:
    """``blocks`` ``[NB', BS, F]`` with the blocks of slot -1 zeroed (where, so a NaN stays out)."""
    return torch.where((block_slots >= 0).view(-1, 1, 1), blocks, torch.zeros((), dtype=blocks.dtype,
                                                                              device=blocks.device))


def _block_weights(w: torch.Tensor, block_slots: torch.Tensor, dtype) -> torch.Tensor:
    """Each block's slot's weights ``[NB', in, out]`` (slot 0's for -1 blocks, zeroed around the matmul)."""
    return w.index_select(0, block_slots.clamp(min=0).long()).to(dtype)


def _to_tokens(rows: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """Sorted ``[NB', BS, F]`` back to token order ``[T, F]``."""
    return rows.reshape(-1, rows.shape[-1]).index_select(0, inverse.long())


def sorted_shrink(x, w_t, gather, block_slots, inverse, scale: float = 1.0) -> torch.Tensor:
    """``[T, R]``: each token times its slot's A, w_t ``[N, D, R]``; zero for tokens on -1."""
    dtype = compute_dtype(w_t)
    cols = torch.bmm(_sorted_blocks(x, gather, block_slots, dtype), _block_weights(w_t, block_slots, dtype))
    # -1 blocks zeroed on the R columns, not on the D inputs.
    out = _to_tokens(_zero_base_blocks(cols, block_slots), inverse)
    return out * scale if scale != 1.0 else out


def sorted_expand_delta(x, w_t, gather, block_slots, inverse) -> torch.Tensor:
    """``[T, O]``: each token's R values times its slot's B, w_t ``[N, R, O]``; zero for tokens on -1."""
    dtype = compute_dtype(w_t)
    rows = _zero_base_blocks(_sorted_blocks(x, gather, block_slots, dtype), block_slots)
    return _to_tokens(torch.bmm(rows, _block_weights(w_t, block_slots, dtype)), inverse)


# ``bgmv_shrink`` / ``bgmv_expand`` through a step's sorted layout; w ``[N, D, R]`` / ``[N, R, O]`` (the
# transposed stacks); tokens on -1 add nothing.
bgmv_shrink_sorted, bgmv_expand_sorted = define_kernel_ops(
    "_sorted", ("gather", "block_slots", "inverse"), _check, sorted_shrink, sorted_expand_delta, transposed=True)
