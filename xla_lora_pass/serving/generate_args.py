"""What a ``generate`` call was asked for, read off its arguments: the prompt, its length, the batch it makes."""
from __future__ import annotations

from typing import Optional

import torch


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
