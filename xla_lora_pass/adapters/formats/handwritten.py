"""Hand-written LoRA modules: a layer with its own A and B and a scaling, in the forms the patterns match.

Recognised: a module (of no LoRA library) with

* A and B as parameters ``lora_A`` / ``lora_B`` (or ``lora_a`` / ``lora_b``), A ``[r, in]``, B ``[out, r]``,
  as in ``base(x) + (x @ A.T @ B.T) * s``, or as bias-free ``nn.Linear`` children of those names,
  as in ``base(x) + lora_B(lora_A(dropout(x))) * s``;
* and its scaling as a number attribute ``scaling`` or ``scale``, or as ``alpha`` over ``rank`` (or ``r``).

The graph must then scale the delta by that number (the pattern check
compares it), so a module whose forward does something else is a near miss,
never a wrong result.  A module with A and B but no scaling is refused.
"""
from __future__ import annotations

import numbers

import torch
import torch.nn as nn

from ...errors import UnsupportedAdapterError
from .base import OneAdapterFormat

_NAMES = (("lora_A", "lora_B"), ("lora_a", "lora_b"))


def _number(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


class HandwrittenFormat(OneAdapterFormat):
    name = "hand-written"

    def _pair(self, module):
        """The (A, B) parameter names of the module, relative to it, or None."""
        for a, b in _NAMES:
            if isinstance(module._parameters.get(a), nn.Parameter) and isinstance(module._parameters.get(b),
                                                                                  nn.Parameter):
                return a, b
            lin_a, lin_b = module._modules.get(a), module._modules.get(b)
            if (isinstance(lin_a, nn.Linear) and isinstance(lin_b, nn.Linear) and lin_a.bias is None
                    and lin_b.bias is None):
                return f"{a}.weight", f"{b}.weight"
        return None

    def claims(self, module):
        return self._pair(module) is not None

    def lora_params(self, module):
        return self._pair(module)

    def key_suffixes(self):
        return tuple((f"{a}.weight", f"{b}.weight") for a, b in _NAMES) + _NAMES

    def scaling_of(self, module):
        for attr in ("scaling", "scale"):
            if _number(getattr(module, attr, None)):
                return float(getattr(module, attr))
        alpha = getattr(module, "alpha", None)
        rank = getattr(module, "rank", getattr(module, "r", None))
        if _number(alpha) and _number(rank) and rank:
            return alpha / rank
        raise UnsupportedAdapterError(
            f"hand-written LoRA layer {type(module).__name__} has {' and '.join(self._pair(module))} but no scaling: "
            "give it a number attribute `scaling` (or `alpha` and `rank`), the factor its forward multiplies "
            "the delta by")

    def base_weight_attr(self, module):
        for child in ("base", "base_layer", "linear"):
            if isinstance(getattr(module._modules.get(child), "weight", None), torch.Tensor):
                return f"{child}.weight"
        return super().base_weight_attr(module)

    def read(self, path, module, adapter_name):
        try:
            return super().read(path, module, adapter_name)
        except UnsupportedAdapterError as exc:
            raise UnsupportedAdapterError(f"{path!r}: {exc}") from None
