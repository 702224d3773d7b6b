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
STACKED_BIAS = "stacked_bias"


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

    kind: str  # TOKEN_INDICES, STACKED_A, STACKED_B or STACKED_BIAS
    site: Optional[str] = None
    shape: Tuple[int, ...] = ()
    dtype: torch.dtype = torch.int32
