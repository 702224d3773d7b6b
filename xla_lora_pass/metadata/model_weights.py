"""The stacks kept in step with the model's own LoRA tensors after they change in place.

``weight_watch.py`` says which (site, adapter) pairs changed since they were
stacked; ``ModelWeights.sync`` reads only those again from the live modules
(the format's own reader, so the scaling, a padded rank, a LoRA bias and DoRA
magnitudes come as at registration), checks all of them first, and only then
writes: the slot's host rows and device rows of the changed sites, or the
kept host copy of an adapter the pool has moved out of its slot.  A change
that cannot be served (a rank above the site's stacked rank, a value that is
not finite, ...) raises ``UnsupportedAdapterError`` naming the adapter and
the site, at every call until the model is put right or registered again;
nothing is written before it.

Not locked itself: ``LoRAMetadata`` holds its lock around every call.
"""
from __future__ import annotations

import contextlib

import math
from typing import Callable, Dict, Iterable, List, Optional, Tuple

from ..adapters.dora import dora_rows
from ..adapters.records import AdapterWeights
from ..errors import UnsupportedAdapterError
from .device_stacks import DeviceStacks
from .host_stacks import AdapterStacks, LoadedAdapter
from .slot_weights import check_shapes, check_tensors, host_slot_weights
from .source import AdapterSource
from .weight_watch import WeightWatch

# How close a graph's scaling must be to the stacked one (the patterns' check of a constant scale too).
SCALING_TOLERANCE = 1e-6


