"""PEFT's (and HF's) ``generate`` served by the compiled programs.

HF's ``generate`` calls the module it belongs to, never a ``torch.compile``
wrapper around it: ``torch.compile(peft_model, backend=...).generate(...)``
resolves to ``peft_model.generate`` and runs every forward step eagerly (with
``adapter_names=``, through PEFT's own mixed batch).  So a backend serving a
registered model (``ModelServing``, made by ``make_backend``) replaces
``generate`` on that model's instance with :func:`routed_generate`, which:

- turns ``adapter_names`` (one per prompt row, ``"__base__"`` for the base
  model) into ``meta.set_request_adapters``, repeated per beam (as PEFT does)
  or returned sequence, and leaves PEFT's own per-layer hooks out;
- points the transformer's ``forward`` (and an encoder-decoder's encoder's)
  at one ``torch.compile`` of it with that backend for the duration of the
  call, so the prompt (or encoder) step and every decode step run the
  rewritten programs;
- gives it a static cache of a bucketed length (static_cache.py);
- builds each step's attention mask inside the compiled forward, where the
  model and transformers allow it (generate_mask.py), not eagerly per step;
- checks the model's own LoRA tensors for changes once, before the first
  step (``meta.model_weights_synced_once``), not at every step.

A cache the caller builds (``past_key_values=``, or ``cache=`` from
transformers 5.25) is used as given if it is a compileable (static) cache and
refused otherwise, with an error that says to use the static cache.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import warnings
import weakref

import torch

from ..errors import UnsupportedMappingError
from . import generate_mask
from .generate_args import expansion, prompt_of
from .static_cache import generate_cache_keyword, use_bucketed_static_cache

log = logging.getLogger(__name__)

BASE_MODEL_NAME = "__base__"  # PEFT's name for "no adapter" in adapter_names


class GenerateRoute:
    """One backend's state for the ``generate`` of the models it serves: compiled forwards and caches."""

    def __init__(self, backend):
        self.backend = backend
        self.compiled_forwards: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # transformer -> forward
        self.caches: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # transformer -> {key: cache}

    def install(self, model: torch.nn.Module) -> None:
        """Install :func:`routed_generate` through this route as ``model.generate`` (an instance attribute)."""
        current = model.__dict__.get("generate")
        if getattr(current, "_xla_lora_route", None) is not None:
            current._xla_lora_route = self  # served again: the newest backend serves it
            return
        original = getattr(model, "generate", None)
        if original is None or not callable(original):
            return

        @functools.wraps(original)
        def generate(*args, **kwargs):
            return routed_generate(generate._xla_lora_route, model, original, *args, **kwargs)

        generate._xla_lora_route = self
        model.generate = generate

    def compiled_forward(self, transformer: torch.nn.Module):
        """One ``torch.compile`` of the transformer's own forward with this backend, kept for reuse."""
        compiled = self.compiled_forwards.get(transformer)
        if compiled is None:
            forward = transformer.__dict__.get("forward") or type(transformer).forward.__get__(transformer)
            if generate_mask.applies_to(transformer):
                forward = generate_mask.forward_setting_step_mask(forward)
            compiled = self.compiled_forwards[transformer] = torch.compile(forward, backend=self.backend)
        return compiled

    def use_static_cache(self, transformer: torch.nn.Module, args, kwargs) -> None:
        """The bucketed static cache(s) this generate gets, in ``kwargs`` (static_cache.py)."""
        use_bucketed_static_cache(transformer, self.backend.buckets, self.caches, args, kwargs)


def routed_generate(route: GenerateRoute, model: torch.nn.Module, original, *args, **kwargs):
    """``original(*args, **kwargs)`` with every forward step run by the route's backend (see module doc)."""
    if torch.compiler.is_compiling():
        return original(*args, **kwargs)
    meta = route.backend.meta
    adapter_names = kwargs.pop("adapter_names", None)
    prompt_rows = None
    if adapter_names is not None:
        rows = request_rows(adapter_names, expansion(kwargs))  # checks adapter_names is a list first
        prompt = prompt_of(args, kwargs)
        if isinstance(prompt, torch.Tensor) and prompt.dim() >= 1 and len(adapter_names) != prompt.shape[0]:
            raise UnsupportedMappingError(
                f"generate: adapter_names has {len(adapter_names)} names but the prompt has {prompt.shape[0]} rows; "
                f"give one adapter name per prompt row ({BASE_MODEL_NAME!r} for the base model)")
        meta.set_request_adapters(rows)
        if expansion(kwargs) > 1:
            prompt_rows = request_rows(adapter_names)
    transformer = model.get_base_model() if hasattr(model, "get_base_model") else model
    _drop_stale_peft_hooks(model)
    route.use_static_cache(transformer, args, kwargs)
    with contextlib.ExitStack() as stack:
        stack.enter_context(meta.model_weights_synced_once())  # not once per step: see its doc
        for module in _served_modules(transformer):
            compiled = route.compiled_forward(module)
            if module is not transformer and prompt_rows is not None:  # an encoder, run on the prompt rows
                compiled = _on_prompt_rows(meta, compiled, prompt_rows, rows)
            if generate_mask.applies_to(module):
                stack.enter_context(generate_mask.masks_in_program(module, compiled))
            else:
                stack.enter_context(_forward_through(module, compiled))
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


