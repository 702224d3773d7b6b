"""loralib (microsoft/LoRA): ``Linear`` and ``Embedding``; ``MergedLinear`` is refused.

``Linear``: ``F.linear(x, T(W), b)`` then ``result += (dropout(x) @ A.T @ B.T) * s``;
``Embedding``: ``result += (F.embedding(x, A.T, ...) @ B.T) * s``, with A
``[r, vocab]`` and B ``[dim, r]``; state-dict keys ``<layer>.lora_A`` /
``<layer>.lora_B``.  With ``merge_weights=True`` (loralib's default),
``model.eval()`` adds B @ A into the base weight, after which the layer
computes its adapter for every token with no LoRA branch left: such a layer
is refused, since every other slot would get the merged adapter too.
"""
from __future__ import annotations

from ..errors import UnsupportedAdapterError
from .base import OneAdapterFormat, optional_module


class LoralibFormat(OneAdapterFormat):
    name = "loralib"

    def claims(self, module):
        lib = optional_module("loralib")
        return lib is not None and isinstance(module, lib.LoRALayer) and isinstance(
            module, (lib.Linear, lib.Embedding, lib.MergedLinear, lib.ConvLoRA))

    def read(self, path, module, adapter_name):
        lib = optional_module("loralib")
        if module.r <= 0:
            return None  # r=0: a plain layer, no adapter
        if isinstance(module, lib.MergedLinear):
            raise UnsupportedAdapterError(
                f"loralib MergedLinear {path!r} is not served: its delta is a grouped conv1d of A and B scattered "
                "into the enabled output slices, a weight the kernels would have to rebuild per slot; use one "
                "loralib.Linear per projection (or PEFT) for multi-LoRA serving")
        if isinstance(module, lib.ConvLoRA):
            raise UnsupportedAdapterError(f"loralib {type(module).__name__} {path!r} is not served: convolution "
                                          "LoRA is not a BGMV computation")
        if module.merged:
            raise UnsupportedAdapterError(
                f"loralib layer {path!r} has merged its adapter into its weight (merge_weights=True and eval()), "
                "so every token would get it; build the layers with merge_weights=False")
        return super().read(path, module, adapter_name)

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

    def default_scaling(self, site, rank):
        return site.module.lora_alpha / rank  # loralib's own formula, with the loaded adapter's rank

