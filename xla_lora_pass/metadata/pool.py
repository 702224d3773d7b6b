"""Many adapters on a few slots: which adapter goes into which slot, and where its weights come from.

The device holds ``num_slots`` adapters at a time (the stacks every compiled
graph reads); an ``AdapterSource`` knows any number more by name, on the host
or on disk (a PEFT ``save_pretrained`` directory, read as data only).  When a
mapping names an adapter that is not in a slot, ``plan_slots`` picks the slot:
a free one, else the least recently used adapter that may leave its slot
(S-LoRA's and LoRAX's policy).  Which adapters may not is decided in one place,
``AdapterPool.held``, asked by every move (a mapping, ``load_adapter``,
``pin``, ``unload_adapter``): pinned ones, those holding PEFT modules_to_save
copies, and those the current mapping uses, since its slot numbers are already
in the step's values (except for the move that sets a new mapping, which
replaces them).  A move that finds no room is refused before anything changes.

A swap writes one slot of the host stacks and of each device copy in place;
the swaps one mapping needs go together (``DeviceStacks.write_slots``: the
stacks a graph reads, for all of them, in one transfer and one program,
slot_swap.py): its cost is the adapter's own rows, whatever the
number of slots, and it never recompiles a graph (stacks are graph inputs).
``AdapterSource.prefetch`` reads the next mapping's directories on a
background thread (not those of adapters already in a slot) and stages each
one's swap there (``DeviceStacks.stage``).
"""
from __future__ import annotations

import dataclasses
import os
from typing import Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Set, Tuple, Union

import torch

from ..errors import UnsupportedMappingError
from .device_stacks import DeviceStacks
from .host_stacks import AdapterStacks, LoadedAdapter
from .source import AdapterSource
from .stats import Stats
from .token_mapping import NO_LORA, to_indices


class SlotCapacityError(UnsupportedMappingError):
    """A mapping needs more adapters on the device at once than there are slots to hold them."""


# Why an adapter may not leave its slot (AdapterPool.held), as the refusals name it.
PINNED, SAVED, MAPPED = "pinned", "holds PEFT modules_to_save copies", "used by the current mapping"


@dataclasses.dataclass(frozen=True)
class SlotPlan:
    """What to load where for one mapping: (adapter, slot) pairs, and the adapters they replace."""

    loads: Tuple[Tuple[str, int], ...]
    evictions: Tuple[str, ...]
    hits: int  # adapters the mapping names that were already in a slot


def plan_slots(slots: Sequence[Optional[str]], wanted: Iterable[str], *,
               pinned: Union[Iterable[str], Mapping[str, str]] = (), last_used: Mapping[str, int] = {},
               caller: str = "set the mapping") -> SlotPlan:
    """Slots for the adapters ``wanted`` (in first-use order): resident ones stay, the others take a free
    slot, else the least recently used slot whose adapter is neither wanted nor in ``pinned``.

    ``pinned``: the adapters that may not leave their slot, or a mapping of them to why (named in the
    error).  Raises ``SlotCapacityError`` (nothing changes) when ``wanted`` holds more adapters than the
    slots that are free, resident for it, or evictable.
    """
    wanted = list(dict.fromkeys(wanted))
    reasons = dict(pinned) if isinstance(pinned, Mapping) else dict.fromkeys(pinned, PINNED)
    resident = {name: slot for slot, name in enumerate(slots) if name is not None}
    missing = [name for name in wanted if name not in resident]
    keep = set(wanted) | set(reasons)
    free = [slot for slot, name in enumerate(slots) if name is None]
    evictable = sorted((slot for slot, name in enumerate(slots) if name is not None and name not in keep),
                       key=lambda slot: last_used.get(slots[slot], -1))
    if len(missing) > len(free) + len(evictable):
        raise SlotCapacityError(_no_room(caller, slots, wanted, reasons))
    loads, evictions = [], []
    for name in missing:
        if free:
            slot = free.pop(0)
        else:
            slot = evictable.pop(0)
            evictions.append(slots[slot])
        loads.append((name, slot))
    return SlotPlan(tuple(loads), tuple(evictions), hits=len(wanted) - len(missing))


def _no_room(caller: str, slots, wanted: List[str], reasons: Mapping[str, str]) -> str:
    """The refusal: how many slots the move needs, which adapters keep theirs and why, and what would help."""
    held = sorted(set(reasons) & ({n for n in slots if n is not None} - set(wanted)))
    by_reason: Dict[str, List[str]] = {}
    for name in held:
        by_reason.setdefault(reasons[name], []).append(name)
    why = "; ".join(reason if len(by_reason) == 1 else f"{', '.join(names)}: {reason}"
                    for reason, names in by_reason.items())
    room = len(slots) - len(held)
    advice = [f"split the batch into batches of at most {room} adapters"] if len(wanted) > 1 and room else []
    advice += ["unpin some"] if PINNED in by_reason else []
    advice += ["set a mapping without them first"] if MAPPED in by_reason else []
    advice += ["create the LoRAMetadata with a larger max_slots"]
    advice = ", ".join(advice[:-1]) + (", or " if len(advice) > 1 else "") + advice[-1]
    return (f"{caller}: needs {len(wanted)} adapters {wanted} in slots at once, but there are {len(slots)} slots"
            + (f", {len(held)} of them kept by {held} ({why})" if held else "")
            + f": it needs {len(wanted) + len(held)} slots. {advice[0].upper()}{advice[1:]}")


