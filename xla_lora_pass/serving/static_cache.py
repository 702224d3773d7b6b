"""The static-cache policy of a served ``generate``: a cache of a bucketed length, made once and reused.

A dynamic cache grows by one position per token, and padding it cannot be
exact (HF's causal mask compares key positions with ``cache_position``
values, which padding the cache would shift), so it would cost one program
per generated token.  Decoder-only models get a ``StaticCache`` whose length
is the backend's token bucket of prompt + new tokens (``Buckets.pad_length``:
past the largest bucket, the next power of two), in place of the default
dynamic cache and of ``cache_implementation="static"`` (whose length is the
exact total): the same tokens (its unused positions are masked) with one
decode program per batch size.  Encoder-decoder models (T5) get HF's
``EncoderDecoderCache`` of a static self-attention cache of the bucket of
decoder start + new tokens and a static cross-attention cache of the
encoder's length.
"""
from __future__ import annotations

import functools
import inspect
from typing import Any, MutableMapping, Optional

import torch

from ..shapes import Buckets
from .generate_args import CACHE_KEYWORDS, batch_size, given_cache, prompt_length

# transformer -> {(length, batch, dtype, device, cross length): cache}, one such mapping per backend.
CacheStore = MutableMapping[torch.nn.Module, dict]


@functools.lru_cache(maxsize=None)
def generate_cache_keyword() -> str:
    """The keyword the installed transformers' ``generate`` takes a cache by (its default cache name)."""
    try:
        from transformers.generation.utils import ALL_CACHE_NAMES
    except ImportError:  # no transformers, or one without the list: the long-standing name
        return "past_key_values"
    return ALL_CACHE_NAMES[0] if ALL_CACHE_NAMES and ALL_CACHE_NAMES[0] in CACHE_KEYWORDS else "past_key_values"


def use_bucketed_static_cache(transformer: torch.nn.Module, buckets: Buckets, caches: CacheStore, args,
                              kwargs) -> None:
    """Put a bucketed ``StaticCache`` into ``kwargs`` (an encoder-decoder's two; see the module doc), kept in
    ``caches``."""
    keyword, given = given_cache(kwargs)
    if keyword is not None:
        if not getattr(given, "is_compileable", False):
            raise ValueError(
                f"generate: {keyword} is a {type(given).__name__}, which grows by one position per token, "
                "so every decode step would compile a new program; pass no cache (the backend uses a static "
                "cache of a bucketed length) or cache_implementation='static'")
        return
    config = getattr(transformer, "config", None)
    implementation = kwargs.get("cache_implementation")
    if config is None or kwargs.get("use_cache") is False:
        return
    if implementation not in (None, "static"):
        raise ValueError(
            f"generate: cache_implementation={implementation!r} is not served by the xla_lora backend; use the "
            "default cache or cache_implementation='static' (both run on a static cache of a bucketed length)")
    if getattr(config, "is_encoder_decoder", False):
        lengths = _encoder_decoder_lengths(transformer, args, kwargs)
        if lengths is None:
            return
        kwargs.pop("cache_implementation", None)
        decoder_total, encoder_length = lengths
        kwargs[generate_cache_keyword()] = serving_cache(
            caches, transformer, buckets.pad_length(decoder_total), batch_size(args, kwargs),
            cross_attention_length=encoder_length)
        return
    length = prompt_length(args, kwargs)
    total = None if length is None else _total_length(transformer, kwargs, length)
    if total is None:
        return
    kwargs.pop("cache_implementation", None)
    kwargs[generate_cache_keyword()] = serving_cache(caches, transformer, buckets.pad_length(total),
                                                     batch_size(args, kwargs))


def _total_length(transformer, kwargs, start_length: int) -> Optional[int]:
    """The sequence length a generate reaches from ``start_length`` tokens: + max_new_tokens, else max_length
    (None if neither is set)."""
    config = kwargs.get("generation_config") or getattr(transformer, "generation_config", None)
    new = kwargs.get("max_new_tokens", getattr(config, "max_new_tokens", None))
    if new is not None:
        return start_length + int(new)
    max_length = kwargs.get("max_length", getattr(config, "max_length", None))
    return None if max_length is None else max(int(max_length), start_length + 1)