class ModelWeights:
    """Re-stacks what changed in the model's LoRA tensors (``sync``), before each compiled call."""

    def __init__(self, stacks: AdapterStacks, devices: DeviceStacks, source: AdapterSource,
                 count: Callable[..., None]):
        self._stacks, self._devices, self._source, self._count = stacks, devices, source, count
        self._watch = WeightWatch()
        self._held = 0  # > 0: inside hold(), sync reads nothing

    def watch(self) -> None:
        """After ``register_adapters``: every registered adapter holds the model's weights."""
        self._watch.watch(self._stacks.sites.values())

    def unwatch(self, name: str) -> None:
        """``name`` is defined by a state or a directory now (``load_adapter``, ``add_adapter``), not the model."""
        self._watch.unwatch(name)

    def refresh(self) -> None:
        """Once per new graph, before its rewrite: read the watched tensors' objects from the live modules
        again, and re-stack what changed.

        Dynamo traces a new graph when a change alters what it guards on (PEFT's hotswap writing a new
        float scaling, or the float alone); the rewrite checks each site's scaling against the stacked one,
        so the change must be stacked first, or the new scaling reads as a near miss.  A change that cannot be served is left
        for the call: ``sync`` raises it there, before any program runs, at every call.
        """
        self._watch.rebind(self._stacks.sites.values())
        self._watch.mark(self._scalings_moved())  # a float alone moves no tensor the watch could see
        try:
            self.sync()
        except UnsupportedAdapterError:
            pass

    def sync(self, adapters: Optional[Iterable[str]] = None) -> int:
        """Re-stack what changed in the model's own LoRA tensors since they were stacked (PEFT's
        ``hotswap_adapter``, ``load_state_dict``, an optimizer step); every compiled call runs it first, for
        the adapters its mapping names (``adapters``; None: every one).  Returns the number of (site, adapter)
        pairs read again."""
        if self._held:
            return 0
        if self._watch.links_broken(adapters):  # an object replaced, or a float scaling moved: read again
            self._watch.rebind(self._stacks.sites.values())
            self._watch.mark(self._scalings_moved())
        changed = self._watch.changed(adapters)
        if not changed:
            return 0
        reads = {adapter: self._read(adapter, sites) for adapter, sites in changed.items()}  # all checks first
        for adapter, (rows, fresh) in reads.items():
            self._write(adapter, rows)
            for site, weights in fresh.items():
                self._stacks.sites[site].adapters[adapter] = weights  # the scaling the rewrite checks against
            self._watch.accept((site, adapter) for site in fresh)
        pairs = sum(len(sites) for sites in changed.values())
        self._count("weight_refreshes", n=pairs)
        return pairs

    @contextlib.contextmanager
    def synced_once(self, lock):
        """Within: ``sync`` reads nothing; it runs once at entry (nesting counts).  ``lock``: the metadata's.

        A ``generate``'s steps run so: the check reads every watched tensor's
        version and storage, and nothing writes the weights between two steps
        of one generate (a write from inside one is served from the next call
        on)."""
        with lock:
            self.sync()
            self._held += 1
        try:
            yield
        finally:
            with lock:
                self._held -= 1

    def follow_scalings(self, values: Dict[Tuple[str, str], float]) -> None:
        """``values``: each (site, adapter)'s scaling as this call's graph applies it: an input Dynamo made of
        the model's float ``scaling`` (newer torch, ``dynamic=True``), or a constant it baked in and guards
        on.  A float moves no version counter, so the watch cannot see it change.  Re-stacks a watched adapter whose stacked scaling differs; raises
        ``UnsupportedAdapterError`` naming it if the stacks still differ then, never serving a stale scaling.
        An adapter loaded over the model's (``unwatch``) keeps its own scaling, whatever the model's is."""
        stale = self._watch.mark([p for p, v in values.items() if not self._holds(p, v)])
        if not stale:
            return
        self.sync()
        for site, adapter in stale:
            if not self._holds((site, adapter), values[site, adapter]):
                raise UnsupportedAdapterError(
                    f"adapter {adapter!r} at {site}: this call scales its delta by {values[site, adapter]} (the "
                    f"model's scaling, a graph input), the stacks hold {self._scaling((site, adapter))} even "
                    "after reading the model again: call meta.register_adapters(model) again")

    def _scalings_moved(self) -> List[Tuple[str, str]]:
        """(site, adapter) pairs whose live scaling, as the format reads it, is not the stacked one."""
        moved = []
        for site in self._stacks.sites.values():
            if site.module is None or site.format is None:
                continue
            try:
                live = site.format.read(site.name, site.module, next(iter(site.adapters)))
            except (UnsupportedAdapterError, KeyError, TypeError, ValueError):
                continue  # what cannot be read now, sync refuses at the call
            moved += [(site.name, a) for a, w in (live.adapters.items() if live is not None else ())
                      if a in site.adapters and not self._holds((site.name, a), w.scaling)]
        return moved

    def _holds(self, pair: Tuple[str, str], value: float) -> bool:
        """The stacks hold ``value`` as the scaling of (site, adapter), or hold no such adapter."""
        held = self._scaling(pair)
        return held is None or math.isclose(held, value, rel_tol=SCALING_TOLERANCE)

    def _scaling(self, pair: Tuple[str, str]):
        """The stacked scaling of (site, adapter), None if the site holds no such adapter."""
        weights = self._stacks.sites[pair[0]].adapters.get(pair[1]) if pair[0] in self._stacks.sites else None
        return weights.scaling if weights is not None else None

    def _read(self, adapter: str, sites: List[str]) -> Tuple[LoadedAdapter, Dict[str, AdapterWeights]]:
        rows, fresh = LoadedAdapter(adapter, {}, {}, {}), {}
        for name in sites:
            site = self._stacks.sites[name]
            where = f"adapter {adapter!r} at {name} (changed in the model since register_adapters)"
            try:
                weights = site.format.read(site.name, site.module, adapter).adapters[adapter]
                check_tensors(where, weights.lora_a, weights.lora_b)
                check_shapes(where, site, self._stacks.site_rank(name), weights.lora_a, weights.lora_b)
                rows.weights[name] = host_slot_weights(where, weights, self._stacks.host_a(name).dtype)
                if (weights.magnitude is None) != (site.adapters[adapter].magnitude is None):
                    raise ValueError(f"{where}: DoRA was {'added' if weights.magnitude is not None else 'removed'}")
                if weights.magnitude is not None:
                    rows.dora[name] = dora_rows(where, site, weights)
                if weights.bias is not None:  # KeyError: the site was registered without a LoRA bias
                    rows.bias[name] = (weights.bias.detach().to("cpu").float() * weights.scaling).to(
                        self._stacks.host_bias(name).dtype)
            except (KeyError, TypeError, ValueError, UnsupportedAdapterError) as e:
                raise UnsupportedAdapterError(
                    f"{e}; the stacks cannot follow this change: call meta.register_adapters(model) again "
                    "(which recompiles), or load the adapter with meta.load_adapter") from e
            fresh[name] = weights
        return rows, fresh

    def _write(self, adapter: str, rows: LoadedAdapter) -> None:
        """Overlay the changed sites on the adapter's rows: in its slot (host and device), and its kept copy.

        The pool keeps a host copy of a model adapter when it first leaves its slot and takes no new one
        at later evictions, so that copy must follow a change made while the adapter is in its slot too.
        """
        if adapter in self._source:  # the copy the pool brings it back from (a watched adapter has no directory)
            self._source.keep(_overlay(self._source.get(adapter), rows))
        if adapter in self._stacks.slots:
            slot = self._stacks.slots.index(adapter)
            self._stacks.write(_overlay(self._stacks.snapshot(slot), rows), slot)
            self._devices.write_slot(slot, set(rows.weights))


def _overlay(base: LoadedAdapter, rows: LoadedAdapter) -> LoadedAdapter:
    return LoadedAdapter(base.name, {**base.weights, **rows.weights}, {**base.dora, **rows.dora},
                         {**base.bias, **rows.bias})


__all__ = ["ModelWeights"]
