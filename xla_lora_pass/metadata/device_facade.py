"""The device half of the ``LoRAMetadata`` facade: the stacks on each device, and their SPMD placement.

``LoRAMetadata`` inherits these methods; they use its lock and its device
stacks (``self._devices``, device_stacks.py).
"""
from __future__ import annotations

import contextlib
from typing import Optional, Tuple

import torch

from .device_stacks import DeviceStacks, Site
from .locking import forward as _forward
from .locking import locked as _locked


class DeviceFacade:
    """The stacked weights each compiled graph reads, on its device."""

    # ------------------------------------------------- device placement
    @_locked
    def stacked_weights(self, site_name: Site, device) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The site's stacked (A, B) on ``device``, each transferred once and cached.

        ``site_name`` may be a tuple of sites (sites fused on one input): A is
        then their stacks concatenated along the rank dim, B None.
        """
        fused = isinstance(site_name, tuple)
        return self._devices.stacked_a(site_name, device), None if fused else self._devices.stacked_b(site_name, device)

    @property
    @_locked
    def stacks_generation(self) -> int:
        """Changes whenever the device stacks are made anew: until then ``stacked_*`` return the same tensors."""
        return self._devices.generation

    @contextlib.contextmanager
    def sending_stacks(self, device):
        """Around a graph's lookup of its stacks (``DeviceStacks.sending``): a swap then writes every stack on
        ``device`` with one program, compiled when the lookup ends."""
        with self._lock, self._devices.sending(device):
            yield

    stacked_a = _forward("_devices", DeviceStacks.stacked_a)
    stacked_b = _forward("_devices", DeviceStacks.stacked_b)
    stacked_bias = _forward("_devices", DeviceStacks.stacked_bias)
    stacked_dora = _forward("_devices", DeviceStacks.stacked_dora)

    @_locked
    def shard(self, mesh, layout=None, *, axis: Optional[str] = None, both: bool = False):
        """Shard the stacked adapter buffers over a torch_xla SPMD ``mesh`` like their base weights.

        Per site ``column``, ``row`` or ``replicated`` (metadata/sharding.py's table),
        from ``layout`` (``{leaf module name or site: layout}``, e.g.
        ``sharding.MEGATRON_LLAMA``, or a callable) or else read off the base
        weight's sharding spec; ``both=True`` also splits the stack the layout
        leaves whole.  Index buffers stay replicated.  Returns the
        ``sharding.AdapterSharding``; ``shard(None)`` turns it off.
        docs/scale-out.md.
        """
        from .sharding import AdapterSharding

        sharding = None if mesh is None else AdapterSharding(self, mesh, layout, axis, both)
        self._devices.set_sharding(sharding)
        return sharding

    @property
    @_locked
    def sharding(self):
        """The ``AdapterSharding`` set by ``shard(mesh)``, or None."""
        return self._devices.sharding


__all__ = ["DeviceFacade"]
