"""Each generate step's attention mask, built inside the compiled forward rather than by HF on the host.

With a static cache, HF's ``prepare_inputs_for_generation`` turns the 2-d
mask (one column per token so far, one more each step) into the 4-d mask
before every forward, eagerly (``create_masks_for_generate``): on XLA a host
trace of many small ops per step, a quarter of a batch-1 step, and one more
program per sequence length.  Here, for a decoder-only model whose forward
takes ``cache_position`` (transformers 4.x; 5.x's generate passes none and
keeps HF's own mask):

- the model's ``create_masks_for_generate`` (HF looks it up on the model
  first) returns, on a generate's first step, its 2-d mask padded with ones
  to the cache's length, and that same tensor on every later step: no op
  per step;
- the compiled forward sets each step's mask from it inside the program:
  a column is kept up to the step's last cache position, as HF's mask
  (the prompt's own columns, ones for every generated token) padded with
  zeros to the cache length (what HF's ``prepare_padding_mask`` does)
  would keep it.  The forward then builds its 4-d mask from that 2-d mask as
  ``create_masks_for_generate`` would have: the same mask, so the same tokens.
"""
from __future__ import annotations

import contextlib
import inspect

import torch
import torch.nn.functional as F

GENERATE_MASK = "xla_lora_generate_mask"  # the forward's keyword for the padded mask


def forward_setting_step_mask(forward):
    """``forward`` taking ``xla_lora_generate_mask=``: the padded mask, made this step's mask from
    ``cache_position`` inside the traced program."""

    def forward_with_generate_mask(*args, **kwargs):
        padded = kwargs.pop(GENERATE_MASK, None)
        if padded is not None:
            kwargs["attention_mask"] = step_mask(padded, kwargs["cache_position"])
        return forward(*args, **kwargs)

    return forward_with_generate_mask


def step_mask(padded: torch.Tensor, cache_position: torch.Tensor) -> torch.Tensor:
    """HF's 2-d mask of the step whose last position is ``cache_position[-1]``, zero-padded to the cache."""
    columns = torch.arange(padded.shape[-1], device=padded.device)
    return (padded.bool() & (columns <= cache_position[-1])).to(padded.dtype)


class GenerateMask:
    """One generate's padded 2-d mask, made on its first step."""

    def __init__(self, default_create_masks):
        self.default_create_masks = default_create_masks
        self.padded = None

    def create_masks_for_generate(self, **kwargs):
        """HF's hook (called with keywords by transformers 4.57): the padded mask; HF's own where it does
        not apply (no 2-d mask, no static length, token types that can unmask later columns)."""
        mask, cache = kwargs.get("attention_mask"), kwargs.get("past_key_values")
        length = cache.get_max_cache_shape() if hasattr(cache, "get_max_cache_shape") else None
        if (not isinstance(mask, torch.Tensor) or mask.dim() != 2 or kwargs.get("cache_position") is None
                or kwargs.get("token_type_ids") is not None or not isinstance(length, int)
                or mask.shape[-1] > length):
            return self.default_create_masks(**kwargs)
        if self.padded is None or self.padded.shape[0] != mask.shape[0]:
            # Ones past the mask: every token generate appends has a one (HF concatenates ones).
            self.padded = F.pad(mask, (0, length - mask.shape[-1]), value=1)
        return self.padded

    def forward(self, compiled):
        """The model's forward during the generate: ``compiled`` (made by forward_setting_step_mask), given the
        padded mask as ``xla_lora_generate_mask`` when HF passes it as the attention mask."""

        def forward(*args, **kwargs):
            if self.padded is not None and kwargs.get("attention_mask") is self.padded:
                kwargs[GENERATE_MASK] = kwargs.pop("attention_mask")
            return compiled(*args, **kwargs)

        return forward


def applies_to(transformer: torch.nn.Module) -> bool:
    """Whether a generate of this model can get its masks in the program: a decoder-only model using HF's
    general ``create_masks_for_generate`` (none of its class's or set on it), whose forward takes
    ``cache_position``."""
    from transformers import masking_utils

    config = getattr(transformer, "config", None)
    if config is None or getattr(config, "is_encoder_decoder", False):
        return False
    if hasattr(transformer, "create_masks_for_generate") or not hasattr(masking_utils,
                                                                              "create_masks_for_generate"):
        return False
    forward = type(transformer).forward
    return "cache_position" in inspect.signature(forward).parameters


@contextlib.contextmanager
def masks_in_program(transformer: torch.nn.Module, compiled):
    """Inside the block, a generate on ``transformer`` runs ``compiled`` (forward_setting_step_mask's, compiled)
    as its forward, with each step's mask made in the program (module doc)."""
    from transformers import masking_utils

    state = GenerateMask(masking_utils.create_masks_for_generate)
    had_forward = "forward" in transformer.__dict__
    saved_forward = transformer.__dict__.get("forward")
    transformer.forward = state.forward(compiled)
    transformer.create_masks_for_generate = state.create_masks_for_generate
    try:
        yield state
    finally:
        del transformer.create_masks_for_generate
        if had_forward:
            transformer.forward = saved_forward
        else:
            del transformer.forward
