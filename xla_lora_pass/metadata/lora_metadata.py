"""``LoRAMetadata``: the one object that says which adapter each token uses.

It owns, for every registered LoRA site, the per-slot stacked weights and
the int32 token indices of the current step (-1 = base model only).
Compiled graphs receive both as graph inputs, so a new mapping or new
adapter weights never recompile anything.  It holds state only: it never
touches the user's model (``make_backend`` serves the model, ``set_server``).

A facade (the way ``torch.fx.GraphModule`` delegates to ``Graph`` and
``CodeGen``) over the modules beside it: host_stacks.py (slots, host stacks,
loading), param_index.py (a graph's parameters), token_mapping.py (the
mapping and every per-step value built from it), device_stacks.py (device
copies, SPMD placement), stats.py (counters) and pool.py (adapters into
slots); mapping_facade.py and device_facade.py hold the mapping and the
device methods it inherits.  This class owns the lock (locking.py) and the order of operations;
the parts own their state.  A refused call changes nothing, and every call
is all-or-nothing for other threads (docs/reliability.md).
"""
from __future__ import annotations

import logging
import numbers
import threading
import warnings
import weakref
from typing import Callable, Iterable, List, Mapping, Optional, Tuple

import torch

from ..adapters.formats import DEFAULT_ADAPTER, adapter_names, iter_lora_sites, refuse_merged
from ..adapters.records import SiteSpec
from ..adapters.saved_modules import SavedModuleSpec, iter_saved_modules
from ..adapters.unserved import Exclusions, refuse_unserved
from .device_stacks import DeviceStacks, Site
from .host_stacks import AdapterStacks
from .locking import forward as _forward
from .device_facade import DeviceFacade
from .mapping_facade import MappingFacade
from .locking import locked as _locked
from .model_weights import ModelWeights
from .param_index import ParamIndex
from .pool import AdapterPool
from .stats import Stats
from .token_mapping import NO_LORA, TokenAdapter, TokenMapping

log = logging.getLogger(__name__)

# The default bound of the adapters kept read on the host (their prepared swaps take about as much again): a
# catalogue of small adapters stays whole (bench/adapter_pool.py's 256: 134 MB), and of r=16 adapters on every
# linear of a 1.1B Llama (22 layers, 50 MB each in float32) about 40 stay.
HOST_CACHE_BYTES = 2 << 30


