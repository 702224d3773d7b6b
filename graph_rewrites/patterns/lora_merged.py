"""Pattern 7: loralib's ``MergedLinear``, a fused projection (qkv) whose LoRA covers some output slices.

Its forward builds the weight delta from A ``[r*k, in]`` and B ``[out/n*k, r]``
(k of the n slices enabled) and adds it to the base output::

    delta_w = conv1d(A.unsqueeze(0), B.unsqueeze(-1), groups=k).squeeze(0)  # [out/n*k, in]
    padded = index_put(delta_w.new_zeros((out, in)), (slices,), delta_w)    # zero rows: disabled slices
    y = base(x) + (x @ padded.T) * s

(``normalize`` has made loralib's ``padded[slices] = delta_w`` functional; with
``fan_in_fan_out`` the transpose is ``.transpose(0, 1).T.transpose(0, 1)``.)
The grouped conv is a block-diagonal B, so ``padded == B' @ A`` with B'
``[out, r*k]``: slice g's B block in the rows of the g-th enabled slice,
zero elsewhere.  The loralib reader stacks that B' (``adapters/formats/loralib.py``),
so the site is pattern 1's shrink/expand at rank r*k.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.fx as fx

from ..annotations import LORA_WEIGHT
from .lora_linear import input_reason, lora_linear_replacement, weights_reason
from ..pattern_matcher import LinearMatch, Pattern


def _padded_delta(lora_a, lora_b, slices, shape, groups):
    delta_w = torch.conv1d(lora_a.unsqueeze(0), lora_b.unsqueeze(-1), groups=groups).squeeze(0)
    return torch.index_put(delta_w.new_zeros(shape), (slices,), delta_w)


def _merged(x, base, lora_a, lora_b, slices, shape, groups, scale):
    padded = _padded_delta(lora_a, lora_b, slices, shape, groups)
    return base + (x @ padded.T) * scale


def _merged_fan_in_fan_out(x, base, lora_a, lora_b, slices, shape, groups, scale):
    padded = _padded_delta(lora_a, lora_b, slices, shape, groups)
    return base + (x @ padded.transpose(0, 1).T.transpose(0, 1)) * scale


SEARCH_FORMS = (_merged, _merged_fan_in_fan_out)


def near_miss_reason(m: LinearMatch) -> Optional[str]:
    """None if the match is the registered MergedLinear's own delta, else why not.

    Beyond pattern 1's checks (one adapter's A and B, its scaling): the
    delta is scattered by the layer's own mask into its weight's shape, so it
    is the B' @ A the reader stacked.  The groups need no check: the conv of
    A ``[r*k, in]`` with B ``[., r, 1]`` only runs with groups = k.
    """
    reason = weights_reason(m) or input_reason(m)
    if reason is not None:
        return reason
    ref_a = m.lora_a.meta[LORA_WEIGHT]
    slices = m.extra["slices"]
    ref_s = slices.meta.get(LORA_WEIGHT) if isinstance(slices, fx.Node) else None
    if ref_s is None or ref_s.role != "slices" or (ref_s.site, ref_s.adapter) != (ref_a.site, ref_a.adapter):
        return "the delta is scattered by a mask that is not this MergedLinear's own lora_ind"
    if tuple(m.extra["shape"]) != (ref_a.out_features, ref_a.in_features):
        return f"the delta is padded to {m.extra['shape']}, not the layer's weight shape"
    return None


LORA_MERGED = Pattern("lora_merged", SEARCH_FORMS, near_miss_reason, lora_linear_replacement)
