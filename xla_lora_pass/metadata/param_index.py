"""Which registered site, adapter and role a graph's parameter tensor is, by tensor identity.

The rewrite looks every placeholder up here.  ``model.to(xla_device)``
replaces Parameter objects, so identities taken at registration go stale:
``refresh`` re-reads them from the live modules (once per graph).

Not locked itself: ``LoRAMetadata`` holds its lock around every call.
"""
from __future__ import annotations

from typing import Dict, Iterable, List, NamedTuple, Optional, Tuple

from ..adapters.records import SiteSpec
from ..adapters.saved_modules import SavedModuleSpec


class ParamRoles(NamedTuple):
    """What one tensor is to the registered adapters (None where it is not)."""

    lora: Optional[Tuple[str, str, str]]  # (site, adapter, role)
    bases: Tuple[str, ...]  # every site whose base-layer weight it is (several when tied); () if none
    saved: Optional[Tuple[str, Optional[str], str]]  # (saved module, adapter or None, tensor name)


class ParamIndex:
    """id(tensor) -> what it is: a LoRA weight, a site's base weight, or a saved module's tensor."""

    def __init__(self):
        self._lora: Dict[int, Tuple[str, str, str]] = {}  # -> (site, adapter, role)
        # -> every site reading it, in registration order: one tensor may be the base weight of several
        # sites (tied embeddings: embed_tokens and lm_head), and each must be found and served.
        self._base: Dict[int, Tuple[str, ...]] = {}
        self._saved: Dict[int, Tuple[str, Optional[str], str]] = {}  # -> (module, adapter or None, tensor name)

    def refresh(self, sites: Iterable[SiteSpec], saved: Iterable[SavedModuleSpec]) -> None:
        sites = list(sites)
        self._lora = {pid: (s.name, adapter, role) for s in sites for pid, (adapter, role) in s.param_roles().items()}
        bases: Dict[int, List[str]] = {}
        for s in sites:
            if (w := s.base_weight()) is not None:
                bases.setdefault(id(w), []).append(s.name)
        self._base = {key: tuple(names) for key, names in bases.items()}
        self._saved = {}
        for m in saved:
            for adapter in (None,) + m.adapters:
                for name, tensor in m.tensors(adapter).items():
                    self._saved.setdefault(id(tensor), (m.name, adapter, name))

    def weight_ref(self, tensor) -> "ParamRoles":
        """Everything ``tensor`` is, in one look-up: a LoRA parameter, a site's base weight, a saved module's."""
        key = id(tensor)
        return ParamRoles(self._lora.get(key), self._base.get(key, ()), self._saved.get(key))

    def lookup(self, tensor) -> Optional[Tuple[str, str, str]]:
        """``(site, adapter, role)`` if ``tensor`` is a registered LoRA parameter."""
        return self._lora.get(id(tensor))

    def lookup_base(self, tensor) -> Tuple[str, ...]:
        """Every site whose base-layer weight ``tensor`` is (() if none)."""
        return self._base.get(id(tensor), ())


__all__ = ["ParamIndex", "ParamRoles"]
