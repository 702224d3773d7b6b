"""The model's own LoRA tensors, watched so that the stacks follow what is written into them later.

``register_adapters`` copies each adapter of the model into the stacks.  The
model's tensors can change afterwards: PEFT's ``hotswap_adapter`` writes
``param.data`` (which moves no version counter and keeps the pointer), and
fills ``prepare_model_for_compiled_hotswap``'s scaling tensors in place;
``load_state_dict`` and an optimizer step write in place;
``torch.utils.swap_tensors`` and ``param.data = t`` give a parameter new
storage; a module may be replaced.  ``WeightWatch.changed`` runs before every
compiled call and names the (site, adapter) pairs whose tensors moved since
they were stacked, so only those are read again.  A call checks only the
adapters its mapping names: a slot no row maps adds nothing to a result, and
an adapter changed while unmapped keeps its marks, so the first call that
maps it reads it again.

A tensor's mark is its object, version counter and storage (new shapes come with new storage,
and its runtime says what marks it: ``Runtime.storage_marks``):

- on XLA the storage is torch_xla's device data handle: a write, through
  ``.data`` or not, gives the tensor a new one (and until it runs, a pending
  computation instead, which counts as a change).  A handle is a buffer's
  address: writes through ``.data`` between two calls whose last buffer
  lands at the marked buffer's freed address would look like none; the
  version counter still tells any write that is not through ``.data``;
- on the host (CPU) a write through ``.data`` keeps pointer and version, so
  the mark also holds a copy, compared by value (the LoRA tensors only);
- on other devices: the data pointer and the version counter only.

Objects are compared as held since the last ``rebind``; ``rebind`` (once per
new graph, with the parameter index, and when a call finds one of its links
broken: object_links.py) reads them from the live modules again, which is how
a replaced parameter or module, or ``model.to(device)``, is seen.  Only
adapters whose stacked rows came from the model are watched: ``load_adapter``
or ``add_adapter`` of the same name replaces that definition (``unwatch``).

Not locked itself: ``LoRAMetadata`` holds its lock around every call.
"""
from __future__ import annotations

from typing import Dict, Iterable, List, Optional, Set, Tuple

import torch

from .. import runtimes
from ..adapters.records import SiteSpec
from .object_links import Link, LinkSet, tensor_links

Pair = Tuple[str, str]  # (site, adapter)
Group = Tuple["runtimes.Runtime", List[int], List[torch.Tensor]]


