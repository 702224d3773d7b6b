"""Pattern 5: linear LoRA whose B has a bias (PEFT ``lora_bias=True``).

    y = base(x) + linear(linear(x, A), B, b) * s

becomes pattern 1's shrink/expand plus ``bgmv_bias``: per-slot bias rows
(scaled by each slot's own scaling) gathered per token, nothing for -1.
"""
from __future__ import annotations

import functools

from typing import Optional, Tuple

import torch.fx as fx
import torch.nn.functional as F

from .annotations import LORA_WEIGHT
from .lora_linear import (COMBINE_FORMS, LinearMatch, apply_matches, find_matches, lora_linear_replacement,
                          weights_reason)
from .report import RewriteContext

PATTERN_NAME = "lora_bias"


def _make_pattern(combine_fn):
    def lora_bias_pattern(x, base, lora_a, lora_b, lora_bias, scale):
        return combine_fn(base, F.linear(F.linear(x, lora_a), lora_b, lora_bias), scale)

    return lora_bias_pattern


@functools.lru_cache(maxsize=None)  # traced once per process; the matcher only reads them
def lora_bias_patterns() -> Tuple[fx.Graph, ...]:
    return tuple(fx.symbolic_trace(_make_pattern(c)).graph for c in COMBINE_FORMS)


def near_miss_reason(m: LinearMatch) -> Optional[str]:
    reason = weights_reason(m)
    if reason is not None:
        return reason
    ref_a, ref_bias = m.lora_a.meta[LORA_WEIGHT], m.lora_bias.meta.get(LORA_WEIGHT) if isinstance(
        m.lora_bias, fx.Node) else None
    if ref_bias is None or ref_bias.role != "bias" or (ref_bias.site, ref_bias.adapter) != (ref_a.site, ref_a.adapter):
        return "the B projection's bias is not the registered adapter's lora_B bias"
    return None


def rewrite_lora_bias(gm: fx.GraphModule, ctx: RewriteContext) -> bool:
    """Rewrite every biased LoRA linear site of ``gm`` in place."""
    return apply_matches(gm, ctx, find_matches(gm, lora_bias_patterns()), PATTERN_NAME, near_miss_reason,
                         lora_linear_replacement)
