"""Many adapters on a few slots: which adapter goes into which slot, and where its weights come from.

The device holds ``num_slots`` adapters at a time (the stacks every compiled
graph reads); an ``AdapterSource`` knows any number more by name, on the host
or on disk (a PEFT ``save_pretrained`` directory, read as data only).  When a
mapping names an adapter that is not in a slot, ``plan_slots`` picks the slot:
a free one, else the least recently used adapter the mapping does not need and
nobody pinned (S-LoRA's and LoRAX's policy).  A mapping that needs more
adapters than there are slots is refused before anything changes.

Reading a directory is the slow part of a swap (file I/O and safetensors
parsing); ``AdapterSource.prefetch`` reads the next mapping's adapters on a
background thread into a small host cache, so the serving thread only copies
the weights into the stacks.
"""
from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import os
import threading
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

import torch

from .errors import UnsupportedMappingError
from .formats.peft_dir import read_adapter_dir

AdapterData = Union[str, os.PathLike, Mapping[str, torch.Tensor]]


class SlotCapacityError(UnsupportedMappingError):
    """A mapping needs more adapters on the device at once than there are slots to hold them."""


@dataclasses.dataclass(frozen=True)
class SlotPlan:
    """What to load where for one mapping: (adapter, slot) pairs, and the adapters they replace."""

    loads: Tuple[Tuple[str, int], ...]
    evictions: Tuple[str, ...]
    hits: int  # adapters the mapping names that were already in a slot


def plan_slots(slots: Sequence[Optional[str]], wanted: Iterable[str], *, pinned: Iterable[str] = (),
               last_used: Mapping[str, int] = {}, caller: str = "set the mapping") -> SlotPlan:
    """Slots for the adapters ``wanted`` (in first-use order): resident ones stay, the others take a free
    slot, else the least recently used slot whose adapter is neither wanted nor pinned.

    Raises ``SlotCapacityError`` (nothing changes) when ``wanted`` holds more adapters than the slots
    that are free, resident for it, or evictable.
    """
    wanted = list(dict.fromkeys(wanted))
    resident = {name: slot for slot, name in enumerate(slots) if name is not None}
    missing = [name for name in wanted if name not in resident]
    keep = set(wanted) | set(pinned)
    free = [slot for slot, name in enumerate(slots) if name is None]
    evictable = sorted((slot for slot, name in enumerate(slots) if name is not None and name not in keep),
                       key=lambda slot: last_used.get(slots[slot], -1))
    if len(missing) > len(free) + len(evictable):
        held = sorted(set(pinned) & set(resident) - set(wanted))
        raise SlotCapacityError(
            f"{caller}: the mapping uses {len(wanted)} adapters {wanted} at once, but there are "
            f"{len(slots)} slots" + (f", {len(held)} of them pinned by {held}" if held else "") +
            f": it needs {len(wanted) + len(held)} slots. Split the batch into batches of at most "
            f"{len(slots) - len(held)} adapters, unpin some, or create the LoRAMetadata with a larger max_slots")
    loads, evictions = [], []
    for name in missing:
        if free:
            slot = free.pop(0)
        else:
            slot = evictable.pop(0)
            evictions.append(slots[slot])
        loads.append((name, slot))
    return SlotPlan(tuple(loads), tuple(evictions), hits=len(wanted) - len(missing))


@dataclasses.dataclass(frozen=True)
class SourcedAdapter:
    """One adapter the source knows: its data (a directory or a state dict) and how to scale it."""

    data: AdapterData
    scaling: Optional[float] = None
    config: Any = None


