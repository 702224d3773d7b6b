"""PEFT adapters of a type the package does not serve: found, refused at ``register_adapters``, or excluded.

The package serves PEFT LoRA (and DoRA) adapters.  A PEFT model may hold
adapters of other types (LoHa, LoKr, AdaLoRA, IA3, VeRA, OFT, ...; a
``PeftMixedModel`` mixes them with LoRA ones), and LoRA on parameters
(``target_parameters``: PEFT's ``ParamWrapper``, a delta added to a weight).  Nothing rewrites their
layers, so a slot for one would give its rows the base model's output, and
an active one adds its delta to every row.  An adapter is of another type
when its ``peft_config`` entry's ``peft_type`` is not LORA, or when a PEFT
tuner layer other than a plain LoRA layer holds it: the layers find the
types PEFT adds later, and models built by ``inject_adapter_in_model``,
which have no ``peft_config``.

Such an adapter is refused unless the caller excludes it by name
(``register_adapters(model, exclude=[...])``).  An excluded adapter gets no
slot, and it must never reach a row: one that is active or merged into the
base weights is refused at registration.  One made active later is found in
the traced graph by its tensors (``Exclusions.lookup``), and the rewrite
marks its layer as left alone, so the uniform-mapping guard refuses every
mapping on that graph.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, FrozenSet, Iterable, List, Optional, Sequence, Tuple

import torch

from ..errors import UnsupportedAdapterError
from .formats.peft import is_plain_lora, on_a_parameter
from .saved_modules import SavedModuleSpec

LORA = "LORA"


@dataclasses.dataclass
class Unserved:
    """One adapter of a type the package does not serve, and the tuner layers that hold it, by path."""

    name: str
    kind: str  # PEFT's peft_type ("LOHA"), or the tuner package of the layer holding it
    layers: Dict[str, torch.nn.Module] = dataclasses.field(default_factory=dict, repr=False)

    def describe(self) -> str:
        paths = list(self.layers)
        shown = ", ".join(paths[:3]) + (f" and {len(paths) - 3} more" if len(paths) > 3 else "")
        return f"adapter {self.name!r} is of type {self.kind} (layers {shown or 'none'})"


def _tuner_layer_type():
    try:
        from peft.tuners.tuners_utils import BaseTunerLayer
    except ImportError:  # peft is optional
        return None
    return BaseTunerLayer


def _kind_of_layer(module) -> str:
    if on_a_parameter(module):
        return (f"LoRA on a parameter ({type(module).__name__} over {module.parameter_name!r}: PEFT's "
                "target_parameters, which adds a delta to the weight, not to the activations; build the adapter "
                "with target_modules that leave it out)")
    parts = type(module).__module__.split(".")
    # peft.tuners.<tuner>.layer: the tuner's package names its type (peft.tuners.loha -> LOHA)
    return parts[2].upper() if parts[:2] == ["peft", "tuners"] and len(parts) > 2 else type(module).__name__


def _held(layer) -> List[str]:
    """The adapters a tuner layer holds: the keys of its per-adapter parts (``adapter_layer_names``)."""
    names: List[str] = []
    for part in getattr(layer, "adapter_layer_names", ()):
        for adapter in getattr(getattr(layer, part, None), "keys", lambda: ())():
            if adapter not in names:
                names.append(adapter)
    return names


def find_unserved(model: torch.nn.Module) -> Dict[str, Unserved]:
    """Every adapter of ``model`` whose type the package does not serve, by name."""
    found: Dict[str, Unserved] = {}
    for name, cfg in (getattr(model, "peft_config", None) or {}).items():
        kind = getattr(getattr(cfg, "peft_type", None), "value", getattr(cfg, "peft_type", None))
        if kind is not None and str(kind) != LORA:
            found[name] = Unserved(name, str(kind))
    tuner = _tuner_layer_type()
    if tuner is None:
        return found
    for path, module in model.named_modules():
        if isinstance(module, tuner) and not is_plain_lora(module):
            for adapter in _held(module):
                found.setdefault(adapter, Unserved(adapter, _kind_of_layer(module))).layers[path] = module
    return found


def _active_in(entry: Unserved, model) -> List[str]:
    """Where an excluded adapter would compute: its active layers (the model itself for a type without layers)."""
    if not entry.layers:
        try:
            active = list(getattr(model, "active_adapters", None) or ())
        except Exception:  # a model without one active adapter list (PEFT raises for some set-ups)
            active = []
        return ["the model"] if entry.name in active else []
    return [path for path, layer in entry.layers.items()
            if not getattr(layer, "disable_adapters", False) and entry.name in getattr(layer, "active_adapters", ())]


def _names(exclude) -> List[str]:
    if isinstance(exclude, (str, bytes)):
        raise TypeError(f"register_adapters: exclude must be a list of adapter names, got the str {exclude!r}; "
                        f"write exclude=[{exclude!r}]")
    try:
        names = list(exclude)
    except TypeError:
        raise TypeError(f"register_adapters: exclude must be a list of adapter names, got {exclude!r:.80}") from None
    bad = [n for n in names if not isinstance(n, str)]
    if bad:
        raise TypeError(f"register_adapters: exclude holds {bad[0]!r:.80}, not an adapter name (a str)")
    return names


def refuse_unserved(model: torch.nn.Module, exclude: Iterable[str], served: Sequence[str],
                    saved: Sequence[SavedModuleSpec]) -> "Exclusions":
    """Refuse every adapter of a type the package does not serve that ``exclude`` does not name, and every
    excluded one that would reach a row; return the exclusions.  Reads the model only.

    ``served``: the model's adapter names as register_adapters lists them (``peft_config`` keys, then the
    LoRA layers' adapters): a name there and not of another type is a LoRA adapter.
    """
    unserved = find_unserved(model)
    names = _names(exclude)
    for name in names:
        if name in unserved:
            continue
        if name in served:
            raise ValueError(
                f"register_adapters: exclude: {name!r} is a LoRA adapter, which register_adapters serves; exclude "
                f"takes only adapters of a type it does not serve ({sorted(unserved) or 'this model has none'}). "
                f"To leave a LoRA adapter out, delete it from the model (model.delete_adapter({name!r}))")
        raise ValueError(f"register_adapters: exclude: {name!r} is not an adapter of this model (its adapters: "
                         f"{list(dict.fromkeys([*served, *unserved]))})")
    refused = [u for n, u in unserved.items() if n not in names]
    if refused:
        them = "it" if len(refused) == 1 else "them"
        what = (f"Pass register_adapters(model, exclude={[u.name for u in refused]}) to serve the other adapters "
                f"without {them} ({them} must then stay inactive), or delete {them} from the model "
                "(model.delete_adapter(name))") if any(n not in unserved for n in served) else (
                "The model holds no LoRA adapter to serve: run it without this backend")
        raise UnsupportedAdapterError(
            "register_adapters: " + "; ".join(u.describe() for u in refused) + ", which this package does not "
            f"serve: it serves PEFT LoRA adapters (DoRA too). {what}")
    for name in names:
        entry = unserved[name]
        merged = [p for p, layer in entry.layers.items() if name in (getattr(layer, "merged_adapters", None) or ())]
        if merged:
            raise UnsupportedAdapterError(
                f"register_adapters: adapter {name!r} ({entry.kind}) is excluded but merged into the base weights "
                f"of layers {merged}: every row would get it. Unmerge it (model.unmerge_adapter()) first")
        active = _active_in(entry, model)
        if active:
            raise UnsupportedAdapterError(
                f"register_adapters: adapter {name!r} ({entry.kind}) is excluded but active in layers {active}: "
                "they would add it to every row. Make only LoRA adapters active (model.set_adapter([...])) "
                "before register_adapters")
    return Exclusions({n: unserved[n] for n in names}, saved)


class Exclusions:
    """The adapters excluded at ``register_adapters``: their names, and their tensors by identity.

    ``lookup`` tells the rewrite that a graph input is an excluded adapter's
    tensor: the adapter was made active after registration and its layer
    computes it for every token.  ``refresh`` re-reads identities from the
    live modules (``model.to(device)`` replaces Parameter objects).
    """

    def __init__(self, excluded: Optional[Dict[str, Unserved]] = None, saved: Sequence[SavedModuleSpec] = ()):
        self.excluded: Dict[str, Unserved] = dict(excluded or {})
        self._saved = [(m.name, m.wrapper) for m in saved if set(m.adapters) & set(self.excluded)]
        self._tensors: Dict[int, Tuple[str, str]] = {}
        self.refresh()

    @property
    def names(self) -> FrozenSet[str]:
        return frozenset(self.excluded)

    def without_excluded(self, saved: Sequence[SavedModuleSpec]) -> List[SavedModuleSpec]:
        """Saved modules with the excluded adapters' copies left out: no slot serves them."""
        return [dataclasses.replace(m, adapters=tuple(a for a in m.adapters if a not in self.excluded))
                for m in saved]

    def refresh(self) -> None:
        found: Dict[int, Tuple[str, str]] = {}
        for name, entry in self.excluded.items():
            for path, layer in entry.layers.items():
                for part in (*getattr(layer, "adapter_layer_names", ()), *getattr(layer, "other_param_names", ())):
                    for tensor in _tensors(_part(layer, part, name)):
                        found.setdefault(id(tensor), (path, name))
        for path, wrapper in self._saved:
            for name in set(self.excluded) & set(wrapper.modules_to_save.keys()):
                for tensor in _tensors(wrapper.modules_to_save[name]):
                    found.setdefault(id(tensor), (path, name))
        self._tensors = found

    def lookup(self, tensor) -> Optional[Tuple[str, str, str]]:
        """``(layer path, adapter, reason)`` if ``tensor`` is an excluded adapter's, else None."""
        hit = self._tensors.get(id(tensor))
        if hit is None:
            return None
        path, name = hit
        kind = self.excluded[name].kind
        return path, name, (f"adapter {name!r} ({kind}), excluded at register_adapters, is active here: this layer "
                            f"adds it to every token, and the package does not serve {kind}. Make only LoRA "
                            "adapters active (model.set_adapter([...])) and run again")

    def refuse_name(self, name, what: str) -> None:
        """A LoRA adapter loaded under an excluded adapter's name would be mistaken for it: refuse."""
        if isinstance(name, str) and name in self.excluded:
            raise ValueError(f"{what}: {name!r} names an adapter excluded at register_adapters "
                             f"({self.excluded[name].kind}); load it under another name")


def _part(layer, part: str, name: str):
    """One adapter's entry in a per-adapter part of a tuner layer (a ModuleDict, ParameterDict, ...), or None."""
    parts = getattr(layer, part, None)
    return parts[name] if hasattr(parts, "keys") and name in parts.keys() else None


def _tensors(value) -> List[torch.Tensor]:
    """The tensors of one adapter part: a tensor, or a module's parameters and buffers."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, torch.nn.Module):
        return [*value.parameters(), *value.buffers()]
    return []


__all__ = ["Exclusions", "Unserved", "find_unserved", "refuse_unserved"]