class WeightWatch:
    """Marks of every watched LoRA tensor, kept flat so that a call with nothing changed costs a few list
    comparisons (and, for host tensors, a comparison by value)."""

    def __init__(self):
        self._tensors: Dict[Pair, List[torch.Tensor]] = {}
        self._dirty: Set[Pair] = set()  # objects replaced (or never stacked): changed whatever their marks
        self._unwatched: Set[str] = set()
        self._flat: List[torch.Tensor] = []  # every watched tensor, pair by pair
        self._owner: List[Pair] = []
        self._versions: List[int] = []
        self._storage: list = []
        self._copies: Dict[int, torch.Tensor] = {}  # flat index -> copy, for the host tensors
        self._kinds: List[str] = []  # each flat tensor's device type
        # Per runtime: its flat indices and tensors, whose storage marks it reads in one call; all of them, and
        # per adapter.
        self._groups: List[Group] = []
        self._adapter_groups: Dict[str, List[Group]] = {}
        self._links: Dict[Pair, List[Link]] = {}  # from each watched pair's layer to its tensors and scaling
        self._adapter_links: Dict[str, LinkSet] = {}
        self._all_links = LinkSet(())

    def watch(self, sites: Iterable[SiteSpec]) -> None:
        """Watch every adapter of ``sites`` (after ``register_adapters``: all of them came from the model)."""
        self._tensors, self._dirty, self._unwatched, self._links = {}, set(), set(), {}
        self.rebind(sites)
        self.accept(list(self._tensors))

    def unwatch(self, adapter: str) -> None:
        """``adapter`` no longer holds the model's weights (loaded from a state or a directory)."""
        self._unwatched.add(adapter)
        for pair in [p for p in self._tensors if p[1] == adapter]:
            del self._tensors[pair]
            self._links.pop(pair, None)
            self._dirty.discard(pair)
        self._flatten()
        self._group_links()

    def rebind(self, sites: Iterable[SiteSpec]) -> None:
        """Read the watched tensors from the live modules; a pair whose objects are not the ones held is changed.

        ``sites`` are the registered records: an adapter the model gained later is not registered, so not watched.
        """
        moved = False
        for site in sites:
            live: Dict[str, List[torch.Tensor]] = {}
            for tensor, (adapter, _) in site.live_tensors():
                if adapter in site.adapters and adapter not in self._unwatched:
                    live.setdefault(adapter, []).append(tensor)
            links = tensor_links(site.module, [t for tensors in live.values() for t in tensors]) if live else {}
            for adapter, tensors in live.items():
                pair = (site.name, adapter)
                held = self._tensors.get(pair)
                if held is None or len(held) != len(tensors) or any(a is not b for a, b in zip(held, tensors)):
                    self._tensors[pair] = tensors
                    self._dirty.add(pair)
                    moved = True
                self._links[pair] = [link for t in tensors for link in links.get(id(t), ())] + [
                    Link(container, key, container[key], True)
                    for container, key in site.format.value_sources(site, adapter)]
        if moved:
            self._flatten()
        self._group_links()

    def links_broken(self, adapters: Optional[Iterable[str]] = None) -> bool:
        """Whether a layer of ``adapters`` (None: every one) holds another object or scaling than when last
        read (``rebind`` then reads them again)."""
        if adapters is None:
            return self._all_links.broken()
        return any(self._adapter_links[a].broken() for a in adapters if a in self._adapter_links)

    def _group_links(self) -> None:
        per_adapter: Dict[str, List[Link]] = {}
        for (_, adapter), links in self._links.items():
            per_adapter.setdefault(adapter, []).extend(links)
        self._adapter_links = {adapter: LinkSet(links) for adapter, links in per_adapter.items()}
        self._all_links = LinkSet(link for links in self._links.values() for link in links)

    def mark(self, pairs: Iterable[Pair]) -> List[Pair]:
        """Count ``pairs`` as changed whatever their marks (a float scaling moved: no tensor shows it);
        returns those watched, the others hold no model weights to read again."""
        watched = [p for p in pairs if p in self._tensors]
        self._dirty.update(watched)
        return watched

    def changed(self, adapters: Optional[Iterable[str]] = None) -> Dict[str, List[str]]:
        """``{adapter: [sites]}`` whose watched tensors changed since they were last stacked; of ``adapters``
        only, when given (the others keep their marks, to be compared when they are asked for)."""
        wanted = None if adapters is None else set(adapters)
        if wanted is None or wanted.issuperset(self._adapter_groups):
            bad, groups, copies = set(self._dirty), self._groups, self._copies
        else:
            bad = {pair for pair in self._dirty if pair[1] in wanted}
            groups = [group for adapter in wanted for group in self._adapter_groups.get(adapter, ())]
            copies = {i: c for i, c in self._copies.items() if self._owner[i][1] in wanted}
        for runtime, at, tensors in groups:
            versions, storage = [t._version for t in tensors], runtime.storage_marks(tensors)
            if len(at) == len(self._flat):  # every tensor, in flat order
                held_versions, held_storage = self._versions, self._storage
            else:
                held_versions, held_storage = [self._versions[i] for i in at], [self._storage[i] for i in at]
            if versions != held_versions or storage != held_storage:  # one comparison when nothing changed
                bad.update(self._owner[i] for i, v, s, v0, s0 in zip(at, versions, storage, held_versions,
                                                                     held_storage) if v != v0 or s != s0)
        # A write through ``.data`` on the host keeps pointer and version: compare by value.
        bad.update(self._owner[i] for i, copy in copies.items()
                   if self._owner[i] not in bad and not torch.equal(self._flat[i].detach(), copy))
        out: Dict[str, List[str]] = {}
        for site, adapter in sorted(bad):
            out.setdefault(adapter, []).append(site)
        return out

    def accept(self, pairs: Iterable[Pair]) -> None:
        """The stacks now hold what ``pairs``' tensors hold: mark them as they are."""
        pairs = set(pairs)
        self._dirty -= pairs
        at = [i for i, owner in enumerate(self._owner) if owner in pairs]
        storage = self._storage_now()
        for i in at:
            t = self._flat[i]
            self._versions[i], self._storage[i] = t._version, storage[i]
            if self._kinds[i] == "cpu":
                self._copies[i] = t.detach().clone()

    def _flatten(self) -> None:
        """Lay the held tensors out flat again; marks of pairs still held are kept, new ones are dirty."""
        old = {id(t): (v, s, self._copies.get(i)) for i, (t, v, s) in
               enumerate(zip(self._flat, self._versions, self._storage))}
        self._flat = [t for pair in self._tensors for t in self._tensors[pair]]
        self._owner = [pair for pair in self._tensors for _ in self._tensors[pair]]
        marks = [old.get(id(t), (None, None, None)) for t in self._flat]
        self._versions = [v for v, _, _ in marks]
        self._storage = [s for _, s, _ in marks]
        self._copies = {i: c for i, (_, _, c) in enumerate(marks) if c is not None}
        self._kinds = [t.device.type for t in self._flat]
        self._groups = self._grouped(range(len(self._flat)))
        per_adapter: Dict[str, List[int]] = {}
        for i, (_, adapter) in enumerate(self._owner):
            per_adapter.setdefault(adapter, []).append(i)
        self._adapter_groups = {adapter: self._grouped(at) for adapter, at in per_adapter.items()}

    def _grouped(self, indices: Iterable[int]) -> List[Group]:
        """``indices`` of the flat tensors by runtime: (runtime, indices, tensors)."""
        groups: Dict[runtimes.Runtime, List[int]] = {}
        for i in indices:
            groups.setdefault(runtimes.for_device(self._flat[i].device), []).append(i)
        return [(runtime, at, [self._flat[i] for i in at]) for runtime, at in groups.items()]

    def _storage_now(self) -> List[Optional[int]]:
        """Each tensor's storage mark, as its runtime reads it (XLA: the device data handle, None while a
        computation is pending; elsewhere the data pointer)."""
        if len(self._groups) == 1:
            return self._groups[0][0].storage_marks(self._groups[0][2])
        marks: List[Optional[int]] = [None] * len(self._flat)
        for runtime, at, tensors in self._groups:
            for i, mark in zip(at, runtime.storage_marks(tensors)):
                marks[i] = mark
        return marks


__all__ = ["WeightWatch"]
