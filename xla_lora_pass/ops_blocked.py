"""The host-side layout of the removed blocked kernel; only ``LoRAMetadata.block_layout`` still reads it.

The blocked kernel (tokens sorted by slot into fixed-size row blocks) was
removed: at model level it never beat the masked kernel (1.54x the base model
against 1.48x in the same run, docs/benchmarks.md), and the segment kernel
serves packed batches.  Its ops are gone; this module goes with
``LoRAMetadata.block_layout``, which is removed with the metadata split.

The layout, built on the host from the int32 token indices:

* ``row_token`` ``[NB * BS]`` int32: the token each padded row holds, -1 for
  padding rows;
* ``block_slot`` ``[NB]`` int32: the slot (adapter) of each block;
* ``token_row`` ``[T]`` int32: the padded row of each token.

``NB = ceil(T / BS) + N`` blocks is a static bound (each slot wastes less than
one block).
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

__all__ = ["BLOCK_SIZE", "BlockedLayout", "num_blocks", "build_layout", "padded_layout"]

BLOCK_SIZE = 32


class BlockedLayout(NamedTuple):
    row_token: torch.Tensor  # [NB * BS] int32, -1 = padding row
    block_slot: torch.Tensor  # [NB] int32
    token_row: torch.Tensor  # [T] int32


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
