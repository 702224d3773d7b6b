"""Blocked BGMV: tokens sorted by slot into fixed-size row blocks (DESIGN.md, kernel table).

The same semantics as ``bgmv_shrink`` / ``bgmv_expand`` in
:mod:`xla_lora_pass.ops`, registered as ``torch.ops.xla_lora.bgmv_*_blocked``;
the graph pass emits them when ``config.kernel == "blocked"``,
and ``LoRAMetadata.block_layout`` builds the layout once per step.

The layout is built ONCE per step on the host from the int32 token indices
and shared by every LoRA layer of the step:

* ``row_token`` ``[NB * BS]`` int32: the token each padded row holds, -1 for
  padding rows;
* ``block_slot`` ``[NB]`` int32: the slot (adapter) of each block; unused
  blocks say 0 and hold only padding rows;
* ``token_row`` ``[T]`` int32: the padded row of each token; tokens with
  index -1 point at a padding row (whose value is zero).

``NB = ceil(T / BS) + N`` blocks is a static bound (each slot wastes less than
one block), so every shape depends only on the bucket (T), the slot count (N)
and the block size (BS): one XLA program per bucket, whatever the mapping.
The last block is always unused: the slots' blocks fill at most
``floor((T + N * (BS - 1)) / BS) < NB`` of them.

On the device, per layer, each block multiplies its ``BS`` rows by ONE
slot's weights (a ``[NB, ...]`` weight gather and a batched matmul), so the
LoRA FLOPs are ``NB * BS * R * (D + O)``, against ``T * N * R * (D + O)`` for
the masked form in ``ops.py``: 1/N of the work, plus two row gathers.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

# ops.py imports this module at its end, after defining the shared helper.
from .ops import _compute_dtype

__all__ = ["BLOCK_SIZE", "BlockedLayout", "num_blocks", "build_layout", "blocked_shrink", "blocked_expand",
           "bgmv_shrink_blocked", "bgmv_expand_blocked", "padded_layout"]

BLOCK_SIZE = 32


class BlockedLayout(NamedTuple):
    row_token: torch.Tensor  # [NB * BS] int32, -1 = padding row
    block_slot: torch.Tensor  # [NB] int32
    token_row: torch.Tensor  # [T] int32

    def to(self, device) -> "BlockedLayout":
        return BlockedLayout(*(t.to(device) for t in self))


def num_blocks(num_tokens: int, num_slots: int, block_size: int = BLOCK_SIZE) -> int:
    """Static block count for a bucket: ``ceil(T / BS) + N``."""
    return -(-num_tokens // block_size) + num_slots


def build_layout(idx, num_slots: int, block_size: int = BLOCK_SIZE) -> BlockedLayout:
    """The three index tensors for one step, on the host (CPU), from int32 token indices ``[T]``.

    ``idx[t]`` is token t's slot in ``[0, num_slots)`` or -1 (base model only).  Plain numpy: a
    handful of vector ops on T ints, well under a millisecond for thousands of tokens.
    """
    idx = np.asarray(idx.cpu() if isinstance(idx, torch.Tensor) else idx, dtype=np.int64).reshape(-1)
    num_tokens = idx.size
    if num_tokens and (idx.min() < -1 or idx.max() >= num_slots):
        raise ValueError(f"build_layout: token indices must be in [-1, {num_slots}), got "
                         f"[{int(idx.min())}, {int(idx.max())}]")
    nb = num_blocks(num_tokens, num_slots, block_size)
    rows = nb * block_size
    row_token = np.full(rows, -1, dtype=np.int32)
    block_slot = np.zeros(nb, dtype=np.int32)
    token_row = np.full(num_tokens, rows - 1, dtype=np.int32)  # last row: always padding

    valid = idx >= 0
    counts = np.bincount(idx[valid], minlength=num_slots)  # [N]
    blocks_per_slot = (counts + block_size - 1) // block_size
    first_block = np.cumsum(blocks_per_slot) - blocks_per_slot  # [N]
    block_slot[: blocks_per_slot.sum()] = np.repeat(np.arange(num_slots), blocks_per_slot)
    # Valid tokens sorted by slot (stable), each one's rank within its slot, then its padded row.
    sorted_tokens = np.flatnonzero(valid)[np.argsort(idx[valid], kind="stable")]
    sorted_slots = idx[sorted_tokens]
    slot_start = np.cumsum(counts) - counts
    padded = first_block[sorted_slots] * block_size + np.arange(sorted_tokens.size) - slot_start[sorted_slots]
    row_token[padded] = sorted_tokens
    token_row[sorted_tokens] = padded
    return BlockedLayout(torch.from_numpy(row_token), torch.from_numpy(block_slot), torch.from_numpy(token_row))



def _to_blocks(x: torch.Tensor, layout: BlockedLayout) -> torch.Tensor:
    """``[NB, BS, F]``: each padded row's token row of x, zero on padding rows."""
    nb = layout.block_slot.shape[0]
    rows = x.index_select(0, layout.row_token.clamp(min=0))
    rows = torch.where((layout.row_token >= 0).unsqueeze(-1), rows, torch.zeros((), dtype=x.dtype, device=x.device))
    return rows.reshape(nb, -1, x.shape[1])


