"""DoRA's per-slot constants, folded on the host at registration and at ``load_adapter``.

At inference PEFT's DoRA layer computes ``d * (W x + s B A x) + bias`` with
``d = magnitude / ||W + s B A||`` (the L2 norm of each output row of the
combined weight; peft/tuners/lora/dora.py).  ``d`` depends on the weights
alone, so per slot the kernel gets ``(d - 1, (d - 1) * bias)``: ``bgmv_dora``
turns the rewritten site's ``y = W x + bias + s B A x`` into
``y + (d - 1) * y - (d - 1) * bias``.  Slots without DoRA (and the base
model) get zeros, which leave their rows exactly as they are.
"""
from __future__ import annotations

import torch

from .records import AdapterWeights, SiteSpec


def dora_rows(where: str, site: SiteSpec, weights: AdapterWeights) -> torch.Tensor:
    """``[2, out]`` float32: the gain ``d - 1`` and the shift ``(d - 1) * base bias`` of one DoRA adapter."""
    weight, bias = site.base_parameters()
    if weight is None:
        raise ValueError(f"{where}: DoRA needs the base layer's weight, and {site.name!r} has none readable")
    magnitude = weights.magnitude
    if not isinstance(magnitude, torch.Tensor) or not magnitude.is_floating_point() or list(
            magnitude.shape) != [site.out_features]:
        got = list(magnitude.shape) if isinstance(magnitude, torch.Tensor) else type(magnitude).__name__
        raise ValueError(f"{where}: the DoRA magnitude must be a floating-point [{site.out_features}] tensor, "
                         f"got {got}")
    with torch.no_grad():
        w = weight.detach().to("cpu", torch.float32)
        delta = weights.scaling * (weights.lora_b.detach().to("cpu", torch.float32)
                                   @ weights.lora_a.detach().to("cpu", torch.float32))
        norm = torch.linalg.norm(w + delta, dim=1)
        gain = magnitude.detach().to("cpu", torch.float32) / norm - 1
        shift = gain * bias.detach().to("cpu", torch.float32) if bias is not None else torch.zeros_like(gain)
    rows = torch.stack([gain, shift])
    bad = int((~torch.isfinite(rows)).sum())
    if bad:
        raise ValueError(f"{where}: the DoRA scale magnitude / ||W + s*B@A|| has {bad} NaN or inf value(s) (a zero "
                         "row norm, or a non-finite magnitude)")
    return rows


def stack_dora(site: SiteSpec, slots) -> torch.Tensor:
    """Host ``[N, 2, out]`` float32 DoRA rows of a site; zeros for slots that are not DoRA adapters here."""
    stack = torch.zeros(len(slots), 2, site.out_features, dtype=torch.float32)
    for slot, name in enumerate(slots):
        w = site.adapters.get(name)
        if w is not None and w.magnitude is not None:
            stack[slot] = dora_rows(f"register_adapters: {site.name} adapter {name!r}", site, w)
    return stack
