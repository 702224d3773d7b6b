"""Where each watched LoRA tensor hangs in its layer, so that a call sees it replaced without walking modules.

A tensor's marks (version counter, storage) tell a write into it; they cannot
tell that the layer now holds another object: ``lora_B.weight =
nn.Parameter(...)``, ``load_state_dict(..., assign=True)``, a LoRA module of
one adapter replaced in its ``ModuleDict``, or (PEFT) a new float in
``scaling`` of an adapter the traced forward does not read, so Dynamo does
not guard it.  Reading the layers again finds those (``WeightWatch.rebind``),
but walks every module: 15 ms for 22 layers with 16 adapters, too much for
every call.  A link is one step of the path from the layer to the tensor
(``module._modules[key]``, ``module._parameters[key]``), or the scaling's
entry, with what it held; a call checks the links of the adapters it maps,
dictionary lookups only, and a broken one sends the watch to read the layers
again.
"""
from __future__ import annotations

from typing import Dict, Iterable, List, NamedTuple

import torch


class Link(NamedTuple):
    container: dict
    key: object
    held: object
    by_value: bool  # a number compared by value (a scaling), not an object by identity


class LinkSet:
    """Links checked together, each (container, key) once; ``broken`` maps ``dict.get`` over them, so a check
    costs tens of nanoseconds a link."""

    def __init__(self, links: Iterable[Link]):
        unique: Dict[tuple, Link] = {}
        for link in links:
            unique.setdefault((id(link.container), link.key, link.by_value), link)
        objects = [link for link in unique.values() if not link.by_value]
        values = [link for link in unique.values() if link.by_value]
        self._containers, self._keys = [l.container for l in objects], [l.key for l in objects]
        self._held = [l.held for l in objects]  # kept alive, so that no new object can take one's id
        self._ids = [id(h) for h in self._held]
        self._value_containers, self._value_keys = [l.container for l in values], [l.key for l in values]
        self._values = [l.held for l in values]

    def broken(self) -> bool:
        if list(map(id, map(dict.get, self._containers, self._keys))) != self._ids:
            return True
        try:
            return list(map(dict.get, self._value_containers, self._value_keys)) != self._values
        except (RuntimeError, TypeError, ValueError):  # a number replaced by a tensor of several
            return True


def tensor_links(module: torch.nn.Module, tensors: Iterable[torch.Tensor]) -> Dict[int, List[Link]]:
    """``{id(tensor): links}`` from ``module`` down to each of ``tensors`` it holds as a parameter or buffer
    (one not found there has none: it is checked by its marks alone)."""
    wanted = {id(t) for t in tensors}
    found: Dict[int, List[Link]] = {}

    def walk(mod: torch.nn.Module, path: List[Link]) -> None:
        for holder in (mod._parameters, mod._buffers):
            for key, value in holder.items():
                if value is not None and id(value) in wanted and id(value) not in found:
                    found[id(value)] = path + [Link(holder, key, value, False)]
        for key, child in mod._modules.items():
            if child is not None:
                walk(child, path + [Link(mod._modules, key, child, False)])

    walk(module, [])
    return found


__all__ = ["Link", "LinkSet", "tensor_links"]
