"""What the caller tells the passes about graph inputs, and what passes ask for.

The pattern library is pure FX: it cannot know which placeholder holds a LoRA
weight.  The caller (``xla_lora_pass.rewrite``) says so by putting a
:class:`LoRAWeightRef` in ``placeholder.meta[LORA_WEIGHT]``.  A pass that
needs a new graph input (the shared token indices, a site's stacked weights)
adds a placeholder carrying a :class:`GraphInputRequest` in
``meta[LORA_INPUT]``; the caller feeds it at run time.
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

import torch

LORA_WEIGHT = "xla_lora_weight"
LORA_INPUT = "xla_lora_input"

TOKEN_INDICES = "token_indices"
STACKED_A = "stacked_a"
STACKED_B = "stacked_b"
# The same stacks with their last two dims swapped ([N, in, R] and [N, R, out]), for the row kernel:
# its batched matmuls then read each gathered slot's weights in the layout they multiply in.
STACKED_A_T = "stacked_a_t"
STACKED_B_T = "stacked_b_t"
STACKED_BIAS = "stacked_bias"
# The blocked kernel's per-step layout (xla_lora_pass/ops_blocked.py), shared by every site.
LAYOUT_ROW_TOKEN = "layout_row_token"
LAYOUT_BLOCK_SLOT = "layout_block_slot"
LAYOUT_TOKEN_ROW = "layout_token_row"
LAYOUT_KINDS = (LAYOUT_ROW_TOKEN, LAYOUT_BLOCK_SLOT, LAYOUT_TOKEN_ROW)
# The row kernel's per-step input: the slot of each row of the token grid (xla_lora_pass/ops_rows.py).
ROW_SLOTS = "row_slots"
# The segment kernel's per-step layout (xla_lora_pass/ops_segments.py), shared by every site: each block's
# slots [max_blocks, K] and each token's pass [max_num_tokens].
SEGMENT_BLOCK_SLOTS = "segment_block_slots"
SEGMENT_PICK = "segment_pick"
SEGMENT_KINDS = (SEGMENT_BLOCK_SLOTS, SEGMENT_PICK)


@dataclasses.dataclass(frozen=True)
class LoRAWeightRef:
    """A placeholder that is one adapter's LoRA weight at one site."""

    site: str
    adapter: str
    role: str  # "A", "B" or "bias"
    kind: str  # "linear" or "embedding"
    in_features: int
    out_features: int
    scaling: float  # the adapter's own scaling, as the eager module applies it
    num_slots: int
    stacked_rank: int  # the site's max rank over all slots
    dtype: torch.dtype
    unsupported: Optional[str] = None  # why the site can never be rewritten


@dataclasses.dataclass(frozen=True)
class GraphInputRequest:
    """A new placeholder the caller must feed: token indices or a site's stacked weights."""

    kind: str  # TOKEN_INDICES, ROW_SLOTS, STACKED_A(_T), STACKED_B(_T), STACKED_BIAS, LAYOUT_KINDS, SEGMENT_KINDS
    site: Optional[str] = None
    shape: Tuple[int, ...] = ()
    dtype: torch.dtype = torch.int32
    # SEGMENT_KINDS: (tokens per block, slots per block) the graph was rewritten for; the layout is built with them.
    blocks: Tuple[int, ...] = ()
