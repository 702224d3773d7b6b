"""The counters behind ``LoRAMetadata.stats``: compiles, rewrites, bucket hits, fallbacks, padding.

Not locked itself: ``LoRAMetadata`` holds its lock around every call.
"""
from __future__ import annotations

import types
from typing import Dict, Mapping, Union

# Counters kept per sub-key (rewrites per pattern, hits per bucket); the others are plain numbers.
BY_SUB_KEY = ("rewrites", "bucket_hits")
COUNTERS = ("compiles", "rewrites", "bucket_hits", "fallbacks", "padded_tokens", "real_tokens",
            # the adapter pool (metadata/pool.py): adapters written into a slot, adapters they replaced,
            # adapters a mapping named that were in a slot already, adapter weight bytes sent to the device
            "loads", "evictions", "slot_hits", "bytes_to_device",
            # (site, adapter) pairs read again after the model's own LoRA tensors changed (model_weights.py)
            "weight_refreshes")


class Stats:
    """Counters that the backend bumps while it compiles and runs graphs."""

    def __init__(self):
        self._counts: Dict[str, Union[int, Dict]] = {k: {} if k in BY_SUB_KEY else 0 for k in COUNTERS}

    def count(self, key: str, sub=None, n: int = 1) -> None:
        """Add ``n`` to counter ``key``, to its entry ``sub`` for a counter kept per sub-key."""
        if key not in self._counts:
            raise KeyError(f"stats.count: unknown counter {key!r}; counters: {list(COUNTERS)}")
        if (key in BY_SUB_KEY) != (sub is not None):
            raise ValueError(f"stats.count({key!r}): give sub= for {list(BY_SUB_KEY)} and only for them, "
                             f"got sub={sub!r}")
        if sub is None:
            self._counts[key] += n
        else:
            self._counts[key][sub] = self._counts[key].get(sub, 0) + n

    def snapshot(self) -> Mapping:
        """A read-only copy (nested counters copied, not shared) with ``padded_token_fraction`` added."""
        out = {k: dict(v) if isinstance(v, dict) else v for k, v in self._counts.items()}
        total = out["padded_tokens"] + out["real_tokens"]
        out["padded_token_fraction"] = out["padded_tokens"] / total if total else 0.0
        return types.MappingProxyType(out)


__all__ = ["Stats", "COUNTERS", "BY_SUB_KEY"]
