"""Device copies of the host stacks, each transferred once, and their SPMD placement (``shard``).

After ``register_adapters`` or ``shard`` every copy is made anew at its
next use.  An adapter swapped into one slot (metadata/pool.py) is written in
place instead (``write_slot``): one slot's rows cross to the device, once
for a plain and a transposed copy, so a swap costs one adapter's bytes
whatever the number of slots; XLA compiles that update once per set of
stacks and reuses it.  A site is one name, or a tuple of names for sites
fused on one input (graph_rewrites/passes/fuse_shared_shrink.py): their A stacks
concatenated along the rank dim.

Not locked itself: ``LoRAMetadata`` holds its lock around every call.
"""
from __future__ import annotations

from typing import Callable, Dict, Tuple, Union

import torch

from .host_stacks import AdapterStacks

Site = Union[str, Tuple[str, ...]]  # one site, or the sites fused on one input


class DeviceStacks:
    """Per (site, role, device): the device copy of a host stack, annotated for SPMD after ``shard``."""

    def __init__(self, stacks: AdapterStacks, count: Callable[..., None] = lambda *a, **k: None):
        self._stacks = stacks
        self._count = count  # Stats.count: adapter bytes sent to the device
        self._copies: Dict[Tuple[Site, str, str], torch.Tensor] = {}
        self.sharding = None  # sharding.AdapterSharding after shard(mesh)
        # Counts forget(): a copy handed out stays the one in use (written in place by write_slot) until the
        # generation changes, so a caller may keep it that long instead of asking again every call.
        self.generation = 0

    def forget(self) -> None:
        """Drop every device copy (the host stacks or the placement changed); the next call transfers anew."""
        self._copies.clear()
        self.generation += 1

    def set_sharding(self, sharding) -> None:
        self.sharding = sharding
        self.forget()  # the next call transfers annotated copies

    def sites_changed(self) -> None:
        """After ``register_adapters``: the sites may be new, so cached layouts go too."""
        self.forget()
        if self.sharding is not None:
            self.sharding.forget()

    def write_slot(self, slot: int) -> None:
        """Rewrite row ``slot`` of every device copy from the host stacks, in place.

        Each host row crosses once (a transposed copy takes the row sent for
        the plain one).  A sharded copy is dropped instead and made anew, placed,
        at its next use: its placement after an in-place write is not
        something we checked.
        """
        if self.sharding is not None:
            self.forget()
            return
        sent: Dict[Tuple[Site, str, str], torch.Tensor] = {}
        for (site, role, device), copy in self._copies.items():
            plain = role[:-2] if role.endswith("_T") else role
            row = sent.get((site, plain, device))
            if row is None:
                # copy=True: on the CPU a plain "device copy" is the host stack itself, and a row of it
                # cannot be index-copied into it.
                row = sent[(site, plain, device)] = self._host_row(site, plain, slot).to(copy.device, copy=True)
            _write_row(copy, slot, row, transposed=role.endswith("_T"))
        self._count("bytes_to_device", n=sum(t.numel() * t.element_size() for t in sent.values()))

    def _host_row(self, site: Site, role: str, slot: int) -> torch.Tensor:
        """One slot's host row of a (plain) stack; a fused group's A rows concatenated along the rank."""
        if isinstance(site, tuple):
            return torch.cat([self._stacks.host_row(n, "A", slot) for n in site], dim=0)
        return self._stacks.host_row(site, role, slot)

    def copies(self) -> Dict[Tuple[Site, str, str], torch.Tensor]:
        """The device copies made so far, by (site, role, device) (e.g. to check their placement)."""
        return dict(self._copies)

    def _annotated(self, tensor: torch.Tensor, place) -> torch.Tensor:
        if self.sharding is not None and tensor.device.type == "xla":
            place(self.sharding)
        return tensor

    def _cached(self, key, build) -> torch.Tensor:
        if key not in self._copies:
            tensor = self._copies[key] = build()
            self._count("bytes_to_device", n=tensor.numel() * tensor.element_size())
            if tensor.device.type == "xla" and self.sharding is None:
                # Compile the slot write now, with the graph's own first programs (slot 0 rewritten as it
                # is): a swap never compiles.
                site, role, _ = key
                plain = role[:-2] if role.endswith("_T") else role
                _write_row(tensor, 0, self._host_row(site, plain, 0).to(tensor.device, copy=True),
                           transposed=role.endswith("_T"))
        return self._copies[key]

    def stacked_a(self, site: Site, device, transposed: bool = False) -> torch.Tensor:
        """The site's (or fused group's) stacked A ``[N, R, in]`` on ``device`` (``[N, in, R]`` if transposed)."""
        # A and B are cached apart: a site in a fused group needs only its B on the device (its
        # A travels inside the group's concatenated A).  The transposed copies are the row
        # kernel's (made only if a graph uses them).
        def build():
            if isinstance(site, tuple):
                host = torch.cat([self._stacks.host_a(n) for n in site], dim=1)
            else:
                host = self._stacks.host_a(site)
            tensor = _to_device(host, device, transposed)
            return self._annotated(tensor, lambda s: s.place_stacks(site, tensor, None, transposed=transposed))
        return self._cached((site, "A_T" if transposed else "A", str(device)), build)

    def stacked_b(self, site: str, device, transposed: bool = False) -> torch.Tensor:
        """The site's stacked B ``[N, out, R]`` on ``device`` (``[N, R, out]`` if transposed), scalings folded in."""
        def build():
            tensor = _to_device(self._stacks.host_b(site), device, transposed)
            return self._annotated(tensor, lambda s: s.place_stacks(site, None, tensor, transposed=transposed))
        return self._cached((site, "B_T" if transposed else "B", str(device)), build)

    def stacked_bias(self, site: str, device) -> torch.Tensor:
        """The site's per-slot LoRA bias ``[N, out]`` (scaled) on ``device``."""
        def build():
            tensor = self._stacks.host_bias(site).to(device)
            return self._annotated(tensor, lambda s: s.place_bias(site, tensor))
        return self._cached((site, "bias", str(device)), build)

    def stacked_dora(self, site: str, device) -> torch.Tensor:
        """The site's per-slot DoRA rescaling ``[N, 2, out]`` (gain, shift; adapters/dora.py) on ``device``, replicated."""
        return self._cached((site, "dora", str(device)), lambda: self._stacks.host_dora(site).to(device))


def _write_row(copy: torch.Tensor, slot: int, row: torch.Tensor, transposed: bool) -> None:
    """``copy[slot] = row`` (or its transpose) in place; on XLA one small program per stack shape, started now.

    Each copy is synced on its own so the program depends on its shape alone
    (a sync of several would compile one program per set of stacks); without
    waiting, so the writes of one swap run back to back.
    """
    copy.index_copy_(0, torch.tensor([slot], device=copy.device), (row.transpose(0, 1) if transposed else row)[None])
    if copy.device.type == "xla":
        import torch_xla

        torch_xla._XLAC._xla_sync_multi([copy], devices=[], wait=False)


def _to_device(host: torch.Tensor, device, transposed: bool) -> torch.Tensor:
    return (host.transpose(1, 2).contiguous() if transposed else host).to(device)


__all__ = ["DeviceStacks", "Site"]
