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
from typing import Optional, Tuple, Union

import torch

LORA_WEIGHT = "xla_lora_weight"
LORA_INPUT = "xla_lora_input"
# A registered site's base-layer weight: how a site is found in a graph that holds no LoRA branch for it
# (its adapters are all inactive).  A tuple of LoRAWeightRef with role "base", one per site reading the
# tensor: tied weights (embed_tokens and lm_head) are one graph input for several sites.
BASE_WEIGHT = "xla_lora_base_weight"
# A parameter or buffer of a PEFT modules_to_save module (the original or one adapter's copy).
SAVED_PARAM = "xla_lora_saved_param"

TOKEN_INDICES = "token_indices"
STACKED_A = "stacked_a"
STACKED_B = "stacked_b"
# The same stacks with their last two dims swapped ([N, in, R] and [N, R, out]), for the row kernel:
# its batched matmuls then read each gathered slot's weights in the layout they multiply in.
STACKED_A_T = "stacked_a_t"
STACKED_B_T = "stacked_b_t"
STACKED_BIAS = "stacked_bias"
# DoRA's per-slot [N, 2, out] rescaling (gain m/||W + sBA|| - 1, and gain * base bias); zeros for other slots.
STACKED_DORA = "stacked_dora"
# The row kernel's per-step input: the slot of each row of the token grid (xla_lora_pass/kernels/rows.py).
ROW_SLOTS = "row_slots"
# The same slot per row, for a saved module that pools each row to one output (a classification head);
# apart from ROW_SLOTS because it does not select the row kernel.
POOLED_ROW_SLOTS = "pooled_row_slots"
# One tensor of a saved module's variant: GraphInputRequest.param = (adapter or None for the original, name).
SAVED_MODULE_PARAM = "saved_module_param"
# The segment kernel's per-step layout (xla_lora_pass/kernels/segments.py), shared by every site: each block's
# slots [max_blocks, K] and each token's pass [max_num_tokens].
SEGMENT_BLOCK_SLOTS = "segment_block_slots"
SEGMENT_PICK = "segment_pick"
# The sorted kernel's per-step layout (xla_lora_pass/kernels/sorted_tokens.py), shared by every site: the token of each
# sorted row [max_blocks * BS], each block's slot [max_blocks] and each token's sorted row [max_num_tokens].
SORTED_GATHER = "sorted_gather"
SORTED_BLOCK_SLOTS = "sorted_block_slots"
SORTED_INVERSE = "sorted_inverse"


@dataclasses.dataclass(frozen=True)
class LoRAWeightRef:
    """A placeholder that is one adapter's LoRA weight at one site."""

    site: str
    adapter: Optional[str]  # None for the base weight (role "base")
    role: str  # "A", "B", "bias", "magnitude" (DoRA), "slices" (loralib), "scaling" (a scaling tensor) or "base"
    kind: str  # "linear" or "embedding"
    in_features: int
    out_features: int
    scaling: float  # the adapter's own scaling, as the eager module applies it
    num_slots: int
    stacked_rank: int  # the site's max rank over all slots
    dtype: torch.dtype
    unsupported: Optional[str] = None  # why the site can never be rewritten
    lora_bias: bool = False  # some adapter at the site has a LoRA bias (stacked_bias is fed)
    dora: bool = False  # some slot of the site is a DoRA adapter: every rewrite of it rescales per token
    # The site's module's key in the nodes' meta["nn_module_stack"] (str(id(module))): which of the
    # sites sharing a base weight an op of one kind belongs to.  None: unknown.
    module_key: Optional[str] = None


@dataclasses.dataclass(frozen=True)
class SavedParamRef:
    """A placeholder that is a tensor of a saved module (PEFT ``modules_to_save``): which variant, which tensor."""

    site: str  # the saved module's path
    adapter: Optional[str]  # whose copy; None for the original module (rows on the base model)
    param: str  # the tensor's name inside the module, e.g. "dense.weight"
    module_key: str  # the wrapper's key in the nodes' meta["nn_module_stack"] (str(id(wrapper)))
    adapters: Tuple[str, ...] = ()  # every adapter with its own copy
    slots: Tuple[Optional[str], ...] = ()  # adapter name per slot (None: free slot)


@dataclasses.dataclass(frozen=True)
class GraphInputRequest:
    """A new placeholder the caller must feed: token indices or a site's stacked weights."""

    kind: str  # TOKEN_INDICES, (POOLED_)ROW_SLOTS, STACKED_A(_T), STACKED_B(_T), STACKED_BIAS, STACKED_DORA,
    # SAVED_MODULE_PARAM, or a kernel's own (KernelSpec.input_kinds: ROW_SLOTS, SEGMENT_BLOCK_SLOTS, SEGMENT_PICK)
    site: Union[str, Tuple[str, ...], None] = None  # a tuple of sites for an A fused over sites sharing an input
    shape: Tuple[int, ...] = ()
    dtype: torch.dtype = torch.int32
    param: Optional[Tuple[Optional[str], str]] = None  # SAVED_MODULE_PARAM: (adapter or None, tensor name)
    # The segment kernel's inputs: (tokens per block, slots per block) the graph was rewritten for; the sorted
    # kernel's: (tokens per block, groups: the slots and the base).  The layout is built with them.
    blocks: Tuple[int, ...] = ()
