"""Segment BGMV: packed batches, requests as contiguous segments of one flat token row.

The same semantics as ``bgmv_shrink`` / ``bgmv_expand`` in
:mod:`xla_lora_pass.kernels.masked`, registered as ``torch.ops.xla_lora.bgmv_*_segments``,
for a mapping where each block of consecutive tokens uses at most K slots: a
packed batch (vLLM's ``[T, H]``, or a ``[1, T]`` row holding several
requests), whose requests are segments of at least one block each.

The tokens are cut into ``NB`` blocks of ``BS`` consecutive tokens (a reshape,
no token is moved).  The host gives each block K slots (``block_slots``
``[NB, K]``, the slots its tokens use, in order of first use) and each token
the pass it takes (``pick`` ``[T]``: 0..K-1, or -1 for a token on the base
model).  Semantics, against the references in common.py
(``segment_token_indices``; w_t^T: ``w_t.transpose(1, 2)``)::

    idx[t] = block_slots[t // BS, pick[t]] if pick[t] >= 0 else -1
    bgmv_shrink_segments(x, w_t, block_slots, pick, scale) == bgmv_shrink_reference(x, w_t^T, idx, scale)
    bgmv_expand_segments(x, w_t, y, block_slots, pick, add) == bgmv_expand_reference(x, w_t^T, y, idx, add)

On the device, per site, each block multiplies its tokens by its K
slots' weights in one batched matmul over K*R columns and keeps each token's
own R columns; the expand spreads each token's R values into its pass's
columns and multiplies by the K slots' B stacked along the rank.  K = 2 covers
every segment of at least BS tokens at any offset (a block meets at most the
end of one and the start of the next); the cut blocks need no second pass.
The LoRA FLOPs are K times the LoRA's own, against N times for the masked
form; the weight gather is ``NB * K`` slots per site.  Measured here on one
512x512 linear with 16 segments of 32 tokens: the row kernel's cost
(docs/kernels.md).

The layout is built once per step on the host (``build_segment_layout``),
shared by every site, in buffers sized for ``max_num_tokens`` (the graph
narrows them): shapes depend only on the bucket, so a new segment layout
within a bucket compiles nothing.  A mapping some block of which uses more
than K slots has no segment layout (None); the backend then runs the sorted
kernel (kernels/sorted_tokens.py), or the masked one for a bucket too small to sort.
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

import numpy as np
import torch

from .common import bgmv_expand_reference, bgmv_shrink_reference, compute_dtype, define_kernel_ops

__all__ = ["SegmentLayout", "segment_blocks", "build_segment_layout", "segment_buffers", "segment_token_indices",
           "bgmv_shrink_segments", "bgmv_expand_segments", "bgmv_shrink_segments_reference",
           "bgmv_expand_segments_reference"]


class SegmentLayout(NamedTuple):
    block_slots: torch.Tensor  # [NB, K] int32: the slots each block's tokens use (0 where unused)
    pick: torch.Tensor  # [T] int32: each token's pass in its block, -1 = base model only


def segment_blocks(num_tokens: int, block_tokens: int) -> Tuple[int, int]:
    """(blocks, tokens per block) for ``num_tokens``: ``ceil(T / block_tokens)`` even blocks.

    The graph narrows the block buffer to ``ceil(T / block_tokens)`` and the op
    reads the block length off the shapes, so host and device agree for any T
    (a bucket under ``block_tokens`` is one block).
    """
    blocks = max(1, -(-num_tokens // block_tokens))
    return blocks, -(-num_tokens // blocks)


def build_segment_layout(idx, block_tokens: int, slots_per_block: int) -> Optional[SegmentLayout]:
    """The layout of int32 token indices ``idx`` ``[T]`` (-1 = base), or None if a block needs more passes.

    Plain numpy over ``slots_per_block`` passes of T ints: a few vector ops
    per pass, well under a millisecond for thousands of tokens.
    """
    idx = np.asarray(idx.cpu() if isinstance(idx, torch.Tensor) else idx, dtype=np.int64).reshape(-1)
    num_tokens = idx.size
    blocks, length = segment_blocks(num_tokens, block_tokens)
    grid = np.full(blocks * length, -1, dtype=np.int64)
    grid[:num_tokens] = idx
    grid = grid.reshape(blocks, length)
    pick = np.full(grid.shape, -1, dtype=np.int32)
    block_slots = np.zeros((blocks, slots_per_block), dtype=np.int32)
    open_ = grid >= 0  # tokens with a slot and no pass yet
    for k in range(slots_per_block):
        has = open_.any(axis=1)
        # Each block's first token without a pass names pass k's slot; its tokens of that slot take it.
        slot = grid[np.arange(blocks), open_.argmax(axis=1)]
        block_slots[has, k] = slot[has]
        takes = open_ & (grid == slot[:, None]) & has[:, None]
        pick[takes] = k
        open_ &= ~takes
    if open_.any():
        return None
    return SegmentLayout(torch.from_numpy(block_slots), torch.from_numpy(pick.reshape(-1)[:num_tokens].copy()))


def segment_buffers(layout: SegmentLayout, block_tokens: int, max_num_tokens: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """``layout`` in the fixed-size buffers a graph narrows to its bucket: block slots
    ``[ceil(max_num_tokens / block_tokens), K]`` (zeros past the layout) and pick ``[max_num_tokens]`` (-1 past it)."""
    block_slots = torch.zeros(-(-max_num_tokens // block_tokens), layout.block_slots.shape[1], dtype=torch.int32)
    block_slots[: layout.block_slots.shape[0]] = layout.block_slots
    pick = torch.full((max_num_tokens,), -1, dtype=torch.int32)
    pick[: layout.pick.numel()] = layout.pick
    return block_slots, pick


def segment_token_indices(block_slots: torch.Tensor, pick: torch.Tensor) -> torch.Tensor:
    """The per-token slot indices ``[T]`` a layout stands for (-1 where ``pick`` is -1)."""
    blocks, length = block_slots.shape[0], -(-pick.shape[0] // block_slots.shape[0])
    block_of = torch.arange(pick.shape[0], device=pick.device) // length
    slots = block_slots[block_of.clamp(max=blocks - 1), pick.clamp(min=0).long()]
    return torch.where(pick >= 0, slots, torch.full_like(slots, -1)).to(torch.int32)


def bgmv_shrink_segments_reference(x, w_t, block_slots, pick, scale: float = 1.0):
    """The definition: ``bgmv_shrink_reference`` on the indices the layout stands for (w_t ``[N, D, R]``)."""
    return bgmv_shrink_reference(x, w_t.transpose(1, 2), segment_token_indices(block_slots, pick), scale)


def bgmv_expand_segments_reference(x, w_t, y, block_slots, pick, add_inputs: bool = True):
    """The definition: ``bgmv_expand_reference`` on the layout's indices (w_t ``[N, R, O]``)."""
    return bgmv_expand_reference(x, w_t.transpose(1, 2), y, segment_token_indices(block_slots, pick), add_inputs)


