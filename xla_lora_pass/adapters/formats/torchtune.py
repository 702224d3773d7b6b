"""torchtune's ``LoRALinear`` (and the models its ``lora_*`` builders make).

Its forward is ``F.linear(x, W, b) + (alpha / rank) * lora_b(lora_a(dropout(x)))``;
the state-dict keys are ``<layer>.lora_a.weight`` / ``<layer>.lora_b.weight``.
``DoRALinear`` and ``QATLoRALinear`` compute something else and are refused.
"""
from __future__ import annotations

from ...errors import UnsupportedAdapterError
from .base import OneAdapterFormat, optional_module


class TorchtuneFormat(OneAdapterFormat):
    name = "torchtune"

    def claims(self, module):
        peft = optional_module("torchtune.modules.peft")
        if peft is None:
            return False
        return isinstance(module, (peft.LoRALinear, peft.DoRALinear))

    def read(self, path, module, adapter_name):
        peft = optional_module("torchtune.modules.peft")
        if isinstance(module, peft.DoRALinear) or type(module).__name__ == "QATLoRALinear":
            raise UnsupportedAdapterError(
                f"torchtune {type(module).__name__} {path!r} is not served: only LoRALinear is read from torchtune "
                "(PEFT's DoRA is); convert the adapter to LoRALinear or serve it through PEFT")
        if getattr(module, "_quantize_base", False):
            raise UnsupportedAdapterError(
                f"torchtune LoRALinear {path!r} has an NF4-quantized base weight, which XLA cannot run; build the "
                "model with quantize_base=False")
        return super().read(path, module, adapter_name)

    def lora_params(self, module):
        return "lora_a.weight", "lora_b.weight"

    def key_suffixes(self):
        return (("lora_a.weight", "lora_b.weight"),)

    def scaling_of(self, module):
        return module.alpha / module.rank

    def is_enabled(self, module):
        return not module.disabled

    def default_scaling(self, site, rank):
        return site.module.alpha / rank  # torchtune's own formula, with the loaded adapter's rank
