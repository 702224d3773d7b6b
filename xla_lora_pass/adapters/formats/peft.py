"""PEFT's LoRA layers (``peft.tuners.lora.LoraLayer``): many named adapters per layer.

PEFT keeps a ``lora_A`` / ``lora_B`` pair per adapter name
(``lora_embedding_A`` / ``lora_embedding_B`` for embeddings), a float
``scaling`` per adapter that already folds in rsLoRA, and for DoRA adapters a
``lora_magnitude_vector[adapter].weight``.  State-dict keys are
``<layer>.lora_A[.<adapter>].weight`` (``save_pretrained`` drops the adapter
name).  Loading a saved adapter directory is in ``peft_dir.py``.

A ``PeftMixedModel`` wraps a layer once per tuner it adds in turn: LoRA
"sql", then LoHa "hada", then LoRA "chat" on one module nest as
``chat(hada(sql(Linear)))``.  The plain LoRA layers of such a chain are read as
one site (``lora_layers``); the other tuners' adapters are refused or excluded
by ``adapters/unserved.py``, and an excluded one must be inactive, so each
layer of the chain passes the same input down.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch

from graph_rewrites.dynamo_sources import attribute_path

from ..records import AdapterWeights, SiteSpec
from .base import AdapterFormat
from .peft_tracing import allow_whole_dora_graphs

_ROLE_PARTS = {"lora_A": "A", "lora_B": "B", "lora_embedding_A": "A", "lora_embedding_B": "B",
               "lora_magnitude_vector": "magnitude"}


def _lora_layer_type():
    try:
        from peft.tuners.lora import LoraLayer
    except ImportError:  # peft is optional: other formats need no PEFT
        return None
    return LoraLayer


def is_plain_lora(module) -> bool:
    """A PEFT LoRA layer whose class adds no per-adapter parts of its own.

    AdaLoRA's ``SVDLinear`` subclasses ``LoraLayer`` but adds ``lora_E`` (its
    forward is ``B (A * E)``): not LoRA.  Nor is a LoRA on a parameter
    (``on_a_parameter``).  A LoRA variant (DoRA, ...) adds its
    parts to the instance, not the class, and stays a LoRA layer.
    """
    layer = _lora_layer_type()
    if layer is None or not isinstance(module, layer) or on_a_parameter(module):
        return False
    return set(type(module).adapter_layer_names) <= set(layer.adapter_layer_names) | {"lora_magnitude_vector"}


def on_a_parameter(module) -> bool:
    """PEFT's ``ParamWrapper`` (LoRA ``target_parameters``, e.g. the fused MoE experts that ``"all-linear"``
    targets on transformers 5's Mixtral): it adds ``B A`` to a weight before the module's own forward, not to
    an activation, so no shrink/expand serves it per token."""
    return isinstance(getattr(module, "parameter_name", None), str)


def lora_layers(module) -> List:
    """The plain LoRA layers down ``module``'s chain of PEFT tuner layers (``base_layer``), outermost first."""
    layers = []
    while module is not None:
        if is_plain_lora(module):
            layers.append(module)
        module = getattr(module, "base_layer", None)
    return layers


def _held(layer) -> set:
    return set(getattr(layer, "lora_A", {})) | set(getattr(layer, "lora_embedding_A", {}))


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


def _one_number(scaling) -> float:
    """The scaling as the stacks fold it in: a float, or a one-element tensor's value (PEFT's
    ``prepare_model_for_compiled_hotswap``); a larger tensor (a custom per-channel variant) makes the site
    unsupported, and its first value stands in for the record."""
    if isinstance(scaling, torch.Tensor):
        return float(scaling.detach().reshape(-1)[0])
    return float(scaling)


