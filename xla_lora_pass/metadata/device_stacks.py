"""Device copies of the host stacks, each transferred once, and their SPMD placement (``shard``).

After ``register_adapters`` or ``shard`` every copy is made anew at its
next use.  An adapter swapped into one slot (metadata/pool.py) is written in
place instead (``write_slot``): only the rows its adapter uses cross to the
device (slot_rows.py: a rank-2 adapter at a site of rank 8 sends 2 rows of A
and 2 columns of B; the device pads them with zeros), once for a plain and a
transposed copy, so a swap costs the adapter's own bytes whatever the number
of slots.  The copies a graph looked up (``sending``) are written together
by one ``slot_swap.SlotSwap`` per device: one host buffer, one transfer
call, one program, compiled for every row bucket when the lookup ends (with
the graph's own first programs); ``stage`` prepares its host side on the
prefetch thread.  A copy asked for outside a lookup is written on its own
until a graph sends it: on a runtime where a write is a compiled program
(XLA: one per stack shape and row bucket), all of its writes are compiled
when it is first sent.  Either way a swap compiles nothing.  A site is one
name, or a tuple of names for sites fused on one input
(graph_rewrites/passes/fuse_shared_shrink.py): their A stacks concatenated
along the rank dim.

Not locked itself: ``LoRAMetadata`` holds its lock around every call.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Dict, List, Optional, Sequence, Set, Tuple, Union

import torch

from .. import runtimes
from .host_stacks import AdapterStacks, LoadedAdapter
from .slot_rows import SlotRow, bucket, buckets, slot_row
from .slot_swap import SlotSwap, Target
from .staged_swaps import StagedSwaps

Site = Union[str, Tuple[str, ...]]  # one site, or the sites fused on one input


class DeviceStacks:
    """Per (site, role, device): the device copy of a host stack, annotated for SPMD after ``shard``."""

    def __init__(self, stacks: AdapterStacks, count: Callable[..., None] = lambda *a, **k: None,
                 keep_staged: Tuple[Optional[int], Optional[int]] = (None, None)):
        self._stacks = stacks
        self._count = count  # Stats.count: adapter bytes sent to the device
        self._copies: Dict[Tuple[Site, str, str], torch.Tensor] = {}
        self.sharding = None  # sharding.AdapterSharding after shard(mesh)
        # Counts forget(): a copy handed out stays the one in use (written in place by write_slot) until the
        # generation changes, so a caller may keep it that long instead of asking again every call.
        self.generation = 0
        self._swaps: Dict[str, SlotSwap] = {}  # device -> the one-program write of the copies a graph sent
        self._sending = 0  # inside sending(): copies made are warmed together when it ends
        # Swaps prepared per adapter, kept under the host cache's bounds (count, bytes; at least STAGED adapters).
        self._staged = StagedSwaps(stacks, *keep_staged)
        self._batched = False  # batch_swaps(): swaps of several slots at once are compiled too

    def forget(self) -> None:
        """Drop every device copy (the host stacks or the placement changed); the next call transfers anew."""
        self._copies.clear()
        self._swaps.clear()  # what was staged for them is ignored (Staged.swap) and ages out
        self.generation += 1

    @contextlib.contextmanager
    def sending(self, device):
        """Around a graph's lookup of its stacks: every copy on ``device`` is then written by one program per
        swap (``slot_swap.py``), compiled when this ends, with the graph's own first programs; a copy made
        outside (asked for directly) is written on its own until a graph sends it, its writes compiled when
        it is made."""
        self._sending += 1
        try:
            yield
        finally:
            self._sending -= 1
            if not self._sending:
                self._swap_all(str(device))

    def _swap_all(self, device: str) -> None:
        keys = [k for k in self._copies if k[2] == device]
        swap = self._swaps.get(device)
        if self.sharding is not None or not keys or (swap is not None and len(swap.targets) == len(keys)):
            return
        plains: List[Tuple[Site, str]] = list(dict.fromkeys((site, _plain(role)) for site, role, _ in keys))
        targets = [Target(k, self._copies[k], plains.index((k[0], _plain(k[1]))), k[1].endswith("_T"))
                   for k in keys]
        swap = self._swaps[device] = SlotSwap(device, targets, plains,
                                              lambda slot: [self._host_row(site, role, slot) for site, role in plains])
        if runtimes.for_device(device).compiles_writes:
            self._count("bytes_to_device", n=swap.warm())
            if self._batched:
                self._count("bytes_to_device", n=swap.warm(batched=True))

    def batch_swaps(self) -> None:
        """An adapter pool is in use (adapters known beyond the slots): a mapping may swap several at once, so
        the programs writing several full-rank slots at once (``SlotSwap.write_many``) are compiled now and
        with every later graph's stacks, never at a swap.  Without a pool they are not compiled at all."""
        if self._batched:
            return
        self._batched = True
        for device, swap in self._swaps.items():
            if runtimes.for_device(device).compiles_writes:
                self._count("bytes_to_device", n=swap.warm(batched=True))

    def set_sharding(self, sharding) -> None:
        self.sharding = sharding
        self.forget()  # the next call transfers annotated copies

    def sites_changed(self) -> None:
        """After ``register_adapters``: the sites may be new, so cached layouts go too."""
        self.forget()
        if self.sharding is not None:
            self.sharding.forget()

    def stage(self, loaded: LoadedAdapter) -> None:
        """The host side of ``loaded``'s next swap, on every device a graph sent stacks to, done now (on the
        prefetch thread, without the metadata's lock) and kept for its later swaps (staged_swaps.py)."""
        self._staged.stage(loaded, dict(self._swaps))

    def write_slot(self, slot: int, sites: Optional[Set[str]] = None,
                   loaded: Optional[LoadedAdapter] = None) -> None:
        """``write_slots`` of one slot."""
        self.write_slots([slot], sites, [loaded])

    def write_slots(self, slots: List[int], sites: Optional[Set[str]] = None,
                    loaded: Sequence[Optional[LoadedAdapter]] = ()) -> None:
        """Rewrite row ``slot`` of every device copy for each of ``slots`` (distinct) from the host stacks, in
        place (of ``sites`` only, if given; the copies a graph sent are all written, those of other sites
        with the rows they hold, by one program for several slots: ``SlotSwap.write_many``).

        Each stack's rows in use cross once, cut to their bucket (a transposed
        copy takes the rows sent for the plain one); the device adds the zeros.
        ``loaded``: each slot's adapter just written to the host stacks (or
        None), whose swap ``stage`` may have prepared.  A sharded copy is
        dropped instead and made anew, placed, at its next use: its placement
        after an in-place write is not something we checked.
        """
        if self.sharding is not None:
            self.forget()
            return
        for a in loaded:
            if a is not None:
                self.stage(a)  # prepared now if nothing was (kept for its next swap), else marked as used
        staged = [self._staged.get(a) if a is not None else {} for a in loaded]
        staged += [{}] * (len(slots) - len(staged))
        # Stacks a graph sent: all of them at once (those of sites not named rewritten as they are).
        total = sum(swap.write_many(slots, staged=[s.get(device) for s in staged])
                    for device, swap in self._swaps.items())
        self._count("bytes_to_device", n=total + sum(self._write_unswapped(slot, sites) for slot in slots))

    def _write_unswapped(self, slot: int, sites: Optional[Set[str]]) -> int:
        """Row ``slot`` of the copies no graph sent (made outside a lookup), one write each; the bytes sent."""
        total = 0
        swapped = {t.key for swap in self._swaps.values() for t in swap.targets}
        sent: Dict[Tuple[Site, str, str], tuple] = {}
        index: Dict[str, torch.Tensor] = {}  # the slot number, sent once per device
        for (site, role, device), copy in self._copies.items():
            if sites is not None and not sites.intersection(site if isinstance(site, tuple) else (site,)):
                continue
            if (site, role, device) in swapped:
                continue
            plain = _plain(role)
            if (site, plain, device) not in sent:
                row = self._host_row(site, plain, slot)
                rows = bucket(row.used(), row.width)
                piece = row.piece(rows)
                total += 0 if piece is None else piece.numel() * piece.element_size()
                # copy=True: on the CPU a plain "device copy" is the host stack itself, and a row of it
                # cannot be index-copied into it.
                sent[(site, plain, device)] = (row, rows, None if piece is None else piece.to(copy.device, copy=True))
            row, rows, piece = sent[(site, plain, device)]
            if device not in index:
                index[device] = torch.tensor([slot], device=copy.device)
            _write_row(copy, index[device], row.full(piece, rows, copy.device), transposed=role.endswith("_T"))
        return total

    def _host_row(self, site: Site, role: str, slot: int) -> SlotRow:
        """One slot's host row of a (plain) stack, as parts along its rank dim; a fused group's A rows one
        part per site (concatenated along the rank, as the group's stack is)."""
        return slot_row(site, role, lambda name, part: self._stacks.host_row(name, part, slot))

    def copies(self) -> Dict[Tuple[Site, str, str], torch.Tensor]:
        """The device copies made so far, by (site, role, device) (e.g. to check their placement)."""
        return dict(self._copies)

    def _annotated(self, tensor: torch.Tensor, place) -> torch.Tensor:
        if self.sharding is not None and runtimes.for_device(tensor.device).spmd:
            place(self.sharding)
        return tensor

    def _cached(self, key, build) -> torch.Tensor:
        if key not in self._copies:
            tensor = self._copies[key] = build()
            self._count("bytes_to_device", n=tensor.numel() * tensor.element_size())
            if runtimes.for_device(tensor.device).compiles_writes and self.sharding is None and not self._sending:
                self._warm_writes(key, tensor)
        return self._copies[key]

    def _warm_writes(self, key, tensor: torch.Tensor) -> None:
        """Compile every write a swap may run on this stack now, with the graph's own first programs, so a
        swap never compiles: slot 0 is written once per row bucket, its own bucket last (it ends as it was)."""
        site, role, _ = key
        plain = _plain(role)
        row = self._host_row(site, plain, 0)
        own = bucket(row.used(), row.width)
        index = torch.tensor([0], device=tensor.device)
        for rows in [b for b in buckets(row.width) if b != own] + [own]:
            piece = row.piece(rows)
            if piece is not None:
                self._count("bytes_to_device", n=piece.numel() * piece.element_size())
                piece = piece.to(tensor.device)
            _write_row(tensor, index, row.full(piece, rows, tensor.device), transposed=role.endswith("_T"))

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


def _write_row(copy: torch.Tensor, index: torch.Tensor, row: torch.Tensor, transposed: bool) -> None:
    """``copy[index] = row`` (or its transpose) in place, started now (on XLA one small program per stack
    shape and row bucket: runtimes/xla.py)."""
    copy.index_copy_(0, index, (row.transpose(0, 1) if transposed else row)[None])
    runtimes.for_device(copy.device).after_write(copy)


def _plain(role: str) -> str:
    """The role of the plain stack a copy is made from ("A_T" -> "A")."""
    return role[:-2] if role.endswith("_T") else role


def _to_device(host: torch.Tensor, device, transposed: bool) -> torch.Tensor:
    return (host.transpose(1, 2).contiguous() if transposed else host).to(device)


__all__ = ["DeviceStacks", "Site"]