class AdapterPool:
    """Slots as a cache over an ``AdapterSource``: loads, LRU evictions, pins; the device written per slot.

    ``mapped()`` returns the adapters the current mapping uses (``LoRAMetadata``
    knows the mapping).  Not locked itself: ``LoRAMetadata`` holds its lock
    around every call.
    """

    def __init__(self, stacks: AdapterStacks, devices: DeviceStacks, stats: Stats,
                 mapped: Callable[[], Iterable[str]] = tuple, host_cache: Optional[int] = None,
                 host_cache_bytes: Optional[int] = None):
        self._stacks, self._devices, self._stats, self._mapped = stacks, devices, stats, mapped
        self.source = AdapterSource(
            lambda name, path, scaling, config, where: stacks.validate(name, path, scaling=scaling, config=config,
                                                                       where=where),
            host_cache, on_prefetched=devices.stage, host_cache_bytes=host_cache_bytes)
        self.pinned: Set[str] = set()
        self._last_used: Dict[str, int] = {}
        self._clock = 0
        self._last_wanted: List[str] = []  # the adapters the mapping set last names (slots_for)

    def add(self, name: str, state, *, scaling: Optional[float] = None, config=None) -> None:
        """Know adapter ``name`` without loading it: a mapping that names it loads it into a slot.

        ``state`` as for ``load_adapter``: a directory is read when a slot
        needs it (or on ``prefetch``), a state dict is checked now and kept as
        a host copy.  A name already in a slot is written into it now.
        """
        if not isinstance(name, str) or not name:
            raise TypeError(f"add_adapter: the adapter name must be a non-empty str, got {name!r:.80}")
        if name in self._stacks.slots:
            # A new definition of an adapter in a slot: written now (read and checked first), or the slot
            # would serve the old rows until an eviction.
            loaded = self._stacks.validate(name, state, scaling=scaling, config=config)
            self.remember(name, state, loaded, scaling=scaling, config=config)
            self._write(loaded, self._stacks.slots.index(name))
        elif isinstance(state, (str, os.PathLike)):
            self.source.add_dir(name, state, scaling=scaling, config=config)
            self._devices.batch_swaps()
        else:
            self.source.keep(self._stacks.validate(name, state, scaling=scaling, config=config))
            self._devices.batch_swaps()

    def remember(self, name: str, state, loaded: LoadedAdapter, *, scaling: Optional[float] = None,
                 config=None) -> None:
        """After ``load_adapter``: its directory, or else the validated host copy, stays known by name."""
        if isinstance(state, (str, os.PathLike)):
            self.source.add_dir(name, state, scaling=scaling, config=config)
        else:
            self.source.keep(loaded)

    def prefetch(self, names: Iterable[str], wait: bool = False) -> None:
        """Read the directories of ``names`` on a background thread, before a mapping needs them, and stage
        each one's swap there, also for those read before (``wait``: until done).  Adapters already in a slot
        are skipped: a mapping reads nothing for them.  A read that fails raises at the mapping that needs
        the adapter."""
        self.source.prefetch([n for n in names if n not in self._stacks.slots], wait)

    def sites_changed(self) -> None:
        """After ``register_adapters``: host copies checked against the old sites go, directories stay."""
        self.source.forget_copies()
        self.pinned.clear()
        self._last_used.clear()

    def held(self, *, new_mapping: bool = False) -> Dict[str, str]:
        """The one rule every move follows: the adapters that may not leave their slot now, each with why.

        Pinned ones; those with PEFT modules_to_save copies (a compiled graph
        picks a saved module's copy by slot number); those the current mapping
        uses (its slot numbers are in the step's values already), unless the
        move is for ``new_mapping``, which replaces the current one.
        """
        why = {} if new_mapping else dict.fromkeys(self._mapped(), MAPPED)
        why.update(dict.fromkeys((a for m in self._stacks.saved.values() for a in m.adapters), SAVED))
        why.update(dict.fromkeys(self.pinned, PINNED))
        return why

    def pin(self, name: str) -> None:
        """Keep ``name`` in its slot until ``unpin`` (loading it now if it is not in one, into a slot no held
        adapter needs; ``SlotCapacityError`` without one, nothing changed)."""
        if name not in self._stacks.slots and name not in self.source:
            raise KeyError(f"pin({name!r}): unknown adapter; slots: {self._stacks.slots}, or add it with add_adapter")
        self.ensure([name], f"pin({name!r})")
        self.pinned.add(name)

    def unpin(self, name: str) -> None:
        self.pinned.discard(name)

    def touch(self, names: Iterable[str]) -> None:
        """``names`` were just used by a mapping: the least recently used go first."""
        self._clock += 1
        for name in names:
            self._last_used[name] = self._clock

    def ensure(self, wanted: Sequence[str], caller: str, *, new_mapping: bool = False) -> None:
        """Every adapter of ``wanted`` the source knows in a slot, loading and evicting what ``held`` allows.

        Names neither resident nor known are left for the mapping's own check
        to refuse.  All reads and checks happen before the first slot changes.
        """
        slots = self._stacks.slots
        known = [n for n in dict.fromkeys(wanted) if n in slots or n in self.source]
        plan = plan_slots(slots, known, pinned=self.held(new_mapping=new_mapping), last_used=self._last_used,
                          caller=caller)
        loaded = [(self.source.get(name, f"{caller}: adapter {name!r}"), slot) for name, slot in plan.loads]
        self._write_all(loaded)
        self._stats.count("slot_hits", n=plan.hits)
        self.touch(known)

    def slots_for(self, mapping, caller: str, unit: str) -> torch.Tensor:
        """The mapping's host int32 slot numbers, converted once: names the source can load count as known,
        and what no slot holds is loaded first (``ensure``), each named adapter kept in its slot."""
        slots = list(self._stacks.slots)
        strings = mapping if isinstance(mapping, Sequence) and not isinstance(mapping, (str, bytes)) else ()
        loadable = list(dict.fromkeys(e for e in strings if isinstance(e, str) and e not in slots
                                      and e in self.source))
        named = slots + loadable
        indices = to_indices(mapping, slots, caller, unit, loadable)
        self._last_wanted = [named[i] for i in sorted(set(indices.tolist()) - {NO_LORA})]
        self.ensure(self._last_wanted, caller, new_mapping=True)
        now = self._stacks.slots
        if now == slots:
            return indices
        # The pool loaded some: each name's slot number now (NO_LORA, -1, reads the appended -1).
        renumber = torch.tensor([now.index(n) if n in now else NO_LORA for n in named] + [NO_LORA], dtype=torch.int32)
        return renumber[indices.long()]

    def reuse_last(self) -> None:
        """The mapping set last is set again: its adapters count as used again (slot hits, recency for the
        eviction order), as ``ensure`` would count them; nothing is converted, loaded or moved."""
        self._stats.count("slot_hits", n=len(self._last_wanted))
        self.touch(self._last_wanted)

    def load(self, loaded: LoadedAdapter) -> int:
        """Write a validated adapter into its own slot, a free one, or the least recently used one ``held``
        allows; return the slot."""
        slot = self._stacks.free_slot(loaded.name)
        if slot is None:
            plan = plan_slots(self._stacks.slots, [loaded.name], pinned=self.held(), last_used=self._last_used,
                              caller=f"load_adapter({loaded.name!r})")
            slot = plan.loads[0][1]
        self._write(loaded, slot)
        self.touch([loaded.name])
        return slot

    def unload(self, name: str) -> int:
        """Free ``name``'s slot (it stays known by name, to come back on demand); return the slot."""
        if name not in self._stacks.slots:
            raise KeyError(f"unload_adapter({name!r}): not in a slot; slots: {self._stacks.slots}")
        why = self.held().get(name)
        if why is not None:
            raise ValueError(f"unload_adapter({name!r}): " + {
                PINNED: "it is pinned; unpin it first",
                SAVED: "it has PEFT modules_to_save copies, which compiled graphs pick by slot number, so it stays "
                       "in its slot",
                MAPPED: "the current mapping uses it; set a mapping without it first"}[why])
        slot = self._stacks.slots.index(name)
        self._keep_if_unknown(slot)
        self._stacks.clear(slot)
        self._devices.write_slot(slot)
        return slot
    def _write(self, loaded: LoadedAdapter, slot: int) -> None:
        self._write_all([(loaded, slot)])

    def _write_all(self, loads: Sequence[Tuple[LoadedAdapter, int]]) -> None:
        """Each adapter into its slot (distinct): the host stacks one by one, the device in one swap."""
        for loaded, slot in loads:
            previous = self._stacks.slots[slot]
            if previous is not None and previous != loaded.name:
                self._keep_if_unknown(slot)
                self._stats.count("evictions")
            self._stacks.write(loaded, slot)
            self._stats.count("loads")
        if loads:
            self._devices.write_slots([slot for _, slot in loads], loaded=[loaded for loaded, _ in loads])

    def _keep_if_unknown(self, slot: int) -> None:
        """An adapter leaving its slot that the source cannot give back (one registered from the model)
        is kept as a host copy of its rows, so it can come back exactly."""
        name = self._stacks.slots[slot]
        if name not in self.source:
            self.source.keep(self._stacks.snapshot(slot))
            self._devices.batch_swaps()  # it may come back with others in one mapping