def _check(name: str, x: torch.Tensor, w: torch.Tensor, block_slots: torch.Tensor, pick: torch.Tensor) -> None:
    torch._check(x.dim() == 2, lambda: f"{name}: x must be [T, D], got {tuple(x.shape)}")
    torch._check(w.dim() == 3, lambda: f"{name}: w must be [N, in, out], got {tuple(w.shape)}")
    torch._check(block_slots.dim() == 2, lambda: f"{name}: block_slots must be [NB, K], got {tuple(block_slots.shape)}")
    torch._check(pick.dim() == 1 and pick.shape[0] == x.shape[0],
                 lambda: f"{name}: pick must be [T] with T={x.shape[0]}, got {tuple(pick.shape)}")
    torch._check(x.shape[1] == w.shape[1], lambda: f"{name}: x has {x.shape[1]} features, w expects {w.shape[1]}")


def _blocked(t: torch.Tensor, blocks: int, fill=0) -> torch.Tensor:
    """``[T, ...]`` as ``[NB, BS, ...]``, padded with ``fill`` at the end when NB does not divide T."""
    length = -(-t.shape[0] // blocks)
    pad = blocks * length - t.shape[0]
    if pad:
        t = torch.cat([t, t.new_full((pad, *t.shape[1:]), fill)])
    return t.reshape(blocks, length, *t.shape[1:])


def _pass_mask(pick: torch.Tensor, blocks: int, passes: int) -> torch.Tensor:
    """``[NB, BS, K, 1]`` bool: the token's pass is k; all False for -1 and for padding."""
    ks = torch.arange(passes, device=pick.device, dtype=pick.dtype)
    return (_blocked(pick, blocks, fill=-1).unsqueeze(-1) == ks).unsqueeze(-1)


def _block_weights(w: torch.Tensor, block_slots: torch.Tensor, dtype) -> torch.Tensor:
    """Each block's K slots' weights ``[NB, K, in, out]``."""
    blocks, passes = block_slots.shape
    return w.index_select(0, block_slots.reshape(-1).clamp(min=0).long()).to(dtype).view(blocks, passes, *w.shape[1:])


def segments_shrink(x, w_t, block_slots, pick, scale: float = 1.0) -> torch.Tensor:
    """``[T, R]``: each token times its pass's slot of its block, w_t ``[N, D, R]``; zero where pick is -1."""
    dtype = compute_dtype(w_t)
    blocks, passes = block_slots.shape
    rank = w_t.shape[2]
    # [NB, D, K*R]: the K slots side by side, so one batched matmul serves every pass.
    wk = _block_weights(w_t, block_slots, dtype).permute(0, 2, 1, 3).reshape(blocks, w_t.shape[1], passes * rank)
    cols = torch.bmm(_blocked(x.to(dtype), blocks), wk).view(blocks, -1, passes, rank)
    # where(), not a multiply: a NaN in one pass's columns stays out of the others.
    out = torch.where(_pass_mask(pick, blocks, passes), cols, torch.zeros((), dtype=dtype, device=x.device)).sum(2)
    out = out.reshape(-1, rank)[: x.shape[0]]
    return out * scale if scale != 1.0 else out


def segments_expand_delta(x, w_t, block_slots, pick) -> torch.Tensor:
    """``[T, O]``: each token's R values times its pass's slot's B, w_t ``[N, R, O]``; zero where pick is -1."""
    dtype = compute_dtype(w_t)
    blocks, passes = block_slots.shape
    rank = w_t.shape[1]
    spread = torch.where(_pass_mask(pick, blocks, passes), _blocked(x.to(dtype), blocks).unsqueeze(2),
                         torch.zeros((), dtype=dtype, device=x.device)).reshape(blocks, -1, passes * rank)
    wk = _block_weights(w_t, block_slots, dtype).reshape(blocks, passes * rank, w_t.shape[2])  # no transpose
    return torch.bmm(spread, wk).reshape(-1, w_t.shape[2])[: x.shape[0]]


# ``bgmv_shrink`` / ``bgmv_expand`` through a step's segment layout; w ``[N, D, R]`` / ``[N, R, O]`` (the row
# kernel's transposed stacks); tokens whose pick is -1 add nothing.
bgmv_shrink_segments, bgmv_expand_segments = define_kernel_ops(
    "_segments", ("block_slots", "pick"), _check, segments_shrink, segments_expand_delta, transposed=True)
