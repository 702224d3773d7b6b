"""PEFT's (and HF's) ``generate`` served by the compiled programs.

HF's ``generate`` calls the module it belongs to, never a ``torch.compile``
wrapper around it: ``torch.compile(peft_model, backend=...).generate(...)``
resolves to ``peft_model.generate`` and runs every forward step eagerly (with
``adapter_names=``, through PEFT's own mixed batch).  So ``register_adapters``
replaces ``generate`` on the registered model's instance with
:func:`routed_generate`, which, once a backend is made for the metadata
(``make_backend(meta)``):

- turns ``adapter_names`` (one per prompt row, ``"__base__"`` for the base
  model) into ``meta.set_request_adapters``, repeated per beam (as PEFT does) or returned sequence,
  and leaves PEFT's own per-layer hooks out;
- points the transformer's ``forward`` (and an encoder-decoder's encoder's)
  at one ``torch.compile`` of it with that backend for the duration of the
  call, so the prompt (or encoder) step and every decode step run the
  rewritten programs;
- gives decoder-only models a ``StaticCache`` whose length is the backend's
  token bucket of prompt + new tokens (``Buckets.pad_length``: past the
  largest bucket, the next power of two), in place of the default dynamic cache
  and of ``cache_implementation="static"`` (whose length is the exact total):
  a dynamic cache grows by one position per token, and padding it cannot be
  exact (HF's causal mask compares key positions with ``cache_position``
  values, which padding the cache would shift), so it would cost one program
  per generated token.  The static cache gives the same tokens (its unused
  positions are masked) with one decode program per batch size.
  Encoder-decoder models (T5) get HF's ``EncoderDecoderCache`` of a static
  self-attention cache of the bucket of decoder start + new tokens and a
  static cross-attention cache of the encoder's length: the programs of one
  prompt length and batch are compiled once, not once per generated length.

A ``past_key_values`` the caller builds is used as given if it is a
compileable (static) cache and refused otherwise, with an error that says to
use the static cache.  Without a backend for the metadata, ``generate`` is
PEFT's own.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import warnings
import weakref
from typing import Any, Optional

import torch

from .errors import UnsupportedMappingError

log = logging.getLogger(__name__)

BASE_MODEL_NAME = "__base__"  # PEFT's name for "no adapter" in adapter_names

# meta -> the backend made for it last (make_backend); model -> (backend, compiled forward).
_backends: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_compiled_forwards: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_serving_caches: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> {(length, batch, ...): cache}


def attach_backend(meta, backend) -> None:
    """Record ``backend`` as the one the registered model's ``generate`` runs through."""
    _backends[meta] = backend


def backend_for(meta):
    """The backend made for ``meta`` last, or None."""
    return _backends.get(meta)


def route_generate(meta, model: torch.nn.Module) -> None:
    """Install :func:`routed_generate` as ``model.generate`` (an instance attribute; once per model)."""
    current = model.__dict__.get("generate")
    if getattr(current, "_xla_lora_meta", None) is not None:
        current._xla_lora_meta = meta  # registered again: the newest metadata serves it
        return
    original = getattr(model, "generate", None)
    if original is None or not callable(original):
        return

    @functools.wraps(original)
    def generate(*args, **kwargs):
        return routed_generate(generate._xla_lora_meta, model, original, *args, **kwargs)

    generate._xla_lora_meta = meta
    model.generate = generate


def routed_generate(meta, model: torch.nn.Module, original, *args, **kwargs):
    """``original(*args, **kwargs)`` with every forward step run by ``meta``'s backend (see module doc)."""
    backend = backend_for(meta)
    if backend is None or torch.compiler.is_compiling():
        return original(*args, **kwargs)
    adapter_names = kwargs.pop("adapter_names", None)
    if adapter_names is not None:
        rows = request_rows(adapter_names, _expansion(kwargs))  # checks adapter_names is a list first
        prompt = _prompt(args, kwargs)
        if isinstance(prompt, torch.Tensor) and prompt.dim() >= 1 and len(adapter_names) != prompt.shape[0]:
            raise UnsupportedMappingError(
                f"generate: adapter_names has {len(adapter_names)} names but the prompt has {prompt.shape[0]} rows; "
                f"give one adapter name per prompt row ({BASE_MODEL_NAME!r} for the base model)")
        meta.set_request_adapters(rows)
    transformer = model.get_base_model() if hasattr(model, "get_base_model") else model
    _drop_stale_peft_hooks(model)
    _use_bucketed_static_cache(transformer, backend, args, kwargs)
    with contextlib.ExitStack() as stack:
        for module in _served_modules(transformer):
            stack.enter_context(_forward_through(module, backend))
        return original(*args, **kwargs)


