"""The metadata's lock around its methods: each call is all-or-nothing for other threads."""
from __future__ import annotations

import functools


def locked(method):
    """Run ``method`` holding the object's lock (``self._lock``)."""
    @functools.wraps(method)
    def run_locked(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)
    return run_locked


def forward(part: str, method):
    """A facade method that is ``method`` of the part ``self.<part>``, locked; the part's docstring is its."""
    @locked
    @functools.wraps(method)
    def forwarded(self, *args, **kwargs):
        return method(getattr(self, part), *args, **kwargs)
    return forwarded
