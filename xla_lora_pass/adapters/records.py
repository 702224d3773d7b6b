"""The records every adapter format is read into: one ``SiteSpec`` per LoRA layer.

The readers in ``adapters/formats/`` (PEFT, torchtune, loralib, hand-written modules)
turn each library's LoRA layers into these plain records, so the rest of the
package never touches a library's types.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional, Tuple

import torch


@dataclasses.dataclass
class AdapterWeights:
    """One adapter at one site, in vLLM layout: A ``[r, in]``, B ``[out, r]``."""

    lora_a: torch.Tensor
    lora_b: torch.Tensor
    scaling: float
    bias: Optional[torch.Tensor] = None  # PEFT lora_bias=True: B's bias, [out]
    # DoRA: the learned magnitude [out]; the output is rescaled by magnitude / ||W + scaling * B @ A||_row.
    magnitude: Optional[torch.Tensor] = None

    @property
    def rank(self) -> int:
        return self.lora_a.shape[0]


@dataclasses.dataclass
class SiteSpec:
    """A LoRA layer of the model: its module path, kind, base weight and every adapter on it."""

    name: str
    kind: str  # "linear" or "embedding"
    in_features: int
    out_features: int
    adapters: Dict[str, AdapterWeights]
    # Why this site can never be rewritten (a LoRA variant, ...); None if it can.
    unsupported: Optional[str] = None
    module: Optional[torch.nn.Module] = dataclasses.field(default=None, repr=False)
    # The reader (adapters/formats/) that made this record: it knows the module's parameters and state-dict keys.
    format: Any = dataclasses.field(default=None, repr=False)
    # Dotted attribute path, from ``module``, of the base layer's weight: how the pass finds the
    # site in a graph whatever adapter is active ("base_layer.weight" for PEFT, "weight" for a
    # module that is its own base layer).  None: the site can only be found through its LoRA branch.
    base_weight_attr: Optional[str] = "base_layer.weight"

    def base_weight(self) -> Optional[torch.Tensor]:
        """The base layer's weight, read from the live module (None if unknown).

        Read anew each time, as ``param_roles``: ``model.to(device)`` replaces it.
        """
        if self.module is None or self.base_weight_attr is None:
            return None
        obj = self.module
        for part in self.base_weight_attr.split("."):
            obj = getattr(obj, part, None)
        return obj if isinstance(obj, torch.Tensor) else None

    def param_roles(self) -> Dict[int, Tuple[str, str]]:
        """id(tensor) -> (adapter, role), read from the live module.

        Read anew each time: ``model.to(xla_device)`` replaces Parameter
        objects, so identities taken at registration would go stale.
        """
        return {id(tensor): role for tensor, role in self.live_tensors()}

    def live_tensors(self) -> List[Tuple[torch.Tensor, Tuple[str, str]]]:
        """``(tensor, (adapter, role))`` for every LoRA tensor of the live module (the format's ``param_roles``)."""
        if self.module is None or self.format is None:
            return []
        return list(self.format.param_roles(self.module, self))

    def base_parameters(self) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """The base layer's weight as ``[out, in]`` and its bias (or None), read from the live module."""
        if self.module is None or self.format is None:
            return None, None
        return self.format.base_parameters(self.module)

    @property
    def has_dora(self) -> bool:
        return any(w.magnitude is not None for w in self.adapters.values())