# PEFT's forward pre-hook that passes one call's adapter_names to each LoRA layer (peft.tuners.lora.model).
_PEFT_ADAPTER_NAMES_HOOK = "_adapter_names_pre_forward_hook"


def _drop_stale_peft_hooks(model: torch.nn.Module) -> None:
    """Remove the ``adapter_names`` pre-hooks an earlier PEFT call left on the model, with a warning.

    PEFT adds one per LoRA layer for a call with ``adapter_names=`` and
    removes them when the call returns, but not when it raises: a refused
    mixed batch (``Cannot pass `adapter_names` when DoRA is enabled``, peft
    0.17 and 0.21) leaves them, and every later call of the model then
    raises PEFT's refusal again.  This generate routes ``adapter_names``
    itself, so no PEFT hook can be live here.
    """
    dropped = 0
    for module in model.modules():
        hooks = module._forward_pre_hooks
        for key in [k for k, hook in hooks.items()
                    if getattr(getattr(hook, "func", hook), "__name__", "") == _PEFT_ADAPTER_NAMES_HOOK]:
            del hooks[key]
            module._forward_pre_hooks_with_kwargs.pop(key, None)  # as the hook's own handle.remove() does
            dropped += 1
    if dropped:
        warnings.warn(f"generate: removed {dropped} adapter_names hooks that an earlier PEFT call left on the "
                      "model when it raised (PEFT does not remove them then; e.g. its refusal of adapter_names "
                      "with DoRA); without this, every call of the model would raise that refusal again",
                      stacklevel=3)


def _served_modules(transformer: torch.nn.Module) -> list:
    """The modules whose forward generate calls: the model, and an encoder-decoder's encoder, which HF's
    generate calls on its own (``get_encoder()(...)``) before the first decoder step."""
    modules = [transformer]
    if getattr(getattr(transformer, "config", None), "is_encoder_decoder", False) and hasattr(transformer,
                                                                                              "get_encoder"):
        encoder = transformer.get_encoder()
        if isinstance(encoder, torch.nn.Module) and encoder is not transformer:
            modules.append(encoder)
    return modules


def request_rows(adapter_names, copies: int = 1) -> list:
    """PEFT's ``adapter_names`` as request rows: ``"__base__"`` is None, each row repeated ``copies`` times
    (the beams or returned sequences generate makes of it, next to each other as HF lays them out)."""
    if isinstance(adapter_names, (str, bytes)) or not isinstance(adapter_names, (list, tuple)):
        raise TypeError(f"adapter_names: expected a list with one adapter name per prompt row, got "
                        f"{adapter_names!r:.80}")
    rows = [None if name == BASE_MODEL_NAME else name for name in adapter_names]
    return [r for r in rows for _ in range(copies)]


@contextlib.contextmanager
def _forward_through(transformer: torch.nn.Module, backend):
    """``transformer.forward`` (the model's or its encoder's) is the backend's compiled forward inside the block."""
    compiled = _compiled_forward(transformer, backend)
    had_own = "forward" in transformer.__dict__
    saved = transformer.__dict__.get("forward")
    transformer.forward = compiled
    try:
        yield
    finally:
        if had_own:
            transformer.forward = saved
        else:
            del transformer.forward


def _compiled_forward(transformer: torch.nn.Module, backend):
    """One ``torch.compile`` of the transformer's own forward per (model, backend), kept for reuse."""
    cached = _compiled_forwards.get(transformer)
    if cached is None or cached[0] is not backend:
        forward = transformer.__dict__.get("forward") or type(transformer).forward.__get__(transformer)
        cached = (backend, torch.compile(forward, backend=backend))
        _compiled_forwards[transformer] = cached
    return cached[1]