def _on_prompt_rows(meta, compiled, prompt_rows: list, rows: list):
    """``compiled`` (an encoder's forward) called with the mapping of the prompt rows, then ``rows`` again.

    HF's generate runs the encoder once on the prompt, before it repeats
    each row for its beams or returned sequences (it repeats the encoder's
    output), so the encoder's call has one row per prompt while every
    decoder step has ``rows``."""
    def forward(*args, **kwargs):
        meta.set_request_adapters(prompt_rows)
        try:
            return compiled(*args, **kwargs)
        finally:
            meta.set_request_adapters(rows)
    return forward


def request_rows(adapter_names, copies: int = 1) -> list:
    """PEFT's ``adapter_names`` as request rows: ``"__base__"`` is None, each row repeated ``copies`` times
    (the beams or returned sequences generate makes of it, next to each other as HF lays them out)."""
    if isinstance(adapter_names, (str, bytes)) or not isinstance(adapter_names, (list, tuple)):
        raise TypeError(f"adapter_names: expected a list with one adapter name per prompt row, got "
                        f"{adapter_names!r:.80}")
    rows = [None if name == BASE_MODEL_NAME else name for name in adapter_names]
    return [r for r in rows for _ in range(copies)]


@contextlib.contextmanager
def _forward_through(transformer: torch.nn.Module, compiled):
    """``transformer.forward`` (the model's or its encoder's) is ``compiled`` inside the block."""
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


def warm_generate(route: GenerateRoute, model: torch.nn.Module, batch: int, prompt_length: int,
                  max_new_tokens: int, **generate_kwargs) -> None:
    """Generates of ``max_new_tokens`` tokens from ``batch`` prompts of ``prompt_length`` ids, unpadded and
    left-padded, with ``generate_kwargs`` (the settings serving's generates will have).

    Full length, not a token or two: HF's loop keeps its tokens and mask in
    tensors that grow by a column per step, and on XLA each step's ops on
    them (slicing the step's ids, position ids, the stopping criteria) are
    one small program per sequence length.  The first generate of a shape
    runs other programs than every later one (Dynamo's compiles in between
    leave other tensors pending), so each prompt's generate runs twice: on
    transformers 5 the left-padded one's second run has per-step position
    ids of its own (16 programs for 16 tokens that a single run left cold).
    Stopping at an end token would leave later lengths cold, so the end
    tokens are ids past the vocabulary (the same ops, on values no step makes).
    Each result is read back to the host, as a caller's is.
    The cache has the length a generate of ``max_new_tokens`` gets (an
    encoder-decoder's: the decoder's and the encoder's).
    """
    transformer = model.get_base_model() if hasattr(model, "get_base_model") else model
    transformer = getattr(transformer, "_orig_mod", transformer)  # a torch.compile wrapper
    ids = torch.ones(batch, prompt_length, dtype=torch.long).to(next(transformer.parameters()).device)
    served = {"input_ids": ids, "max_new_tokens": max_new_tokens}
    route.use_static_cache(transformer, (), served)  # the cache(s) a generate of these shapes gets
    cache = served[generate_cache_keyword()]
    masks = [torch.ones_like(ids)]
    if prompt_length > 1:  # a left-padded prompt: transformers 5 traces another mask path for it
        masks.append(torch.ones_like(ids).index_fill_(1, torch.tensor([0], device=ids.device), 0))
    settings = {"do_sample": False, "pad_token_id": 0, **generate_kwargs}
    unreachable = _unreachable_end_tokens(transformer, settings)
    if unreachable is not None:
        settings["eos_token_id"] = unreachable
    for mask in masks + masks:
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                                 **{generate_cache_keyword(): cache}, **settings)
        # Read back as the caller will: the program that assembles the returned ids.
        getattr(out, "sequences", out).cpu()
        cache.reset()


def _unreachable_end_tokens(transformer: torch.nn.Module, settings: dict):
    """As many end-token ids as the generate would stop at, each past the vocabulary (None: it has none)."""
    config = getattr(transformer, "generation_config", None)
    given = settings.get("eos_token_id", getattr(config, "eos_token_id", None))
    if given is None:
        return None
    vocab = transformer.get_output_embeddings().weight.shape[0] if transformer.get_output_embeddings() is not None \
        else transformer.config.vocab_size
    count = len(given) if isinstance(given, (list, tuple)) else 1
    return [vocab + i for i in range(count)] if isinstance(given, (list, tuple)) else vocab
