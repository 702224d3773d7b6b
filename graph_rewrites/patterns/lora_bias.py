"""Pattern 5: linear LoRA whose B has a bias (PEFT ``lora_bias=True``).

    y = base(x) + linear(linear(x, A), B, b) * s

becomes pattern 1's shrink/expand plus ``bgmv_bias``: per-slot bias rows
(scaled by each slot's own scaling) gathered per token, nothing for -1.
"""
from __future__ import annotations

from typing import Optional

import torch.fx as fx
import torch.nn.functional as F

from ..annotations import LORA_WEIGHT
from .lora_linear import COMBINE_FORMS, input_reason, lora_linear_replacement, weights_reason
from ..pattern_matcher import LinearMatch, Pattern


def _make_pattern(combine_fn):
    def lora_bias_pattern(x, base, lora_a, lora_b, lora_bias, scale):
        return combine_fn(base, F.linear(F.linear(x, lora_a), lora_b, lora_bias), scale)

    return lora_bias_pattern


SEARCH_FORMS = tuple(_make_pattern(c) for c in COMBINE_FORMS)


def near_miss_reason(m: LinearMatch) -> Optional[str]:
    """Pattern 1's check, and the bias must be the same adapter's lora_B bias."""
    reason = weights_reason(m) or input_reason(m)
    if reason is not None:
        return reason
    ref_a, ref_bias = m.lora_a.meta[LORA_WEIGHT], m.lora_bias.meta.get(LORA_WEIGHT) if isinstance(
        m.lora_bias, fx.Node) else None
    if ref_bias is None or ref_bias.role != "bias" or (ref_bias.site, ref_bias.adapter) != (ref_a.site, ref_a.adapter):
        return "the B projection's bias is not the registered adapter's lora_B bias"
    return None


# Pattern 1's replacement: it adds the bias of every slot that has one.
LORA_BIAS = Pattern("lora_bias", SEARCH_FORMS, near_miss_reason, lora_linear_replacement)