def _use_bucketed_static_cache(transformer: torch.nn.Module, backend, args, kwargs) -> None:
    """Put a bucketed ``StaticCache`` into ``kwargs`` (an encoder-decoder's two; see the module doc)."""
    given = kwargs.get("past_key_values")
    if given is not None:
        if not getattr(given, "is_compileable", False):
            raise ValueError(
                f"generate: past_key_values is a {type(given).__name__}, which grows by one position per token, "
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
        kwargs["past_key_values"] = serving_cache(transformer, backend.buckets.pad_length(decoder_total),
                                                  _batch_size(args, kwargs), cross_attention_length=encoder_length)
        return
    prompt_length = _prompt_length(args, kwargs)
    total = None if prompt_length is None else _total_length(transformer, kwargs, prompt_length)
    if total is None:
        return
    kwargs.pop("cache_implementation", None)
    kwargs["past_key_values"] = serving_cache(transformer, backend.buckets.pad_length(total), _batch_size(args, kwargs))


def _total_length(transformer, kwargs, start_length: int) -> Optional[int]:
    """The sequence length a generate reaches from ``start_length`` tokens: + max_new_tokens, else max_length
    (None if neither is set)."""
    config = kwargs.get("generation_config") or getattr(transformer, "generation_config", None)
    new = kwargs.get("max_new_tokens", getattr(config, "max_new_tokens", None))
    if new is not None:
        return start_length + int(new)
    max_length = kwargs.get("max_length", getattr(config, "max_length", None))
    return None if max_length is None else max(int(max_length), start_length + 1)


def _prompt_length(args, kwargs) -> Optional[int]:
    """The prompt's length (None if it is not a tensor of ids or embeddings)."""
    prompt = _prompt(args, kwargs)
    return int(prompt.shape[1]) if isinstance(prompt, torch.Tensor) and prompt.dim() >= 2 else None


def _encoder_decoder_lengths(transformer, args, kwargs) -> Optional[tuple]:
    """(decoder start ids + new tokens, encoder length) of an encoder-decoder generate; None if unknown.

    The decoder's self-attention cache gets the bucket of the first (an
    encoder-decoder's max_length counts the decoder's tokens); the
    cross-attention cache holds the encoder's keys, exactly its length (the
    encoder's attention mask has that length, so a padded cache could not be masked).
    """
    encoder_length = _prompt_length(args, kwargs)
    start = kwargs.get("decoder_input_ids")
    total = _total_length(transformer, kwargs, int(start.shape[1]) if isinstance(start, torch.Tensor) else 1)
    return None if encoder_length is None or total is None else (total, encoder_length)


def _prompt(args, kwargs):
    """The prompt generate was given: its ids, or its embeddings."""
    prompt = kwargs.get("input_ids", args[0] if args else None)
    return kwargs.get("inputs_embeds") if prompt is None else prompt


def _batch_size(args, kwargs) -> int:
    prompt = _prompt(args, kwargs)
    return int(prompt.shape[0]) * _expansion(kwargs)


def _expansion(kwargs) -> int:
    """How many sequences generate makes of each prompt row (beams, or returned sequences)."""
    return max(int(kwargs.get("num_beams") or 1), int(kwargs.get("num_return_sequences") or 1))


def serving_cache(transformer: torch.nn.Module, max_cache_len: int, batch_size: int,
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
    caches = _serving_caches.setdefault(transformer, {})
    key = (max_cache_len, batch_size, weight.dtype, str(weight.device), cross_attention_length)
    cache = caches.get(key)
    if cache is None:
        cache = static_cache(transformer.config, max_cache_len, batch_size, weight.dtype, weight.device)
        if cross_attention_length is not None:
            from transformers import EncoderDecoderCache

            cross = static_cache(transformer.config, cross_attention_length, batch_size, weight.dtype, weight.device)
            cache = EncoderDecoderCache(cache, cross)
        _reorder_in_place(cache)
        caches[key] = cache
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


def warm_generate(backend, model: torch.nn.Module, batch: int, prompt_length: int, max_new_tokens: int) -> None:
    """Two-token generates of ``batch`` prompts of ``prompt_length`` ids, unpadded and left-padded.

    The cache has the length a generate of ``max_new_tokens`` gets (an
    encoder-decoder's: the decoder's and the encoder's), so the decode
    program is the one serving will run.
    """
    transformer = model.get_base_model() if hasattr(model, "get_base_model") else model
    transformer = getattr(transformer, "_orig_mod", transformer)  # a torch.compile wrapper
    ids = torch.ones(batch, prompt_length, dtype=torch.long).to(next(transformer.parameters()).device)
    served = {"input_ids": ids, "max_new_tokens": max_new_tokens}
    _use_bucketed_static_cache(transformer, backend, (), served)  # the cache(s) a generate of these shapes gets
    cache = served["past_key_values"]
    masks = [torch.ones_like(ids)]
    if prompt_length > 1:  # a left-padded prompt: transformers 5 traces another mask path for it
        masks.append(torch.ones_like(ids).index_fill_(1, torch.tensor([0], device=ids.device), 0))
    for mask in masks:
        with torch.no_grad():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2, min_new_tokens=2,
                           do_sample=False, pad_token_id=0, past_key_values=cache)
        cache.reset()
