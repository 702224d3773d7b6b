"""A state dict of adapter weights, grouped by registered site in each site's own key format."""
from __future__ import annotations

from typing import Dict, Mapping, Optional

import torch

from ..records import SiteSpec

ROLE_NAMES = {"A": "lora_A", "B": "lora_B", "magnitude": "DoRA magnitude"}


def split_state(where: str, state: Mapping[str, torch.Tensor],
                sites: Mapping[str, SiteSpec]) -> Dict[str, Dict[str, torch.Tensor]]:
    """``{site: {role: tensor}}``; a key no registered site's format reads, or a half pair, is an error.

    Each site's reader parses its own keys (PEFT ``<layer>.lora_A.weight``,
    torchtune ``<layer>.lora_a.weight``, loralib ``<layer>.lora_B``, ...);
    a key may carry a prefix the registered module path lacks, or lack one
    it has, as long as it names one site.
    """
    readers = list({id(s.format): s.format for s in sites.values() if s.format is not None}.values())
    found: Dict[str, Dict[str, torch.Tensor]] = {}
    for key, tensor in state.items():
        if not isinstance(key, str):
            raise TypeError(f"{where}: state keys must be str, got {key!r:.80}")
        hit, parsed_by_any = None, False
        for reader in readers:
            parsed = reader.split_key(key)
            if parsed is None:
                continue
            parsed_by_any = True
            site = match_site(parsed[0], {n: s for n, s in sites.items() if s.format is reader})
            if site is not None:
                hit = site, parsed[1]
                break
        if hit is None:
            forms = ", ".join(sorted({_example_key(s) for s in sites.values()})[:3])
            what = "names no registered LoRA site" if parsed_by_any else "is not a lora_A / lora_B weight"
            raise KeyError(f"{where}: {key!r} {what} (this model's keys look like {forms}); give the "
                           "adapter's weights only")
        found.setdefault(hit[0], {})[hit[1]] = tensor
    for site, roles in found.items():
        if not {"A", "B"} <= set(roles):
            raise KeyError(f"{where}: site {site!r} has {sorted(roles)} but needs both lora_A and lora_B")
    return found


def _example_key(site: SiteSpec) -> str:
    pair = getattr(site.format, "key_suffixes", None)
    suffix = pair()[0][0] if pair is not None else "lora_A.weight"
    return f"'{site.name}.{suffix}'"


def match_site(prefix: str, sites: Mapping[str, SiteSpec]) -> Optional[str]:
    """The one site ``prefix`` names: the same path, or one that ends the other after a dot."""
    if prefix in sites:
        return prefix
    hits = [s for s in sites if s.endswith("." + prefix) or prefix.endswith("." + s)]
    return hits[0] if len(hits) == 1 else None
