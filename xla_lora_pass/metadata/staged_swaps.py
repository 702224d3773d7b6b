"""Swaps prepared ahead: an adapter's rows cut and packed per device, kept for its next swaps.

A swap's host side (its rows as ``AdapterStacks.write`` makes them, cut to
their bucket and packed into one buffer per device: ``SlotSwap.stage``) takes
about as long as sending them.  ``prefetch`` prepares it on its background
thread; a swap that finds nothing prepared prepares it on the serving thread.
Either way it is kept, by adapter name, under the bounds of the pool's host
cache (the same count and bytes, though never fewer than ``STAGED``
adapters), for as long as the same ``LoadedAdapter`` can come back (the host
cache returns the object it read), so an adapter swapped out and back in
prepares nothing again.  What was prepared for another ``LoadedAdapter`` of
the name (a new definition) or for swaps that a re-registration replaced is
prepared anew.
"""
from __future__ import annotations

import threading
from typing import Dict, Mapping, Optional

from .host_lru import HostLRU
from .host_stacks import AdapterStacks, LoadedAdapter
from .slot_rows import SlotRow, slot_row
from .slot_swap import SlotSwap, Staged

STAGED = 32  # adapters kept prepared at least (a prefetch prepares the next batch's few), whatever their bytes


class StagedSwaps:
    """Per adapter name: the ``LoadedAdapter`` its swaps were prepared from, and per device the ``Staged``."""

    def __init__(self, stacks: AdapterStacks, max_items: Optional[int] = None, max_bytes: Optional[int] = None):
        self._stacks = stacks
        # name -> (the LoadedAdapter, {device: Staged}), least recently used first out
        self._staged: HostLRU[tuple] = HostLRU(None if max_items is None else max(STAGED, max_items), max_bytes,
                                               min_items=STAGED)
        self._lock = threading.Lock()  # the prefetch thread prepares while the serving thread swaps

    def stage(self, loaded: LoadedAdapter, swaps: Mapping[str, SlotSwap]) -> None:
        """Prepare ``loaded``'s swap for every device of ``swaps``, unless it is prepared for them already
        (then it only counts as used).  Needs no other lock: it reads the stacks' shapes, which only a
        re-registration changes, and a swap ignores what was prepared for another (``Staged.swap``)."""
        with self._lock:
            entry = self._staged.get(loaded.name)  # now the most recently used
            if entry is not None and entry[0] is loaded and all(
                    entry[1].get(device) is not None and entry[1][device].swap is swap
                    for device, swap in swaps.items()):
                return
        staged = {device: swap.stage([self._loaded_row(loaded, site, role) for site, role in swap.plains])
                  for device, swap in swaps.items()}
        with self._lock:
            self._staged.put(loaded.name, (loaded, staged), sum(s.bytes for s in staged.values()))

    def get(self, loaded: LoadedAdapter) -> Dict[str, Staged]:
        """What was prepared for ``loaded`` (this object), by device; empty if nothing was."""
        with self._lock:
            entry = self._staged.get(loaded.name)
        return entry[1] if entry is not None and entry[0] is loaded else {}

    def _loaded_row(self, loaded: LoadedAdapter, site, role: str) -> SlotRow:
        """The row ``AdapterStacks`` writes for ``loaded``, cut along its rank dim as ``DeviceStacks`` reads
        a host row (a fused group's A: one part per site)."""
        return slot_row(site, role, lambda name, part: self._stacks.loaded_row(loaded, name, part))


__all__ = ["STAGED", "StagedSwaps"]
