"""Find the LoRA layers of a model and read each adapter's weights.

PEFT keeps one module per LoRA site (``peft.tuners.lora.LoraLayer``) with a
``lora_A`` / ``lora_B`` pair per adapter name (``lora_embedding_A`` /
``lora_embedding_B`` for embeddings) and a float ``scaling`` per adapter that
already folds in rsLoRA.  This module turns that into plain records, so the
rest of the package never touches PEFT types.
"""
from __future__ import annotations

import dataclasses
import logging
import re
from typing import Dict, Iterator, Optional, Tuple

import torch

log = logging.getLogger(__name__)


@dataclasses.dataclass
class AdapterWeights:
    """One adapter at one site, in vLLM layout: A ``[r, in]``, B ``[out, r]``."""

    lora_a: torch.Tensor
    lora_b: torch.Tensor
    scaling: float
    bias: Optional[torch.Tensor] = None  # PEFT lora_bias=True: B's bias, [out]

    @property
    def rank(self) -> int:
        return self.lora_a.shape[0]


@dataclasses.dataclass
class SiteSpec:
    """A LoRA layer of the model: its module path, kind and every adapter on it."""

    name: str
    kind: str  # "linear" or "embedding"
    in_features: int
    out_features: int
    adapters: Dict[str, AdapterWeights]
    # Why this site can never be rewritten (DoRA, ...); None if it can.
    unsupported: Optional[str] = None
    module: Optional[torch.nn.Module] = dataclasses.field(default=None, repr=False)
    # Dotted attribute path, from ``module``, of the base layer's weight: how the pass finds the
    # site in a graph whatever adapter is active ("base_layer.weight" for PEFT, "weight" for a
    # module that is its own base layer).  None: the site can only be found through its LoRA branch.
    base_weight_attr: Optional[str] = "base_layer.weight"

    def base_weight(self) -> Optional[torch.Tensor]:
        """The base layer's weight, read from the live module (None if unknown).

        Read anew each time, as ``param_roles``: ``model.to(device)`` replaces it.
        """
        if self.module is None or self.base_weight_attr is None:
            return None
        obj = self.module
        for part in self.base_weight_attr.split("."):
            obj = getattr(obj, part, None)
        return obj if isinstance(obj, torch.Tensor) else None

    def param_roles(self) -> Dict[int, Tuple[str, str]]:
        """id(parameter) -> (adapter, role), read from the live module.

        Read anew each time: ``model.to(xla_device)`` replaces Parameter
        objects, so identities taken at registration would go stale.
        """
        if self.module is None:
            return {}
        return dict(_roles(self.module, self.kind))


def _roles(module, kind: str) -> Iterator[Tuple[int, Tuple[str, str]]]:
    if kind == "embedding":
        for adapter, emb_a in module.lora_embedding_A.items():
            yield id(emb_a), (adapter, "A")
            yield id(module.lora_embedding_B[adapter]), (adapter, "B")
        return
    for adapter, lin_a in module.lora_A.items():
        lin_b = module.lora_B[adapter]
        yield id(lin_a.weight), (adapter, "A")
        yield id(lin_b.weight), (adapter, "B")
        if getattr(lin_b, "bias", None) is not None:
            yield id(lin_b.bias), (adapter, "bias")


def _peft_lora_layer_type():
    try:
        from peft.tuners.lora import LoraLayer
    except ImportError:  # peft is optional: hand-written modules need no PEFT
        return None
    return LoraLayer


def _unsupported_reason(module, adapter: str) -> Optional[str]:
    use_dora = getattr(module, "use_dora", {}) or {}
    if use_dora.get(adapter, False):
        return "DoRA: the output is rescaled by a per-column weight norm of W + BA"
    variants = getattr(module, "lora_variant", {}) or {}
    if adapter in variants:
        return f"LoRA variant {type(variants[adapter]).__name__} changes the forward"
    return None


def _linear_site(name: str, module) -> SiteSpec:
    adapters: Dict[str, AdapterWeights] = {}
    unsupported = None
    for adapter, lin_a in module.lora_A.items():
        lin_b = module.lora_B[adapter]
        adapters[adapter] = AdapterWeights(
            lora_a=lin_a.weight, lora_b=lin_b.weight, scaling=float(module.scaling[adapter]),
            bias=getattr(lin_b, "bias", None),
        )
        unsupported = unsupported or _unsupported_reason(module, adapter)
    any_w = next(iter(adapters.values()))
    return SiteSpec(name, "linear", any_w.lora_a.shape[1], any_w.lora_b.shape[0], adapters, unsupported, module)


def _embedding_site(name: str, module) -> SiteSpec:
    adapters: Dict[str, AdapterWeights] = {}
    unsupported = None
    for adapter, emb_a in module.lora_embedding_A.items():
        # PEFT stores A as [r, vocab] and B as [dim, r]: already [r, in] / [out, r].
        adapters[adapter] = AdapterWeights(emb_a, module.lora_embedding_B[adapter], float(module.scaling[adapter]))
        unsupported = unsupported or _unsupported_reason(module, adapter)
    any_w = next(iter(adapters.values()))
    return SiteSpec(name, "embedding", any_w.lora_a.shape[1], any_w.lora_b.shape[0], adapters, unsupported,
                    module)


def iter_lora_sites(model: torch.nn.Module) -> Iterator[SiteSpec]:
    """Yield a :class:`SiteSpec` for every PEFT LoRA layer holding at least one adapter."""
    lora_layer = _peft_lora_layer_type()
    if lora_layer is None:
        return
    for name, module in model.named_modules():
        if not isinstance(module, lora_layer):
            continue
        if len(getattr(module, "lora_embedding_A", {})) > 0:
            yield _embedding_site(name, module)
        elif len(getattr(module, "lora_A", {})) > 0:
            yield _linear_site(name, module)


def adapter_names(model: torch.nn.Module) -> list:
    """Adapter names in the order the model knows them (PEFT's ``peft_config`` order)."""
    config = getattr(model, "peft_config", None)
    if config:
        return list(config.keys())
    names: list = []
    for site in iter_lora_sites(model):
        names.extend(a for a in site.adapters if a not in names)
    return names


# Dynamo names a PEFT weight input e.g. L['self'].base_model...q_proj.lora_A['sql'].weight
_LORA_SOURCE = re.compile(r"(?:^|\.)(lora_A|lora_B|lora_embedding_A|lora_embedding_B)\W+(\w+)")


def lora_param_from_source(source_name: str) -> Optional[Tuple[str, str]]:
    """(adapter, role) if a Dynamo input source names a PEFT LoRA weight, else None."""
    m = _LORA_SOURCE.search(source_name)
    if m is None:
        return None
    return m.group(2), ("A" if m.group(1).endswith("A") else "B")