def _encoder_decoder_lengths(transformer, args, kwargs) -> Optional[tuple]:
    """(decoder start ids + new tokens, encoder length) of an encoder-decoder generate; None if unknown.

    The decoder's self-attention cache gets the bucket of the first (an
    encoder-decoder's max_length counts the decoder's tokens); the
    cross-attention cache holds the encoder's keys, exactly its length (the
    encoder's attention mask has that length, so a padded cache could not be masked).
    """
    encoder_length = prompt_length(args, kwargs)
    start = kwargs.get("decoder_input_ids")
    total = _total_length(transformer, kwargs, int(start.shape[1]) if isinstance(start, torch.Tensor) else 1)
    return None if encoder_length is None or total is None else (total, encoder_length)


def serving_cache(caches: CacheStore, transformer: torch.nn.Module, max_cache_len: int, rows: int,
                  cross_attention_length: Optional[int] = None) -> Any:
    """The model's static cache of this length and batch, made once and reset for each generate.

    ``cross_attention_length``: an encoder-decoder's cache, HF's
    ``EncoderDecoderCache`` of a static self-attention cache of
    ``max_cache_len`` positions and a static cross-attention cache of the
    encoder's length (what transformers' own ``cache_implementation="static"``
    builds for T5, with the self-attention length bucketed).

    Reused, not made anew: transformers marks an allocated cache's tensors
    as static addresses, which Dynamo guards by identity, so a new cache per
    generate would retrace the model each time.  Reset, because transformers
    5 writes at the cache's own ``cumulative_length``, not at ``cache_position``.
    One generate at a time per model.
    """
    weight = next(transformer.parameters())
    kept = caches.setdefault(transformer, {})
    key = (max_cache_len, rows, weight.dtype, str(weight.device), cross_attention_length)
    cache = kept.get(key)
    if cache is None:
        cache = static_cache(transformer.config, max_cache_len, rows, weight.dtype, weight.device)
        if cross_attention_length is not None:
            from transformers import EncoderDecoderCache

            cross = static_cache(transformer.config, cross_attention_length, rows, weight.dtype, weight.device)
            cache = EncoderDecoderCache(cache, cross)
        _reorder_in_place(cache)
        kept[key] = cache
    else:
        cache.reset()
    return cache


def _cache_layers(cache):
    inner = [getattr(cache, name, None) for name in ("self_attention_cache", "cross_attention_cache")]
    for part in [c for c in inner if c is not None] or [cache]:
        yield from getattr(part, "layers", ())


def _reorder_in_place(cache) -> None:
    """Make beam search's ``reorder_cache`` on this serving cache write into the cache's own tensors.

    transformers reorders a static layer by replacing its tensors
    (``self.keys = self.keys.index_select(0, beam_idx)``): new objects,
    without the static-address mark, so the next compiled call fails
    Dynamo's identity guard on them and recompiles, and the reset cache of
    the next ``generate`` recompiles its prompt step again.  After
    transformers' own reorder, each tensor it replaced is copied back into
    the original (same shape and dtype) and put back, whatever the layer
    kind reorders.
    """
    original = cache.reorder_cache

    def reorder_cache(beam_idx):
        before = [(layer, {name: value for name, value in vars(layer).items() if isinstance(value, torch.Tensor)})
                  for layer in _cache_layers(cache)]
        original(beam_idx)
        for layer, tensors in before:
            for name, old in tensors.items():
                new = getattr(layer, name, None)
                if new is not old and isinstance(new, torch.Tensor) and new.shape == old.shape \
                        and new.dtype == old.dtype:
                    old.copy_(new)
                    setattr(layer, name, old)

    cache.reorder_cache = reorder_cache


def static_cache(config, max_cache_len: int, batch_size: int, dtype: Optional[torch.dtype] = None,
                 device=None) -> Any:
    """A transformers ``StaticCache`` with only the arguments this transformers version takes.

    Given ``dtype`` and ``device`` it is allocated at once (``early_initialization``)
    rather than on its first update, which would then happen inside the
    compiled prompt step: transformers 5 keeps a host ``cumulative_length``
    tensor until that first update, and an XLA program cannot take a host tensor.
    """
    from transformers import StaticCache

    params = inspect.signature(StaticCache.__init__).parameters
    offered = {"config": config, "max_cache_len": max_cache_len, "max_batch_size": batch_size}
    cache = StaticCache(**{k: v for k, v in offered.items() if k in params})
    if dtype is not None and device is not None and hasattr(cache, "early_initialization"):
        text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
        # T5's width per head is d_kv, not necessarily hidden / heads.
        head_dim = (getattr(text, "head_dim", None) or getattr(text, "d_kv", None)
                    or text.hidden_size // text.num_attention_heads)
        cache.early_initialization(batch_size, heads, head_dim, dtype, device)
    return cache
