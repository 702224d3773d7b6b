"""Each generate step's attention mask, built inside the compiled forward rather than by HF on the host.

With a static cache, HF's ``prepare_inputs_for_generation`` turns the 2-d
mask (one column per token so far, one more each step) into the 4-d mask
before every forward, eagerly (``create_masks_for_generate``): on XLA a host
trace of many small ops per step, a quarter of a batch-1 step, and one more
program per sequence length.  Here, for a decoder-only model whose forward
takes ``cache_position`` (transformers 4.x), or, where generate passes none
(transformers 5.x), takes the cache and gets a static cache with no sliding
or linear-attention layer:

- the model's ``create_masks_for_generate`` (HF looks it up on the model
  first) returns, on a generate's first step, its 2-d mask padded with ones
  to the cache's length, and that same tensor on every later step: no op
  per step;
- the compiled forward sets each step's mask from it inside the program:
  a column is kept up to the step's last cache position (the last of
  ``cache_position``, or the cache's length before the step plus its
  tokens, less one: a device tensor in transformers 5's static cache, so
  an input of the program, not a constant), as HF's mask
  (the prompt's own columns, ones for every generated token) padded with
  zeros to the cache length (what HF's ``prepare_padding_mask`` does)
  would keep it.  The forward then builds its 4-d mask from that 2-d mask as
  ``create_masks_for_generate`` would have: the same mask, so the same tokens.
"""
from __future__ import annotations

import contextlib
import functools
import inspect

import torch
import torch.nn.functional as F

from .generate_args import CACHE_KEYWORDS, given_cache

GENERATE_MASK = "xla_lora_generate_mask"  # the forward's keyword for the padded mask


def forward_setting_step_mask(forward):
    """``forward`` taking ``xla_lora_generate_mask=``: the padded mask, made this step's mask from the step's
    last cache position inside the traced program."""

    # The model's own signature (``__wrapped__``): HF's generate passes ``position_ids`` and ``logits_to_keep``
    # only to a forward whose signature names them.  Without them GPT-2's learned positions ignored the left
    # padding (wrong tokens) and OPT's forward raised; rotary models hid it.
    @functools.wraps(forward, updated=())  # not its __dict__ (a compiled callable's marks)
    def forward_with_generate_mask(*args, **kwargs):
        padded = kwargs.pop(GENERATE_MASK, None)
        if padded is not None:
            kwargs["attention_mask"] = step_mask(padded, last_position(kwargs))
        return forward(*args, **kwargs)

    return forward_with_generate_mask


def last_position(kwargs: dict):
    """The cache position of the step's last token, from the forward's keywords: the last of
    ``cache_position`` (transformers 4), else the cache's length before the step plus the step's tokens, less
    one (transformers 5 passes no ``cache_position``; read before the forward writes the cache)."""
    if kwargs.get("cache_position") is not None:
        return kwargs["cache_position"][-1]
    cache = given_cache(kwargs)[1]
    tokens = kwargs["input_ids"] if kwargs.get("input_ids") is not None else kwargs["inputs_embeds"]
    return cache.get_seq_length() + tokens.shape[1] - 1


def step_mask(padded: torch.Tensor, last) -> torch.Tensor:
    """HF's 2-d mask of the step whose last cache position is ``last``, zero-padded to the cache."""
    columns = torch.arange(padded.shape[-1], device=padded.device)
    return (padded.bool() & (columns <= last)).to(padded.dtype)


class GenerateMask:
    """One generate's padded 2-d mask, made on its first step."""

    def __init__(self, default_create_masks):
        self.default_create_masks = default_create_masks
        self.padded = None

    def create_masks_for_generate(self, **kwargs):
        """HF's hook (called with keywords by transformers 4.57 and 5.x): the padded mask; HF's own where it
        does not apply (no 2-d mask, no static length, token types that can unmask later columns, and
        without ``cache_position`` a cache that does not count its tokens as one full-attention layer does)."""
        mask = kwargs.get("attention_mask")
        cache = given_cache(kwargs)[1]
        length = _static_length(cache) if kwargs.get("cache_position") is not None else _counted_length(cache)
        if (not isinstance(mask, torch.Tensor) or mask.dim() != 2 or not isinstance(length, int)
                or any(kwargs.get(k) is not None for k in ("token_type_ids", "mm_token_type_ids"))
                or mask.shape[-1] > length):
            return self.default_create_masks(**kwargs)
        if self.padded is None or self.padded.shape[0] != mask.shape[0]:
            # Ones past the mask: every token generate appends has a one (HF concatenates ones).
            self.padded = F.pad(mask, (0, length - mask.shape[-1]), value=1)
        return self.padded

    def forward(self, compiled):
        """The model's forward during the generate: ``compiled`` (made by forward_setting_step_mask), given the
        padded mask as ``xla_lora_generate_mask`` when HF passes it as the attention mask."""

        @functools.wraps(compiled, updated=())  # the model's signature (forward_setting_step_mask)
        def forward(*args, **kwargs):
            if self.padded is not None and kwargs.get("attention_mask") is self.padded:
                kwargs[GENERATE_MASK] = kwargs.pop("attention_mask")
            return compiled(*args, **kwargs)

        return forward


def _static_length(cache):
    """The cache's static length (transformers 4's static caches), None for any other cache."""
    length = cache.get_max_cache_shape() if hasattr(cache, "get_max_cache_shape") else None
    return length if isinstance(length, int) and length > 0 else None


def _counted_length(cache):
    """Transformers 5: the static length of a cache whose ``get_seq_length`` is the tokens before the step in
    every layer (static full-attention layers only: no sliding window, no linear attention), None for any
    other cache."""
    from transformers import cache_utils

    linear = getattr(cache_utils, "LinearAttentionCacheLayerMixin", ())
    layers = getattr(cache, "layers", None)
    if not isinstance(cache, cache_utils.Cache) or not layers or not all(
            isinstance(layer, cache_utils.StaticLayer) and not getattr(layer, "is_sliding", True)
            and not isinstance(layer, linear) for layer in layers):
        return None
    length = cache.get_max_length() if hasattr(cache, "get_max_length") else None
    return length if isinstance(length, int) and length > 0 else None


def applies_to(transformer: torch.nn.Module) -> bool:
    """Whether a generate of this model can get its masks in the program: a decoder-only model using HF's
    general ``create_masks_for_generate`` (none of its class's or set on it), whose forward takes
    ``cache_position`` or, on transformers 5 (whose generate passes no ``cache_position``), the cache."""
    import transformers
    from transformers import masking_utils

    config = getattr(transformer, "config", None)
    if config is None or getattr(config, "is_encoder_decoder", False):
        return False
    if hasattr(transformer, "create_masks_for_generate") or not hasattr(masking_utils,
                                                                              "create_masks_for_generate"):
        return False
    parameters = inspect.signature(type(transformer).forward).parameters
    if "cache_position" in parameters:
        return True
    return int(transformers.__version__.split(".")[0]) >= 5 and any(k in parameters for k in CACHE_KEYWORDS)


@contextlib.contextmanager
def masks_in_program(transformer: torch.nn.Module, compiled):
    """Inside the block, a generate on ``transformer`` runs ``compiled`` (forward_setting_step_mask's, compiled)
    as its forward, with each step's mask made in the program (module doc)."""
    from transformers import masking_utils
    from transformers.generation import utils as generation_utils

    # What HF's generate would call without the hook: the name its own module holds.
    state = GenerateMask(getattr(generation_utils, "create_masks_for_generate",
                                 masking_utils.create_masks_for_generate))
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
