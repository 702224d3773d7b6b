"""The adapters on the host: slots, sites, and each site's stacked weights per slot.

Per LoRA site: A ``[N, R, in]`` and B ``[N, out, R]`` with each adapter's
scaling folded into B, ranks zero-padded to the site's max rank (exact);
LoRA bias rows ``[N, out]`` (scaled) where an adapter has one, DoRA rows
``[N, 2, out]`` (adapters/dora.py) where one is DoRA.  ``load_adapter`` validates a
whole adapter before it touches any slot, so a refused load changes nothing.

A slot's write is kept pending until something reads the host stacks: a
swap sends rows prepared from the adapter itself (staged_swaps.py), so in a
serving stream the host copy is read only when a device copy is made anew
or a slot's rows are kept (``snapshot``), and copying every site's rows at
every swap (about a fifth of a swap's host time) would be wasted.

Not locked itself: ``LoRAMetadata`` holds its lock around every call.
"""
from __future__ import annotations

import os
import types
from typing import Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple

import torch

from ..adapters.records import AdapterWeights, SiteSpec
from ..adapters.dora import dora_rows, stack_dora
from ..adapters.formats.peft_dir import read_adapter_dir
from ..adapters.formats.state import split_state
from ..adapters.saved_modules import SavedModuleSpec
from .slot_rows import RANK_DIM
from .slot_weights import (check_shapes, check_tensors, host_slot_weights, scaling_for, stack_bias,
                           write_slot_rows)


class LoadedAdapter(NamedTuple):
    """One adapter's validated host weights, ready to be written into a slot."""

    name: str
    weights: Dict[str, Tuple[torch.Tensor, torch.Tensor]]  # site -> (A, scaling * B) in the stack dtype
    dora: Dict[str, torch.Tensor]  # site -> [2, out] DoRA rows
    bias: Dict[str, torch.Tensor] = {}  # site -> [out] scaled LoRA bias (a slot's snapshot; loads bring none)

    @property
    def nbytes(self) -> int:
        """The host memory its tensors hold."""
        tensors = [t for pair in self.weights.values() for t in pair]
        return sum(t.nbytes for t in tensors + list(self.dora.values()) + list(self.bias.values()))


