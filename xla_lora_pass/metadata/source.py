"""Adapters known by name and kept off the device: on disk (a PEFT directory) or as host copies.

Reading a directory is the slow part of a swap (file I/O, safetensors
parsing, the cast and the checks of ``load_adapter``); ``prefetch`` does it
on a background thread into a small host cache of validated adapters, then
hands each to ``on_prefetched`` (the pool stages its swap there), so the
serving thread only copies rows into the stacks and starts the device write.
"""
from __future__ import annotations

import concurrent.futures
import os
import threading
from typing import Callable, Dict, Iterable, List, Optional, Union

from ..errors import AdapterFileNotFoundError
from .host_lru import HostLRU
from .host_stacks import LoadedAdapter

# validate(name, directory, scaling, config, where) -> the adapter's checked host weights (AdapterStacks.validate);
# ``where`` starts its errors (the call that needed the adapter).
Validate = Callable[[str, Union[str, os.PathLike], Optional[float], object, Optional[str]], LoadedAdapter]


class AdapterSource:
    """Adapters by name: a directory read when needed, or a validated host copy kept as it is.

    ``get(name)`` returns the adapter ready for ``AdapterStacks.write``.  A
    directory is read and validated at most once while it stays in the host
    cache: the most recently read ones (prefetched ones included), at most
    ``host_cache`` of them (None: no count) holding at most ``host_cache_bytes``
    (None: no bound).
    Thread safe: ``prefetch`` reads on one background thread.
    """

    def __init__(self, validate: Validate, host_cache: Optional[int] = None,
                 on_prefetched: Callable[[LoadedAdapter], None] = lambda loaded: None,
                 host_cache_bytes: Optional[int] = None):
        for what, bound in (("host_cache", host_cache), ("host_cache_bytes", host_cache_bytes)):
            if bound is not None and bound < 0:
                raise ValueError(f"{what} must be >= 0 or None, got {bound}")
        self._validate = validate
        self._on_prefetched = on_prefetched  # more host work for a swap, on the prefetch thread (staging)
        self._dirs: Dict[str, tuple] = {}  # name -> (directory, scaling, config)
        self._kept: Dict[str, LoadedAdapter] = {}  # host copies (a state dict loaded, a slot evicted)
        self._read: HostLRU[LoadedAdapter] = HostLRU(host_cache, host_cache_bytes)
        self._pending: Dict[str, concurrent.futures.Future] = {}
        self._lock = threading.Lock()
        self._executor: Optional[concurrent.futures.ThreadPoolExecutor] = None

    def add_dir(self, name: str, path, *, scaling: Optional[float] = None, config=None) -> None:
        """Know ``name`` as a PEFT adapter directory, read when a slot needs it."""
        if not os.path.isdir(path):
            raise AdapterFileNotFoundError(f"add_adapter({name!r}): {os.fspath(path)!r} is not a directory; give a "
                                    "directory written by PEFT's save_pretrained, or a state dict")
        with self._lock:
            self._kept.pop(name, None)
            self._read.pop(name)  # a new definition: forget what was read for the old one
            self._dirs[name] = (path, scaling, config)

    def keep(self, loaded: LoadedAdapter) -> None:
        """Know ``loaded.name`` as this host copy (replacing a directory of that name)."""
        with self._lock:
            self._dirs.pop(loaded.name, None)
            self._read.pop(loaded.name)
            self._kept[loaded.name] = loaded

    def forget_copies(self) -> None:
        """Drop every host copy (kept and read); directories stay known and are read again when needed."""
        with self._lock:
            self._kept.clear()
            self._read.clear()

    def remove(self, name: str) -> None:
        with self._lock:
            for table in (self._dirs, self._kept):
                table.pop(name, None)
            self._read.pop(name)

    def __contains__(self, name) -> bool:
        with self._lock:
            return name in self._dirs or name in self._kept

    def names(self) -> List[str]:
        with self._lock:
            return list(self._dirs) + list(self._kept)

    def get(self, name: str, where: Optional[str] = None) -> LoadedAdapter:
        """The adapter ``name``: kept, cached, being prefetched (waited for), or read now (its errors start
        with ``where``: the call that needs it)."""
        with self._lock:
            if name in self._kept:
                return self._kept[name]
            if name not in self._dirs:
                raise KeyError(f"unknown adapter {name!r}: neither in a slot nor added with add_adapter")
            pending = self._pending.get(name)
        if pending is not None:
            pending.result()  # a prefetch is reading it: wait for that read rather than read again
        with self._lock:
            cached = self._read.get(name)
            if cached is not None:
                return cached
            entry = self._dirs[name]
        return self._read_now(name, entry, where)

    def prefetch(self, names: Iterable[str], wait: bool = False) -> None:
        """Start reading the directories of ``names`` on a background thread, and handing those read already
        (host copies, cached reads) to ``on_prefetched`` again; unknown names are skipped.  ``wait``: return
        once that is done (a read that failed raises at ``get``)."""
        names = list(dict.fromkeys(names))
        self._start(names)
        if wait:
            with self._lock:
                pending = [self._pending[n] for n in names if n in self._pending]
            concurrent.futures.wait(pending)

    def _start(self, names: List[str]) -> None:
        with self._lock:
            todo = [n for n in names
                    if n in self._dirs and n not in self._read and n not in self._pending]
            # Read already (a host copy, or cached): only the swap's host side to prepare again, since the
            # last swap of it used what was prepared (``on_prefetched`` skips what is still prepared).
            ready = [held for n in names if n not in self._pending
                     for held in [self._kept.get(n, self._read.get(n))] if held is not None]
            if not todo and not ready:
                return
            if self._executor is None:
                self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="xla-lora-prefetch")
            for name in todo:
                self._pending[name] = self._executor.submit(self._prefetch_one, name, self._dirs[name])
            for loaded in ready:
                self._pending[loaded.name] = self._executor.submit(self._prepare, loaded)

    def _prepare(self, loaded: LoadedAdapter) -> None:
        try:
            self._on_prefetched(loaded)
        except Exception:  # noqa: BLE001  the swap prepares it again on the serving thread
            pass
        finally:
            with self._lock:
                self._pending.pop(loaded.name, None)

    def _prefetch_one(self, name: str, entry: tuple) -> None:
        try:
            self._on_prefetched(self._read_now(name, entry, f"prefetch({name!r})"))
        except Exception:  # noqa: BLE001  get() reads again and raises it on the serving thread
            pass
        finally:
            with self._lock:
                self._pending.pop(name, None)

    def _read_now(self, name: str, entry: tuple, where: Optional[str]) -> LoadedAdapter:
        path, scaling, config = entry
        loaded = self._validate(name, path, scaling, config, where)
        with self._lock:
            if self._dirs.get(name) is entry:
                self._read.put(name, loaded, loaded.nbytes)
        return loaded


__all__ = ["AdapterSource", "Validate"]