class LoRAMetadata(MappingFacade, DeviceFacade):
    """Shared multi-LoRA state: slots, stacked weights and token indices."""

    def __init__(self, max_num_tokens: int = 8192, *, max_slots: Optional[int] = None,
                 max_rank: Optional[int] = None, host_cache: Optional[int] = None,
                 host_cache_bytes: Optional[int] = HOST_CACHE_BYTES):
        if max_num_tokens < 1:
            raise ValueError(f"max_num_tokens must be >= 1, got {max_num_tokens}")
        for what, bound, means in (("host_cache", host_cache, "how many adapters stay read on the host"),
                                   ("host_cache_bytes", host_cache_bytes, "their bytes at most")):
            if bound is not None and (isinstance(bound, bool) or not isinstance(bound, numbers.Integral) or bound < 0):
                raise ValueError(f"{what} must be None (no bound) or an int >= 0 ({means}), got {bound!r:.80}")
        host_cache, host_cache_bytes = (None if b is None else int(b) for b in (host_cache, host_cache_bytes))
        self.max_num_tokens = int(max_num_tokens)
        self.max_slots = max_slots
        self.max_rank = max_rank
        # Re-entrant: a method may call another (shard builds an AdapterSharding that reads ``sites``).
        self._lock = threading.RLock()
        self._adapters = AdapterStacks(max_rank)
        self._params = ParamIndex()
        self._tokens = TokenMapping(self.max_num_tokens)
        self._stats = Stats()
        self._devices = DeviceStacks(self._adapters, self._stats.count, keep_staged=(host_cache, host_cache_bytes))
        self._pool = AdapterPool(self._adapters, self._devices, self._stats, mapped=self._mapped_names,
                                 host_cache=host_cache, host_cache_bytes=host_cache_bytes)
        self._model_weights = ModelWeights(self._adapters, self._devices, self._pool.source, self._stats.count)
        self._excluded = Exclusions()  # adapters of other PEFT types left out by register_adapters(exclude=)
        self._model = None  # weak reference to the model registered last
        self._server = None  # serves that model (serving.ModelServing): set by make_backend

    # ------------------------------------------------------------ adapters
    @property
    @_locked
    def slots(self) -> List[Optional[str]]:
        """Slot names by slot number (None for a free slot)."""
        return list(self._adapters.slots)

    @property
    @_locked
    def num_slots(self) -> int:
        return len(self._adapters.slots)

    @property
    @_locked
    def sites(self) -> Mapping[str, SiteSpec]:
        return self._adapters.sites

    @property
    @_locked
    def saved_modules(self) -> Mapping[str, SavedModuleSpec]:
        """PEFT ``modules_to_save`` served per token or row, by module path."""
        return self._adapters.saved

    @_locked
    def register_adapters(self, model: torch.nn.Module, *, adapter_name: str = DEFAULT_ADAPTER,
                          exclude: Iterable[str] = ()) -> List[str]:
        """Stack every loaded adapter of every LoRA layer of ``model``; return slot names.

        LoRA layers are read by the readers of ``formats`` (PEFT, torchtune,
        loralib, hand-written modules); ``adapter_name`` names the adapter of
        the formats that hold one per layer.  A layer that cannot be served
        exactly is refused here (``UnsupportedAdapterError``, naming it).
        Registering again replaces what was registered before.

        A PEFT adapter of another type than LoRA (LoHa, LoKr, AdaLoRA, IA3,
        VeRA, OFT, ...: its ``peft_type``, or a layer of another tuner holding
        it) is refused too, unless ``exclude`` names it: ``exclude=["hada"]``
        serves the other adapters and gives ``hada`` no slot.  An excluded
        adapter must be inactive and unmerged (refused here otherwise); a graph
        traced after it was made active refuses every mapping
        (adapters/unserved.py).  ``exclude`` takes only such adapters.
        """
        sites = list(iter_lora_sites(model, adapter_name))
        saved = list(iter_saved_modules(model))  # refuses, by name, a kind it cannot serve exactly
        excluded = refuse_unserved(model, exclude, adapter_names(model, sites), saved)
        refuse_merged(sites, "register_adapters")
        saved = excluded.without_excluded(saved)
        if not sites:
            warnings.warn(f"{type(model).__name__} has no LoRA layers: the backend will compile it unchanged",
                          stacklevel=3)  # the caller of the lock's wrapper
        names = [n for n in adapter_names(model, sites) if n not in excluded.names] if sites or saved else []
        num_slots = self.max_slots if self.max_slots is not None else len(names)
        if len(names) > num_slots:
            raise ValueError(f"{len(names)} adapters {names} do not fit max_slots={num_slots}")
        self._adapters.register(sites, saved, list(names) + [None] * (num_slots - len(names)))
        self._params.refresh(sites, saved)
        self._devices.sites_changed()
        self._pool.sites_changed()
        self._model_weights.watch()
        self._tokens.forget()
        self._excluded = excluded
        self._model = weakref.ref(model)
        if self._server is not None:
            self._server(model)
        log.info("registered %d LoRA sites and %d saved modules, slots %s", len(sites), len(saved),
                 self._adapters.slots)
        return list(names)

    @property
    def registered_model(self) -> Optional[torch.nn.Module]:
        """The model ``register_adapters`` read last (None if none, or if it is gone)."""
        return self._model() if self._model is not None else None

    @_locked
    def set_server(self, server: Optional[Callable[[torch.nn.Module], None]]):
        """``server(model)`` serves the registered model, now and after every ``register_adapters``; returns the
        previous server.  ``make_backend`` sets it (``serving.ModelServing``): this object never touches a model."""
        previous, self._server = self._server, server
        model = self.registered_model
        if server is not None and model is not None:
            server(model)
        return previous

    @_locked
    def load_adapter(self, name: str, state: Mapping[str, torch.Tensor], *, scaling: Optional[float] = None,
                     config=None) -> int:
        """Load one adapter's weights into its slot, a free one, or the least recently used one the current
        mapping does not use (metadata/pool.py); never recompiles.  Returns the slot.

        ``state``: a state dict in the registered layers' own keys, or a saved
        PEFT adapter directory; the scaling comes from ``scaling``, from
        ``config`` (a ``LoraConfig``), from the directory's config, or else from
        the layer's own formula (``AdapterStacks.validate`` lists them all).
        Weights of any floating dtype, on any device that holds data, are copied
        into the host stacks.  Refused before any slot is touched: a shape that
        does not fit the site, a non-floating dtype, a meta or sparse tensor, a
        NaN or inf (after the cast and the scaling).  The adapter stays known by
        name (``add_adapter``), so an eviction can bring it back.
        """
        self._excluded.refuse_name(name, "load_adapter")
        loaded = self._adapters.validate(name, state, scaling=scaling, config=config)
        self._pool.remember(name, state, loaded, scaling=scaling, config=config)
        slot = self._pool.load(loaded)
        self._model_weights.unwatch(name)  # the slot holds the state's weights now, not the model's
        return slot

    @_locked
    def add_adapter(self, name: str, state, *, scaling: Optional[float] = None, config=None) -> None:
        self._excluded.refuse_name(name, "add_adapter")
        self._pool.add(name, state, scaling=scaling, config=config)
        self._model_weights.unwatch(name)

    add_adapter.__doc__ = AdapterPool.add.__doc__

    @_locked
    def unload_adapter(self, name: str) -> int:
        """Free ``name``'s slot (zero rows, written in place); it stays known and comes back on demand."""
        return self._pool.unload(name)

    pin = _forward("_pool", AdapterPool.pin)
    unpin = _forward("_pool", AdapterPool.unpin)
    prefetch = _forward("_pool", AdapterPool.prefetch)

    def _mapped_names(self) -> List[str]:
        """The adapters the current mapping uses (``AdapterPool.held`` keeps them in their slots)."""
        slots = self._adapters.slots
        return [slots[i] for i in (self._tokens.mapped_slots() or ()) if i >= 0 and slots[i] is not None]

    site_rank = _forward("_adapters", AdapterStacks.site_rank)

    # -------------------------------------------------------- graph lookups
    @_locked
    def refresh_param_index(self) -> None:
        """Re-read parameter identities from the live modules.

        ``model.to(xla_device)`` replaces Parameter objects, so identities
        taken at registration go stale; the rewrite refreshes once per graph.
        Refuses the graph when a registered layer has merged an adapter since
        (Dynamo traces again after a merge: the layers' forwards branch on it).
        """
        refuse_merged(self._adapters.sites.values(), "a graph traced after register_adapters")
        self._params.refresh(self._adapters.sites.values(), self._adapters.saved.values())
        self._excluded.refresh()
        self._model_weights.refresh()

    @_locked
    def sync_model_weights(self, mapped_only: bool = False) -> int:
        """Re-stack what changed in the model's own LoRA tensors since they were stacked; returns the number of
        (site, adapter) pairs read again.  ``mapped_only``: only the adapters the current mapping names (what
        a compiled call runs: with 1 of 16 adapters mapped it compares 1/16 of the tensors)."""
        return self._model_weights.sync(self._mapped_names() if mapped_only else None)

    def model_weights_synced_once(self):
        """A context: within, the model's LoRA tensors are checked once, at entry, not at every compiled call
        (``generate``'s steps: the check costs 0.64 ms a call for 896 watched tensors on XLA:CPU)."""
        return self._model_weights.synced_once(self._lock)

    follow_scalings = _forward("_model_weights", ModelWeights.follow_scalings)

    @_locked
    def excluded_weight(self, tensor) -> Optional[Tuple[str, str, str]]:
        """``(layer, adapter, reason)`` if ``tensor`` belongs to an adapter excluded at register_adapters."""
        return self._excluded.lookup(tensor)

    weight_ref = _forward("_params", ParamIndex.weight_ref)
    lookup = _forward("_params", ParamIndex.lookup)
    lookup_base = _forward("_params", ParamIndex.lookup_base)

    @_locked
    def saved_tensor(self, module: str, adapter: Optional[str], name: str, device) -> torch.Tensor:
        """One tensor of a saved module's variant, the live one (the model's own, on ``device``)."""
        tensor = self._adapters.saved[module].tensors(adapter)[name]
        return tensor if tensor.device == torch.device(device) else tensor.to(device)

    # ------------------------------------------------------------------ stats
    @property
    @_locked
    def stats(self) -> Mapping:
        """Counters: compiles, rewrites, bucket_hits, fallbacks, padded_token_fraction (a snapshot)."""
        return self._stats.snapshot()

    count = _forward("_stats", Stats.count)

    # ------------------------------------------------ for tests and the dump
    @_locked
    def host_stacks(self, site_name: str) -> Tuple[torch.Tensor, torch.Tensor]:
        """The site's host (A, scaled B) stacks themselves, not copies: read, do not write."""
        return self._adapters.host_a(site_name), self._adapters.host_b(site_name)

    @_locked
    def device_copies(self) -> Mapping[Tuple[Site, str, str], torch.Tensor]:
        """The device stacks made so far, by (site, role, device)."""
        return self._devices.copies()

    @_locked
    def step_tensors(self, device) -> List[torch.Tensor]:
        """The buffers on ``device`` built from the current mapping so far (token indices, row slots, layouts)."""
        return [t for t in self._tokens.cache.tensors() if t.device == torch.device(device)]


__all__ = ["LoRAMetadata", "NO_LORA", "TokenAdapter"]