class AdapterStacks:
    """Slots, registered sites and saved modules, and the host stacks built from them."""

    def __init__(self, max_rank: Optional[int] = None):
        self.max_rank = max_rank
        self.slots: List[Optional[str]] = []
        self.sites: Mapping[str, SiteSpec] = types.MappingProxyType({})
        self.saved: Mapping[str, SavedModuleSpec] = types.MappingProxyType({})  # PEFT modules_to_save
        self._a: Dict[str, torch.Tensor] = {}
        self._b: Dict[str, torch.Tensor] = {}
        self._bias: Dict[str, torch.Tensor] = {}
        self._dora: Dict[str, torch.Tensor] = {}
        self._pending: Dict[int, LoadedAdapter] = {}  # slot -> the adapter written there, not yet copied in

    def register(self, sites: Sequence[SiteSpec], saved: Sequence[SavedModuleSpec],
                 slots: List[Optional[str]]) -> None:
        """Stack every site's adapters into ``slots``; replaces what was registered (nothing on error)."""
        stacks = {s.name: self._stack_site(s, slots) for s in sites}
        dora = {s.name: stack_dora(s, slots) for s in sites if s.has_dora}
        bias = {s.name: stack_bias(s, slots) for s in sites if any(w.bias is not None for w in s.adapters.values())}
        self.slots = list(slots)
        self.sites = types.MappingProxyType({s.name: s for s in sites})
        self.saved = types.MappingProxyType({m.name: m for m in saved})
        self._a = {name: a for name, (a, _) in stacks.items()}
        self._b = {name: b for name, (_, b) in stacks.items()}
        self._bias, self._dora = bias, dora
        self._pending = {}  # writes into the stacks just replaced

    def _stack_site(self, site: SiteSpec, slots: List[Optional[str]]) -> Tuple[torch.Tensor, torch.Tensor]:
        """Host stacks of one site; slots whose adapter is absent here stay zero."""
        dtype = next(iter(site.adapters.values())).lora_a.dtype
        rank = max([w.rank for w in site.adapters.values()] + [self.max_rank or 1])
        stack_a = torch.zeros(len(slots), rank, site.in_features, dtype=dtype)
        stack_b = torch.zeros(len(slots), site.out_features, rank, dtype=dtype)
        for slot, name in enumerate(slots):
            if name in site.adapters:
                where = f"register_adapters: {site.name} adapter {name!r}"
                write_slot_rows(stack_a, stack_b, slot, *host_slot_weights(where, site.adapters[name], dtype))
        return stack_a, stack_b

    # ---------------------------------------------------------- host stacks
    def site_rank(self, site: str) -> int:
        """The site's stacked rank: its largest adapter rank (or ``max_rank``)."""
        return self._a[site].shape[1]

    def host_a(self, site: str) -> torch.Tensor:
        return self._written()._a[site]

    def host_b(self, site: str) -> torch.Tensor:
        return self._written()._b[site]

    def host_bias(self, site: str) -> torch.Tensor:
        return self._written()._bias[site]

    def host_dora(self, site: str) -> torch.Tensor:
        return self._written()._dora[site]

    def loaded_row(self, loaded: LoadedAdapter, site: str, role: str) -> torch.Tensor:
        """The row a slot holds for ``loaded`` in one stack (role as ``host_row``): its weights zero-padded
        to the site's rank, its bias or DoRA rows, zeros where it has none.  At the site's full rank it is
        the adapter's own tensor (not to be written to).  Reads the stacks' shapes only, not what is
        pending: the prefetch thread prepares swaps from these rows while the serving thread owns the
        stacks, and a pending write is copied in through this same function (``_written``)."""
        stack = self._by_role()[role][site]
        shape, dtype = stack.shape[1:], stack.dtype
        if role in RANK_DIM:
            weights = loaded.weights.get(site)  # (A [r, in], scaling * B [out, r])
            part = None if weights is None else weights[0 if role == "A" else 1]
            if part is not None and part.shape == shape and part.dtype == dtype:
                return part
            row = torch.zeros(shape, dtype=dtype)
            if part is not None:
                row.narrow(RANK_DIM[role], 0, part.shape[RANK_DIM[role]]).copy_(part)
            return row
        row = torch.zeros(shape, dtype=dtype)
        value = (loaded.bias if role == "bias" else loaded.dora).get(site)
        if value is not None:  # an adapter loaded from a state brings no bias; a plain LoRA slot no DoRA rows
            row[...] = value
        return row

    # ------------------------------------------------------------- loading
    def validate(self, name: str, state, *, scaling: Optional[float] = None, config=None,
                 where: Optional[str] = None) -> LoadedAdapter:
        """Read and check one adapter's weights for ``LoRAMetadata.load_adapter``; nothing is written.

        ``state`` is a state dict in the registered layers' own keys (PEFT
        ``<site>.lora_A.weight``, an adapter name may stand before
        ``.weight``; torchtune ``<site>.lora_a.weight``; loralib
        ``<site>.lora_A``; ``adapters/formats/``).  The scaling comes from ``scaling``,
        from a PEFT ``LoraConfig``, or else from the layer's own formula
        (torchtune's and loralib's alpha over the loaded rank; a hand-written
        layer's scaling when the rank is its own).

        ``state`` may also be a PEFT adapter directory (``save_pretrained``:
        ``adapter_config.json`` and ``adapter_model.safetensors``, or a
        ``.bin`` read with ``torch.load(weights_only=True)``); the scaling
        then comes from its config (alpha, ``alpha_pattern``, rsLoRA) and a
        DoRA adapter's magnitudes from its weights (``adapters/formats/peft_dir.py``).

        Weights may be of any floating dtype, cast to the site's stack dtype
        (the model's LoRA dtype), and on any device that holds data (CPU, XLA,
        ...): they are copied to the host, one device-to-host transfer each.
        Errors start with ``where``, by default ``load_adapter('<name>')`` (the
        pool names the call that needed the adapter: a mapping, a pin).
        """
        if not isinstance(name, str) or not name:
            raise TypeError(f"load_adapter: the adapter name must be a non-empty str, got {name!r:.80}")
        caller = where or f"load_adapter({name!r})"
        if isinstance(state, (str, os.PathLike)):
            saved_state, saved_config = read_adapter_dir(caller, state)
            state, config = saved_state, config if config is not None else saved_config
        if not isinstance(state, Mapping):
            raise TypeError(f"{caller}: state must be a mapping of name -> tensor or a saved PEFT "
                            f"adapter directory, got {type(state).__name__}")
        if not self.sites:
            raise RuntimeError(f"{caller}: no LoRA sites are registered; call "
                               "register_adapters(model) with a model that has LoRA layers first")
        saved = sorted(m.name for m in self.saved.values() if name in m.adapters)
        if saved:
            raise ValueError(f"{caller}: this adapter has PEFT modules_to_save copies ({saved}) that "
                             "load_adapter cannot replace, so its rows would mix new LoRA weights with the old "
                             "copies; load it into the PEFT model and call register_adapters(model) again")
        per_site = split_state(caller, state, self.sites)
        if not per_site:
            raise ValueError(f"{caller}: state holds no lora_A / lora_B weights")
        loaded = LoadedAdapter(name, {}, {})
        for site_name, roles in per_site.items():
            site, stack_a = self.sites[site_name], self._a[site_name]
            where = f"{caller}: {site_name}"
            check_tensors(where, roles["A"], roles["B"])
            lora_a, lora_b = roles["A"], roles["B"]
            if site.format is not None:
                lora_a, lora_b = site.format.stack_pair(where, site, lora_a, lora_b)
            check_shapes(where, site, stack_a.shape[1], lora_a, lora_b)
            weights = AdapterWeights(lora_a, lora_b, scaling_for(name, site, lora_a.shape[0], scaling, config),
                                     magnitude=roles.get("magnitude"))
            loaded.weights[site_name] = host_slot_weights(where, weights, stack_a.dtype)
            if weights.magnitude is None and getattr(config, "use_dora", False):
                raise KeyError(f"{where}: the config says DoRA but the state has no lora_magnitude_vector for it")
            if weights.magnitude is not None:
                if site_name not in self._dora:
                    raise ValueError(f"{where}: a DoRA adapter, but the site was registered without one, so its "
                                     "compiled graphs do not rescale per slot; register the model with a DoRA "
                                     "adapter at this site (PEFT use_dora=True)")
                loaded.dora[site_name] = dora_rows(where, site, weights)
        return loaded

    def free_slot(self, name: str) -> Optional[int]:
        """The slot ``name`` would be written to without evicting anything: its own, else the first free one."""
        if name in self.slots:
            return self.slots.index(name)
        return self.slots.index(None) if None in self.slots else None

    def write(self, loaded: LoadedAdapter, slot: Optional[int] = None) -> int:
        """Write a validated adapter into ``slot`` (default: its own or the first free one); return the slot."""
        name = loaded.name
        if slot is None:
            slot = self.free_slot(name)
        if slot is None:
            raise ValueError(f"load_adapter({name!r}): all {len(self.slots)} slots are taken by {self.slots}; "
                             "create the metadata with a larger max_slots")
        self.slots[slot] = name
        self._pending[slot] = loaded
        return slot

    def _written(self) -> "AdapterStacks":
        """Copy the pending writes into the stacks (before anything reads them); returns self."""
        pending, self._pending = self._pending, {}
        for slot, loaded in pending.items():
            self._copy_in(loaded, slot)
        return self

    def _copy_in(self, loaded: LoadedAdapter, slot: int) -> None:
        for role, stacks in self._by_role().items():
            for site_name, stack in stacks.items():
                stack[slot] = self.loaded_row(loaded, site_name, role)

    def snapshot(self, slot: int) -> LoadedAdapter:
        """The adapter in ``slot`` as host copies, to write back later exactly as it is now."""
        name = self.slots[slot]
        self._written()
        weights = {site: (a[slot].clone(), self._b[site][slot].clone()) for site, a in self._a.items()}
        return LoadedAdapter(name, weights, {site: rows[slot].clone() for site, rows in self._dora.items()},
                             {site: bias[slot].clone() for site, bias in self._bias.items()})

    def clear(self, slot: int) -> None:
        """Free ``slot``: no adapter, zero rows in every stack."""
        self.write(LoadedAdapter(None, {}, {}, {}), slot)
        self.slots[slot] = None

    def host_row(self, site: str, role: str, slot: int) -> torch.Tensor:
        """One slot's row of a host stack: role "A" ``[R, in]``, "B" ``[out, R]``, "bias" or "dora"."""
        self._written()
        return self._by_role()[role][site][slot]

    def _by_role(self) -> Dict[str, Dict[str, torch.Tensor]]:
        """Each role's stacks by site: "A", "B", "bias", "dora"."""
        return {"A": self._a, "B": self._b, "bias": self._bias, "dora": self._dora}


__all__ = ["AdapterStacks", "LoadedAdapter"]
