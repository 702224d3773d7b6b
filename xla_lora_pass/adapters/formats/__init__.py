"""Adapter-format readers: one registry, one small reader per LoRA library.

A reader recognises its library's LoRA layers and turns each into a
:class:`~xla_lora_pass.adapters.SiteSpec`; it also says which parameter of
the live module is which adapter's A, B (and DoRA magnitude), which
state-dict keys name them, and which adapters the layer computes when it
runs eagerly.  ``register_adapters`` and ``load_adapter`` only go through
this registry, so a new format is one ``register_format`` call.

Readers are tried in registry order and the first that claims a module
wins; a claimed module's children are not searched again (torchtune's
``lora_a`` is a plain ``nn.Linear`` of its ``LoRALinear``).
"""
from __future__ import annotations

from typing import Iterable, Iterator, List, Optional, Tuple

import torch

from ..records import SiteSpec
from ...errors import UnsupportedAdapterError
from .base import AdapterFormat
from .handwritten import HandwrittenFormat
from .loralib import LoralibFormat
from .peft import PeftFormat
from .torchtune import TorchtuneFormat

DEFAULT_ADAPTER = "default"  # the name of the one adapter a torchtune, loralib or hand-written layer holds

FORMATS: List[AdapterFormat] = [PeftFormat(), TorchtuneFormat(), LoralibFormat(), HandwrittenFormat()]


def register_format(reader: AdapterFormat, *, first: bool = True) -> None:
    """Add a reader; ``first`` puts it before the built-in ones (it then wins over them)."""
    FORMATS.insert(0 if first else len(FORMATS), reader)


def format_of(module: torch.nn.Module) -> Optional[AdapterFormat]:
    """The first reader that claims ``module`` as a LoRA layer, or None."""
    return next((f for f in FORMATS if f.claims(module)), None)


def iter_lora_sites(model: torch.nn.Module, adapter_name: str = DEFAULT_ADAPTER) -> Iterator[SiteSpec]:
    """A :class:`SiteSpec` per LoRA layer of ``model`` holding at least one adapter, in module order.

    ``adapter_name`` names the adapter of formats that hold one per layer.
    Raises :class:`UnsupportedAdapterError` for a LoRA layer that cannot be
    served exactly (a loralib layer merged into its weight, ...).
    """
    claimed: Tuple[str, ...] = ()
    for name, module in model.named_modules():
        if claimed and any(name.startswith(c + ".") for c in claimed):
            continue
        reader = format_of(module)
        if reader is None:
            continue
        site = reader.read(name, module, adapter_name)
        if site is None:
            continue
        claimed += (name,)
        site.format = reader
        yield site


def refuse_merged(sites: Iterable[SiteSpec], caller: str) -> None:
    """Raise ``UnsupportedAdapterError`` naming every site whose layer merged an adapter into its base weight:
    every row, the base model's too, would get it, and the stacks would add it once more on its rows."""
    merged = {site.name: found for site in sites if site.format is not None and site.module is not None
              for found in [site.format.merged_adapters(site)] if found}
    if merged:
        raise UnsupportedAdapterError(
            f"{caller}: adapters are merged into the base weights of {len(merged)} layers ("
            + "; ".join(f"{name}: {adapters}" for name, adapters in sorted(merged.items())[:4])
            + (", ..." if len(merged) > 4 else "") + "), so every row would get them. Unmerge them first "
            "(PEFT: model.unmerge_adapter(); loralib: build the layers with merge_weights=False, since eval() "
            "merges them)")


def adapter_names(model: torch.nn.Module, sites: List[SiteSpec]) -> list:
    """Adapter names in the order the model knows them (PEFT's ``peft_config`` order), then the rest."""
    config = getattr(model, "peft_config", None)
    names: list = list(config.keys()) if config else []
    for site in sites:
        names.extend(a for a in site.adapters if a not in names)
    return names


__all__ = ["AdapterFormat", "DEFAULT_ADAPTER", "FORMATS", "UnsupportedAdapterError", "adapter_names", "format_of",
           "iter_lora_sites", "refuse_merged", "register_format"]
