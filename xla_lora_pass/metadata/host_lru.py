"""Host copies kept least recently used first out, bounded by their count and by their bytes.

The pool keeps two such caches: the adapters read from directories
(``source.py``) and the swaps prepared from them (``staged_swaps.py``).  A
byte bound fits both a catalogue of small adapters (all of it stays) and one
of large adapters (as many as the memory allows), which one count cannot.
"""
from __future__ import annotations

import collections
from typing import Generic, Hashable, Optional, Tuple, TypeVar

V = TypeVar("V")


class HostLRU(Generic[V]):
    """``key -> value`` with each value's bytes; ``put`` drops the least recently used entries while more than
    ``max_items`` are kept, or while they hold more than ``max_bytes`` and more than ``min_items`` are kept.

    ``None`` lifts a bound.  An entry larger than ``max_bytes`` on its own is
    not kept (unless ``min_items`` keeps it).  Not locked: callers hold their own lock.
    """

    def __init__(self, max_items: Optional[int] = None, max_bytes: Optional[int] = None, min_items: int = 0):
        self.max_items, self.max_bytes, self.min_items = max_items, max_bytes, min_items
        self._entries: "collections.OrderedDict[Hashable, Tuple[V, int]]" = collections.OrderedDict()
        self.nbytes = 0

    def get(self, key: Hashable) -> Optional[V]:
        """The value of ``key`` (now the most recently used), or None."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        self._entries.move_to_end(key)
        return entry[0]

    def put(self, key: Hashable, value: V, nbytes: int) -> None:
        self.pop(key)
        self._entries[key] = (value, nbytes)
        self.nbytes += nbytes
        while self._entries and self._over():
            self.pop(next(iter(self._entries)))

    def pop(self, key: Hashable) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self.nbytes -= entry[1]

    def clear(self) -> None:
        self._entries.clear()
        self.nbytes = 0

    def __contains__(self, key) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def _over(self) -> bool:
        count = len(self._entries)
        if self.max_items is not None and count > self.max_items:
            return True
        return self.max_bytes is not None and self.nbytes > self.max_bytes and count > self.min_items


__all__ = ["HostLRU"]
