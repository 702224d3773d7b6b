"""One adapter's rows at one site as the host stacks hold them: the checks, the cast and the folded scaling.

Shared by every way rows reach a slot: ``register_adapters`` and
``load_adapter`` (host_stacks.py), and the model's own tensors read again
after they changed (model_weights.py).
"""
from __future__ import annotations

import math
import numbers
from typing import Optional, Tuple

import torch

from ..adapters.records import AdapterWeights, SiteSpec


def stack_bias(site: SiteSpec, slots) -> torch.Tensor:
    """Host ``[N, out]`` LoRA-bias rows, each scaled by its adapter's scaling; zero where absent."""
    dtype = next(iter(site.adapters.values())).lora_b.dtype
    bias = torch.zeros(len(slots), site.out_features, dtype=dtype)
    for slot, name in enumerate(slots):
        w = site.adapters.get(name)
        if w is not None and w.bias is not None:
            bias[slot] = (w.bias.detach().to("cpu", torch.float32) * w.scaling).to(dtype)
    return bias


def write_slot_rows(stack_a, stack_b, slot: int, lora_a: torch.Tensor, scaled_b: torch.Tensor) -> None:
    r = lora_a.shape[0]
    with torch.no_grad():
        row_a, row_b = stack_a[slot], stack_b[slot]
        if r < row_a.shape[0]:  # a lower rank than the site's: zeros past it (at full rank, two copies only)
            row_a.zero_()
            row_b.zero_()
        row_a[:r] = lora_a
        row_b[:, :r] = scaled_b


def check_tensors(where: str, lora_a, lora_b) -> None:
    for what, t in (("lora_A", lora_a), ("lora_B", lora_b)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{where}.{what}: expected a floating-point tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise TypeError(f"{where}.{what}: expected a floating-point tensor, got {t.dtype} {list(t.shape)}")
        if t.layout != torch.strided:
            raise TypeError(f"{where}.{what}: expected a dense tensor, got layout {t.layout}")
        if t.device.type == "meta":
            raise ValueError(f"{where}.{what}: a meta tensor holds no data; give the weights on any "
                             "real device (they are copied to the host)")


def check_shapes(where: str, site: SiteSpec, max_rank: int, lora_a, lora_b) -> None:
    r = lora_a.shape[0] if lora_a.dim() == 2 else -1
    if lora_a.dim() != 2 or lora_a.shape[1] != site.in_features or not 1 <= r <= max_rank:
        raise ValueError(
            f"{where}.lora_A: expected [r, {site.in_features}] with 1 <= r <= {max_rank} "
            f"(the site's stacked rank), got {list(lora_a.shape)}; the stacks are sized when the model is "
            "registered, to the largest rank of its adapters or LoRAMetadata(max_rank=...) if larger: create "
            "the metadata with a max_rank that covers every adapter it will load"
        )
    if list(lora_b.shape) != [site.out_features, r]:
        raise ValueError(f"{where}.lora_B: expected {[site.out_features, r]}, got {list(lora_b.shape)}")


def scaling_for(name: str, site: SiteSpec, rank: int, scaling: Optional[float], config) -> float:
    if scaling is not None:
        if isinstance(scaling, bool) or not isinstance(scaling, numbers.Real):
            raise TypeError(f"load_adapter({name!r}): scaling must be a real number, got {scaling!r:.80}")
        if not math.isfinite(scaling):
            raise ValueError(f"load_adapter({name!r}): scaling must be finite, got {scaling}")
        return float(scaling)
    if hasattr(config, "scaling_for"):  # a saved adapter's config: per-site alpha (alpha_pattern), rsLoRA
        return config.scaling_for(site.name, rank)
    if config is not None:
        alpha = config.lora_alpha
        return alpha / math.sqrt(rank) if getattr(config, "use_rslora", False) else alpha / rank
    own = site.format.default_scaling(site, rank) if site.format is not None else None
    if own is not None:
        return float(own)  # the layer's own formula (torchtune, loralib), or its scaling at its own rank
    raise ValueError(f"load_adapter({name!r}): give scaling= or a LoraConfig as config= (site {site.name!r} "
                     f"has no scaling of its own for rank {rank})")


def all_finite(t: torch.Tensor) -> bool:
    """Whether every value of ``t`` is finite: its sum in float64 is, exactly when it holds no NaN or inf and
    does not overflow (float32 values would need more than 1e269 of them; a float64 tensor's overflow reads
    as not finite, so the caller counts before refusing).  One reduction: ``isfinite(t).all()`` writes a bool
    tensor first and measured 5-7x the time ([64, 4096] float32: 264 us against 38 us)."""
    return math.isfinite(float(t.sum(dtype=torch.float64)))


def host_slot_weights(where: str, w: AdapterWeights, dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor]:
    """A and scaling * B as host tensors of the stack dtype; refused if any value is not finite.

    Why refuse: the fused expand multiplies every slot's B by zeros for the
    tokens on other slots, and 0 * inf is NaN, so one bad slot would reach
    every token of the batch, not only its own.
    """
    with torch.no_grad():
        # A copy even where the weights are host tensors of the dtype already (a state dict's): what a pool keeps
        # read, and the swap it prepared from it, must not change when the caller's tensors do.
        lora_a = w.lora_a.detach().to("cpu", dtype, copy=True)
        # Folding the scaling into B lets every adapter keep its own alpha/r.
        scaled_b = (w.lora_b.detach().to("cpu", torch.float32) * w.scaling).to(dtype)
    for what, t in (("lora_A", lora_a), (f"lora_B * scaling ({w.scaling})", scaled_b)):
        if all_finite(t):
            continue
        bad = int((~torch.isfinite(t)).sum())  # counted for the message (0: a float64 sum that overflowed)
        if bad:
            raise ValueError(f"{where}: {what} has {bad} NaN or inf value(s) (as {dtype}); adapter weights "
                             "must be finite")
    return lora_a, scaled_b


__all__ = ["all_finite", "check_shapes", "check_tensors", "host_slot_weights", "scaling_for", "stack_bias",
           "write_slot_rows"]
