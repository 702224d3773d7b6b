"""What a ``generate`` call was asked for, read off its arguments: the prompt, its length, the batch it makes,
the cache it was given."""
from __future__ import annotations

from typing import Any, Optional, Tuple

import torch

# The keywords a cache goes by: ``cache`` from transformers 5.25 (``generate`` and the models' forwards),
# ``past_key_values`` before; 5.25 still takes the old name, renamed with a FutureWarning, and drops it when
# ``cache`` is given too.
CACHE_KEYWORDS = ("cache", "past_key_values")


def prompt_of(args, kwargs):
    """The prompt generate was given: its ids, or its embeddings."""
    prompt = kwargs.get("input_ids", args[0] if args else None)
    return kwargs.get("inputs_embeds") if prompt is None else prompt


def prompt_length(args, kwargs) -> Optional[int]:
    """The prompt's length (None if it is not a tensor of ids or embeddings)."""
    prompt = prompt_of(args, kwargs)
    return int(prompt.shape[1]) if isinstance(prompt, torch.Tensor) and prompt.dim() >= 2 else None


def batch_size(args, kwargs) -> int:
    """The rows the cache holds: the prompt's, times the sequences generate makes of each."""
    prompt = prompt_of(args, kwargs)
    return int(prompt.shape[0]) * expansion(kwargs)


def expansion(kwargs) -> int:
    """How many sequences generate makes of each prompt row (beams, or returned sequences)."""
    return max(int(kwargs.get("num_beams") or 1), int(kwargs.get("num_return_sequences") or 1))


def given_cache(kwargs) -> Tuple[Optional[str], Any]:
    """(keyword, cache) of the cache in ``kwargs`` under either keyword, ``cache`` first as transformers reads
    them; (None, None) when there is none."""
    keyword = next((k for k in CACHE_KEYWORDS if kwargs.get(k) is not None), None)
    return keyword, None if keyword is None else kwargs[keyword]