class AdapterSource:
    """Adapters known by name, kept on the host or on disk until a slot needs them.

    ``read(name)`` returns ``(state, config, scaling)`` for ``load_adapter``;
    a directory is read at most once while it stays in the host cache of the
    ``host_cache`` most recently read adapters (prefetched ones included).
    Thread safe: ``prefetch`` reads on one background thread.
    """

    def __init__(self, host_cache: int = 16):
        if host_cache < 0:
            raise ValueError(f"host_cache must be >= 0, got {host_cache}")
        self._adapters: Dict[str, SourcedAdapter] = {}
        self._read: "collections.OrderedDict[str, Tuple[Mapping[str, torch.Tensor], Any]]" = \
            collections.OrderedDict()
        self._pending: Dict[str, concurrent.futures.Future] = {}
        self._host_cache = host_cache
        self._lock = threading.Lock()
        self._executor: Optional[concurrent.futures.ThreadPoolExecutor] = None

    def add(self, name: str, data: AdapterData, *, scaling: Optional[float] = None, config=None) -> None:
        """Know ``name``: a PEFT adapter directory or a state dict (kept by reference, not copied)."""
        if not isinstance(name, str) or not name:
            raise TypeError(f"add_adapter: the adapter name must be a non-empty str, got {name!r:.80}")
        if isinstance(data, (str, os.PathLike)):
            if not os.path.isdir(data):
                raise FileNotFoundError(f"add_adapter({name!r}): {os.fspath(data)!r} is not a directory; give a "
                                        "directory written by PEFT's save_pretrained, or a state dict")
        elif not isinstance(data, Mapping):
            raise TypeError(f"add_adapter({name!r}): expected a PEFT adapter directory or a state dict, got "
                            f"{type(data).__name__}")
        with self._lock:
            self._adapters[name] = SourcedAdapter(data, scaling, config)
            self._read.pop(name, None)  # a new definition: forget what was read for the old one

    def remove(self, name: str) -> None:
        with self._lock:
            self._adapters.pop(name, None)
            self._read.pop(name, None)

    def __contains__(self, name) -> bool:
        with self._lock:
            return name in self._adapters

    def names(self) -> List[str]:
        with self._lock:
            return list(self._adapters)

    def read(self, name: str) -> Tuple[Mapping[str, torch.Tensor], Any, Optional[float]]:
        """``(state, config, scaling)`` of ``name``, from the host cache, a prefetch, or the disk now."""
        with self._lock:
            if name not in self._adapters:
                raise KeyError(f"unknown adapter {name!r}: neither in a slot nor added with add_adapter")
            entry = self._adapters[name]
            pending = self._pending.get(name)
        if not isinstance(entry.data, (str, os.PathLike)):
            return entry.data, entry.config, entry.scaling
        if pending is not None:
            pending.result()  # a prefetch is reading it: wait for that read rather than read again
        with self._lock:
            cached = self._read.get(name)
            if cached is not None:
                self._read.move_to_end(name)
        if cached is None:
            cached = self._read_now(name, entry)
        state, saved_config = cached
        return state, entry.config if entry.config is not None else saved_config, entry.scaling

    def prefetch(self, names: Iterable[str]) -> None:
        """Start reading the directories of ``names`` on a background thread (unknown names are skipped)."""
        with self._lock:
            todo = [n for n in dict.fromkeys(names) if n in self._adapters and n not in self._read
                    and n not in self._pending and isinstance(self._adapters[n].data, (str, os.PathLike))]
            if not todo:
                return
            if self._executor is None:
                self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="xla-lora-prefetch")
            for name in todo:
                self._pending[name] = self._executor.submit(self._prefetch_one, name, self._adapters[name])

    def _prefetch_one(self, name: str, entry: SourcedAdapter) -> None:
        try:
            self._read_now(name, entry)
        except Exception:  # noqa: BLE001  the serving thread's own read raises it where it can be handled
            pass
        finally:
            with self._lock:
                self._pending.pop(name, None)

    def _read_now(self, name: str, entry: SourcedAdapter):
        cached = read_adapter_dir(f"load_adapter({name!r})", entry.data)
        with self._lock:
            if self._adapters.get(name) is entry and self._host_cache:
                self._read[name] = cached
                self._read.move_to_end(name)
                while len(self._read) > self._host_cache:
                    self._read.popitem(last=False)
        return cached