class PeftFormat(AdapterFormat):
    name = "peft"

    def claims(self, module):
        return is_plain_lora(module)

    def read(self, path, module, adapter_name):
        layers = lora_layers(module)
        if any(len(getattr(layer, "lora_embedding_A", {})) > 0 for layer in layers):
            return self._site(path, module, "embedding", layers)
        if any(len(getattr(layer, "lora_A", {})) > 0 for layer in layers):
            return self._site(path, module, "linear", layers)
        return None

    def _site(self, path, module, kind, layers) -> SiteSpec:
        adapters: Dict[str, AdapterWeights] = {}
        unsupported = None
        for layer, adapter, a, b in _pairs(layers, kind):
            # Embeddings keep A as [r, vocab] and B as [dim, r] tensors: already [r, in] / [out, r].
            lora_a, lora_b = (a, b) if kind == "embedding" else (a.weight, b.weight)
            magnitude = layer.lora_magnitude_vector[adapter].weight if (
                kind == "linear" and _is_dora(layer, adapter)) else None
            if magnitude is not None:
                allow_whole_dora_graphs()  # the rewrite needs the whole DoRA forward in one graph
            scaling = layer.scaling[adapter]
            adapters[adapter] = AdapterWeights(
                lora_a=lora_a, lora_b=lora_b, scaling=_one_number(scaling),
                bias=getattr(b, "bias", None) if kind == "linear" else None, magnitude=magnitude)
            unsupported = unsupported or _unsupported_reason(layer, adapter, kind) or (
                f"adapter {adapter!r} scales its delta by a tensor of shape {list(scaling.shape)}, not one number"
                if isinstance(scaling, torch.Tensor) and scaling.numel() != 1 else None)
        any_w = next(iter(adapters.values()))
        return SiteSpec(path, kind, any_w.lora_a.shape[1], any_w.lora_b.shape[0], adapters, unsupported, module)

    def value_sources(self, site, adapter):
        # A float only: a scaling tensor (compiled hotswap) is one of the watched tensors.
        return [(layer.scaling, adapter) for layer in lora_layers(site.module)
                if adapter in layer.scaling and not isinstance(layer.scaling[adapter], torch.Tensor)]

    def merged_adapters(self, site):
        return [a for layer in lora_layers(site.module) for a in (getattr(layer, "merged_adapters", None) or ())]

    def param_roles(self, module, site):
        for layer, adapter, a, b in _pairs(lora_layers(module), site.kind):
            if site.kind == "embedding":
                yield a, (adapter, "A")
                yield b, (adapter, "B")
            else:
                yield a.weight, (adapter, "A")
                yield b.weight, (adapter, "B")
                if getattr(b, "bias", None) is not None:
                    yield b.bias, (adapter, "bias")
                if _is_dora(layer, adapter):
                    yield layer.lora_magnitude_vector[adapter].weight, (adapter, "magnitude")
            scaling = layer.scaling[adapter]
            if isinstance(scaling, torch.Tensor):  # prepare_model_for_compiled_hotswap: the forward multiplies by it
                yield scaling, (adapter, "scaling")

    def computed_adapters(self, module, site):
        return [a for layer in lora_layers(module) if not getattr(layer, "disable_adapters", False)
                for a in getattr(layer, "active_adapters", []) if a in _held(layer) and a in site.adapters]

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


def _pairs(layers, kind):
    """(layer, adapter, A, B) of every adapter of the chain's layers (A, B modules, or tensors for embeddings)."""
    for layer in layers:
        all_a, all_b = ((layer.lora_embedding_A, layer.lora_embedding_B) if kind == "embedding"
                        else (layer.lora_A, layer.lora_B))
        for adapter, a in all_a.items():
            yield layer, adapter, a, all_b[adapter]


# Dynamo names a PEFT weight input e.g. L['self']._modules['base_model']..._modules['lora_A']._modules['sql']
# ._parameters['weight'] (torch 2.9), L['self'].__dict__['_modules']['base_model']... (newer torch), or
# L['self'].base_model...q_proj.lora_A['sql'].weight: all read as one dotted path (graph_rewrites.dynamo_sources).
_LORA_PARTS = ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B")


def lora_param_from_source(source_name: str) -> Optional[Tuple[str, str, str]]:
    """(layer path, adapter, role) if a Dynamo input source names a PEFT LoRA weight, else None."""
    parts = attribute_path(source_name).split(".")
    at = next((i for i, p in enumerate(parts[:-1]) if p in _LORA_PARTS), None)
    if at is None:
        return None
    layer = parts[:at]
    if layer[:2] == ["L", "self"]:  # the compiled module itself: paths from it, as register_adapters names sites
        layer = layer[2:]
    return ".".join(layer), parts[at + 1], ("A" if parts[at].endswith("A") else "B")


def scaling_from_source(source_name: str) -> Optional[Tuple[str, str]]:
    """(layer path, adapter) if a Dynamo input source names a PEFT layer's float ``scaling[adapter]``, else None.

    Newer Dynamo (torch 2.14 with ``dynamic=True``) does not bake such a float
    into the graph: it becomes a 0-d tensor input, e.g.
    ``L['self'].__dict__['_modules']['base_model']...['q'].scaling['sql']``.
    """
    parts = attribute_path(source_name).split(".")
    if len(parts) < 3 or parts[-2] != "scaling":
        return None
    layer = parts[:-2]
    if layer[:2] == ["L", "self"]:
        layer = layer[2:]
    return ".".join(layer), parts[-1]
