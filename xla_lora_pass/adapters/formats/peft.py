"""PEFT's LoRA layers (``peft.tuners.lora.LoraLayer``): many named adapters per layer.

PEFT keeps a ``lora_A`` / ``lora_B`` pair per adapter name
(``lora_embedding_A`` / ``lora_embedding_B`` for embeddings), a float
``scaling`` per adapter that already folds in rsLoRA, and for DoRA adapters a
``lora_magnitude_vector[adapter].weight``.  State-dict keys are
``<layer>.lora_A[.<adapter>].weight`` (``save_pretrained`` drops the adapter
name).  Loading a saved adapter directory is in ``peft_dir.py``.
"""
from __future__ import annotations

import re
from typing import Dict, Optional, Tuple

from ..records import AdapterWeights, SiteSpec
from .base import AdapterFormat

_ROLE_PARTS = {"lora_A": "A", "lora_B": "B", "lora_embedding_A": "A", "lora_embedding_B": "B",
               "lora_magnitude_vector": "magnitude"}


def _lora_layer_type():
    try:
        from peft.tuners.lora import LoraLayer
    except ImportError:  # peft is optional: other formats need no PEFT
        return None
    return LoraLayer


def _is_dora(module, adapter: str) -> bool:
    variant = (getattr(module, "lora_variant", {}) or {}).get(adapter)
    if variant is not None:
        return type(variant).__name__.startswith("Dora")
    return bool((getattr(module, "use_dora", {}) or {}).get(adapter, False))  # peft before lora_variant


def _unsupported_reason(module, adapter: str, kind: str) -> Optional[str]:
    variant = (getattr(module, "lora_variant", {}) or {}).get(adapter)
    if _is_dora(module, adapter):
        if kind == "embedding":
            return ("DoRA on an embedding: PEFT's DoRA embedding forward builds a Parameter inside forward, "
                    "which breaks Dynamo's graph there")
        return None
    if variant is not None:
        return f"LoRA variant {type(variant).__name__} changes the forward"
    return None


class PeftFormat(AdapterFormat):
    name = "peft"

    def claims(self, module):
        layer = _lora_layer_type()
        return layer is not None and isinstance(module, layer)

    def read(self, path, module, adapter_name):
        if len(getattr(module, "lora_embedding_A", {})) > 0:
            return self._site(path, module, "embedding", module.lora_embedding_A, module.lora_embedding_B)
        if len(getattr(module, "lora_A", {})) > 0:
            return self._site(path, module, "linear", module.lora_A, module.lora_B)
        return None

    def _site(self, path, module, kind, all_a, all_b) -> SiteSpec:
        adapters: Dict[str, AdapterWeights] = {}
        unsupported = None
        for adapter, a in all_a.items():
            b = all_b[adapter]
            # Embeddings keep A as [r, vocab] and B as [dim, r] tensors: already [r, in] / [out, r].
            lora_a, lora_b = (a, b) if kind == "embedding" else (a.weight, b.weight)
            magnitude = module.lora_magnitude_vector[adapter].weight if (
                kind == "linear" and _is_dora(module, adapter)) else None
            adapters[adapter] = AdapterWeights(
                lora_a=lora_a, lora_b=lora_b, scaling=float(module.scaling[adapter]),
                bias=getattr(b, "bias", None) if kind == "linear" else None, magnitude=magnitude)
            unsupported = unsupported or _unsupported_reason(module, adapter, kind)
        any_w = next(iter(adapters.values()))
        return SiteSpec(path, kind, any_w.lora_a.shape[1], any_w.lora_b.shape[0], adapters, unsupported, module)

    def param_roles(self, module, site):
        if site.kind == "embedding":
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
            if _is_dora(module, adapter):
                yield id(module.lora_magnitude_vector[adapter].weight), (adapter, "magnitude")

    def computed_adapters(self, module, site):
        if getattr(module, "disable_adapters", False):
            return []
        return [a for a in getattr(module, "active_adapters", []) if a in site.adapters]

    def split_key(self, key):
        parts = key.split(".")
        at = next((i for i, p in enumerate(parts) if p in _ROLE_PARTS), None)
        if at is None:
            return None
        # Embedding A/B are bare tensors; save_pretrained writes a DoRA magnitude without ".weight".
        bare = parts[at].startswith("lora_embedding") or parts[at] == "lora_magnitude_vector"
        if not (parts[-1] == "weight" or bare) or len(parts) - at > 3:
            return None
        return ".".join(parts[:at]), _ROLE_PARTS[parts[at]]

    def base_parameters(self, module):
        base = module.get_base_layer()
        weight = base.weight
        if getattr(module, "fan_in_fan_out", False):
            weight = weight.T  # GPT-2's Conv1D keeps [in, out]
        return weight, getattr(base, "bias", None)


# Dynamo names a PEFT weight input e.g. L['self'].base_model...q_proj.lora_A['sql'].weight
_LORA_SOURCE = re.compile(r"(?:^|\.)(lora_A|lora_B|lora_embedding_A|lora_embedding_B)\W+(\w+)")


def lora_param_from_source(source_name: str) -> Optional[Tuple[str, str]]:
    """(adapter, role) if a Dynamo input source names a PEFT LoRA weight, else None."""
    m = _LORA_SOURCE.search(source_name)
    if m is None:
        return None
    return m.group(2), ("A" if m.group(1).endswith("A") else "B")