def blocked_shrink(x: torch.Tensor, w: torch.Tensor, layout: BlockedLayout, scale: float = 1.0) -> torch.Tensor:
    """``[T, R] = scale * x @ w[idx].T`` through the blocks; zero rows where idx == -1.

    x ``[T, D]``, w ``[N, R, D]``.
    """
    dtype = _compute_dtype(w)
    nb = layout.block_slot.shape[0]
    xb = x.index_select(0, layout.row_token.clamp(min=0)).to(dtype).reshape(nb, -1, x.shape[1])  # [NB, BS, D]
    wb = w.index_select(0, layout.block_slot).to(dtype)  # [NB, R, D]
    out = torch.bmm(xb, wb.transpose(1, 2)).reshape(-1, w.shape[1])  # [NB*BS, R]
    # Zero padding rows on the small [NB*BS, R] side (tokens with -1 read one of them).
    out = torch.where((layout.row_token >= 0).unsqueeze(-1), out, torch.zeros((), dtype=dtype, device=x.device))
    if scale != 1.0:
        out = out * scale
    return out.index_select(0, layout.token_row).to(x.dtype)


def blocked_expand(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, layout: BlockedLayout,
                   add_inputs: bool = True) -> torch.Tensor:
    """``y + x @ w[idx].T`` through the blocks (the delta alone when add_inputs is False).

    x ``[T, R]``, w ``[N, O, R]``, y ``[T, O]``; rows with idx == -1 get nothing.
    """
    dtype = _compute_dtype(w)
    xb = _to_blocks(x.to(dtype), layout)  # [NB, BS, R], zero on padding rows
    wb = w.index_select(0, layout.block_slot).to(dtype)  # [NB, O, R]
    delta = torch.bmm(xb, wb.transpose(1, 2)).reshape(-1, w.shape[1])  # [NB*BS, O]
    delta = delta.index_select(0, layout.token_row).to(y.dtype)  # -1 tokens read a zero padding row
    return y + delta if add_inputs else delta


# ---------------------------------------------------------------------------
# As torch.ops.xla_lora custom ops, for the graph pass (config.kernel = "blocked").
# ---------------------------------------------------------------------------


@torch.library.custom_op("xla_lora::bgmv_shrink_blocked", mutates_args=())
def bgmv_shrink_blocked(x: torch.Tensor, w: torch.Tensor, row_token: torch.Tensor, block_slot: torch.Tensor,
                        token_row: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """``bgmv_shrink`` through a step's block layout (the three tensors of :class:`BlockedLayout`)."""
    return blocked_shrink(x, w, BlockedLayout(row_token, block_slot, token_row), scale)


@bgmv_shrink_blocked.register_fake
def _bgmv_shrink_blocked_fake(x, w, row_token, block_slot, token_row, scale=1.0):
    return x.new_empty((token_row.shape[0], w.shape[1]))


@torch.library.custom_op("xla_lora::bgmv_expand_blocked", mutates_args=())
def bgmv_expand_blocked(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, row_token: torch.Tensor,
                        block_slot: torch.Tensor, token_row: torch.Tensor, add_inputs: bool = True) -> torch.Tensor:
    """``bgmv_expand`` through a step's block layout."""
    return blocked_expand(x, w, y, BlockedLayout(row_token, block_slot, token_row), add_inputs)


@bgmv_expand_blocked.register_fake
def _bgmv_expand_blocked_fake(x, w, y, row_token, block_slot, token_row, add_inputs=True):
    return torch.empty_like(y)


def padded_layout(idx: torch.Tensor, num_slots: int, max_tokens: int, block_size: int = BLOCK_SIZE) -> BlockedLayout:
    """The layout of ``idx`` in buffers of fixed sizes for ``max_tokens`` (the graph narrows them).

    Fixed sizes keep the graph inputs' shapes the same for every bucket; the
    graph narrows them to ``ceil(T / BS) + N`` blocks and T tokens.
    """
    lay = build_layout(idx, num_slots, block_size)
    nb_max = num_blocks(max_tokens, num_slots, block_size)
    row_token = torch.full((nb_max * block_size,), -1, dtype=torch.int32)
    block_slot = torch.zeros(nb_max, dtype=torch.int32)
    token_row = torch.zeros(max_tokens, dtype=torch.int32)
    row_token[: lay.row_token.numel()] = lay.row_token
    block_slot[: lay.block_slot.numel()] = lay.block_slot
    token_row[: lay.token_row.numel()] = lay.token_row
    return BlockedLayout(row_token, block_slot, token_row)
