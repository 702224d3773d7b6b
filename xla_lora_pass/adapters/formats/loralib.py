"""loralib (microsoft/LoRA): ``Linear``, ``Embedding`` and ``MergedLinear``.

``Linear``: ``F.linear(x, T(W), b)`` then ``result += (dropout(x) @ A.T @ B.T) * s``;
``Embedding``: ``result += (F.embedding(x, A.T, ...) @ B.T) * s``, with A
``[r, vocab]`` and B ``[dim, r]``; state-dict keys ``<layer>.lora_A`` /
``<layer>.lora_B``.  With ``merge_weights=True`` (loralib's default),
``model.eval()`` adds B @ A into the base weight, after which the layer
computes its adapter for every token with no LoRA branch left: such a layer
is refused, since every other slot would get the merged adapter too.

``MergedLinear`` (a fused qkv projection, LoRA on k of its n output slices
per ``enable_lora``) keeps A ``[r*k, in]`` and B ``[out/n*k, r]`` and
multiplies them as a grouped conv (slice g's B block times A's g-th r
rows), zero-padded into the enabled slices' rows.  That is one LoRA of rank
r*k whose B is block-diagonal: :func:`merged_b` lays it out as ``[out, r*k]``
(zero rows for the disabled slices), and the site is stacked and rewritten
as any linear one (graph_rewrites/patterns/lora_merged.py).  Its scaling stays
loralib's ``lora_alpha / r``.
"""
from __future__ import annotations

from typing import List

import torch

from ..records import AdapterWeights, SiteSpec
from ...errors import UnsupportedAdapterError
from .base import OneAdapterFormat, optional_module


def _is_merged_linear(module) -> bool:
    lib = optional_module("loralib")
    return lib is not None and isinstance(module, lib.MergedLinear)


def _enabled_slices(module) -> List[int]:
    return [i for i, on in enumerate(module.enable_lora) if on]


def merged_b(where: str, module, lora_a: torch.Tensor, lora_b: torch.Tensor) -> torch.Tensor:
    """MergedLinear's B ``[out/n*k, r]`` as the block-diagonal ``[out, r*k]`` B' with B' @ A = its padded delta_w.

    Raises ValueError when A is not ``[r*k, in]`` or B not ``[out/n*k, r]``.
    """
    slices = _enabled_slices(module)
    k, size = len(slices), module.out_features // len(module.enable_lora)
    if lora_a.dim() != 2 or lora_a.shape[0] % k:
        raise ValueError(f"{where}.lora_A: expected [r*{k}, in] (r rows per enabled slice of MergedLinear), "
                         f"got {list(lora_a.shape)}")
    r = lora_a.shape[0] // k
    if list(lora_b.shape) != [size * k, r]:
        raise ValueError(f"{where}.lora_B: expected {[size * k, r]} (MergedLinear's {k} enabled slices of {size} "
                         f"rows, rank {r}), got {list(lora_b.shape)}")
    with torch.no_grad():
        blocks = lora_b.detach().to("cpu")
        full = torch.zeros(module.out_features, r * k, dtype=blocks.dtype)
        for g, s in enumerate(slices):
            full[s * size:(s + 1) * size, g * r:(g + 1) * r] = blocks[g * size:(g + 1) * size]
    return full


class LoralibFormat(OneAdapterFormat):
    name = "loralib"

    def claims(self, module):
        lib = optional_module("loralib")
        return lib is not None and isinstance(module, lib.LoRALayer) and isinstance(
            module, (lib.Linear, lib.Embedding, lib.MergedLinear, lib.ConvLoRA))

    def read(self, path, module, adapter_name):
        lib = optional_module("loralib")
        if module.r <= 0 or (isinstance(module, lib.MergedLinear) and not any(module.enable_lora)):
            return None  # r=0 or no slice enabled: a plain layer, no adapter
        if isinstance(module, lib.ConvLoRA):
            raise UnsupportedAdapterError(f"loralib {type(module).__name__} {path!r} is not served: convolution "
                                          "LoRA is not a BGMV computation")
        if module.merged:
            raise UnsupportedAdapterError(
                f"loralib layer {path!r} has merged its adapter into its weight (merge_weights=True and eval()), "
                "so every token would get it; build the layers with merge_weights=False")
        if isinstance(module, lib.MergedLinear):
            lora_b = merged_b(f"register_adapters: {path}", module, module.lora_A, module.lora_B)
            weights = AdapterWeights(module.lora_A, lora_b, float(module.scaling))
            return SiteSpec(path, "linear", module.in_features, module.out_features, {adapter_name: weights},
                            module=module, base_weight_attr="weight")
        return super().read(path, module, adapter_name)

    def param_roles(self, module, site):
        yield from super().param_roles(module, site)
        if _is_merged_linear(module):
            (adapter,) = site.adapters
            yield module.lora_ind, (adapter, "slices")  # the mask its forward pads the delta with

    def stack_pair(self, where, site, lora_a, lora_b):
        if _is_merged_linear(site.module):
            return lora_a, merged_b(where, site.module, lora_a, lora_b)
        return lora_a, lora_b

    def kind_of(self, module):
        return "embedding" if isinstance(module, optional_module("loralib").Embedding) else "linear"

    def lora_params(self, module):
        return "lora_A", "lora_B"

    def key_suffixes(self):
        return (("lora_A", "lora_B"),)

    def scaling_of(self, module):
        return module.scaling

    def is_enabled(self, module):
        return not module.merged

    def merged_adapters(self, site):
        return list(site.adapters) if site.module.merged else []

    def default_scaling(self, site, rank):
        if _is_merged_linear(site.module):
            rank //= sum(site.module.enable_lora)  # A holds r rows per enabled slice
        return site.module.lora_alpha / rank  # loralib's own formula, with the loaded adapter's rank
