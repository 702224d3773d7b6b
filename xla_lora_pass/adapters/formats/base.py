"""What a reader of one adapter format provides (``AdapterFormat``), and the one-adapter-per-layer case."""
from __future__ import annotations

import importlib
from typing import Iterator, List, Optional, Tuple

import torch

from ..records import AdapterWeights, SiteSpec
from ...errors import UnsupportedAdapterError


def optional_module(name: str):
    """The module ``name``, or None when its library is not installed (every client library is optional)."""
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


class AdapterFormat:
    """One LoRA library's layers, read into ``SiteSpec`` records.  Subclasses override what differs."""

    name = "?"

    def claims(self, module: torch.nn.Module) -> bool:
        """Whether ``module`` is a LoRA layer of this format."""
        raise NotImplementedError

    def read(self, path: str, module: torch.nn.Module, adapter_name: str) -> Optional[SiteSpec]:
        """The site record of a claimed layer (None if it holds no adapter); raises UnsupportedAdapterError."""
        raise NotImplementedError

    def param_roles(self, module, site: SiteSpec) -> Iterator[Tuple[torch.Tensor, Tuple[str, str]]]:
        """``(tensor, (adapter, role))`` for every LoRA tensor of the live module: its parameters, and any
        tensor its forward scales the delta by (role "scaling", PEFT after ``prepare_model_for_compiled_hotswap``)."""
        raise NotImplementedError

    def computed_adapters(self, module, site: SiteSpec) -> List[str]:
        """The adapters the layer adds when it runs eagerly ([] when it computes the base model only)."""
        return list(site.adapters)

    def value_sources(self, site: SiteSpec, adapter: str) -> List[Tuple[dict, str]]:
        """``(dictionary, key)`` of each number of ``adapter``'s at this layer that its traced forward may not
        read (so Dynamo does not guard it) and a call must see change: PEFT's float scaling of each adapter."""
        return []

    def merged_adapters(self, site: SiteSpec) -> List[str]:
        """The adapters the layer has merged into its base weight, so that every token gets them (none unless
        the library merges: PEFT's ``merge_adapter``, loralib's ``eval()`` with ``merge_weights=True``)."""
        return []

    def split_key(self, key: str) -> Optional[Tuple[str, str]]:
        """(module path, role) of one of this format's state-dict keys, or None if the key is not one."""
        raise NotImplementedError

    def default_scaling(self, site: SiteSpec, rank: int) -> Optional[float]:
        """The scaling an adapter of ``rank`` (rows of its stacked A) loaded at ``site`` gets when load_adapter
        is given none."""
        return None

    def stack_pair(self, where: str, site: SiteSpec, lora_a: torch.Tensor,
                   lora_b: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """A state dict's A and B of ``site`` as the stacks hold them (A ``[r, in]``, B ``[out, r]``).

        The identity unless the format lays an adapter out otherwise
        (loralib's ``MergedLinear``); raises ValueError for tensors of the
        wrong shape for that layout.
        """
        return lora_a, lora_b

    def base_parameters(self, module) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """The base layer's weight as ``[out, in]`` and its bias (None when absent); DoRA folds them."""
        return getattr(module, "weight", None), getattr(module, "bias", None)


class OneAdapterFormat(AdapterFormat):
    """Layers that hold one adapter as two parameters (torchtune, loralib, hand-written modules).

    ``lora_params(module)`` names them relative to the layer, as in its
    state dict (``("lora_a.weight", "lora_b.weight")`` for torchtune).
    """

    def lora_params(self, module) -> Tuple[str, str]:
        raise NotImplementedError

    def scaling_of(self, module) -> float:
        raise NotImplementedError

    def is_enabled(self, module) -> bool:
        return True

    def read(self, path, module, adapter_name):
        a_name, b_name = self.lora_params(module)
        lora_a, lora_b = module.get_parameter(a_name), module.get_parameter(b_name)
        if lora_a.dim() != 2 or lora_b.dim() != 2 or lora_b.shape[1] != lora_a.shape[0]:
            raise UnsupportedAdapterError(
                f"{self.name} LoRA layer {path!r}: expected {a_name} [r, in] and {b_name} [out, r], got "
                f"{list(lora_a.shape)} and {list(lora_b.shape)}")
        weights = AdapterWeights(lora_a, lora_b, float(self.scaling_of(module)))
        return SiteSpec(path, self.kind_of(module), lora_a.shape[1], lora_b.shape[0], {adapter_name: weights},
                        module=module, base_weight_attr=self.base_weight_attr(module))

    def base_weight_attr(self, module) -> Optional[str]:
        """The dotted path of the base layer's weight from the layer (``SiteSpec.base_weight_attr``)."""
        return "weight" if isinstance(getattr(module, "weight", None), torch.Tensor) else None

    def kind_of(self, module) -> str:
        return "linear"

    def param_roles(self, module, site):
        (adapter,) = site.adapters
        a_name, b_name = self.lora_params(module)
        yield module.get_parameter(a_name), (adapter, "A")
        yield module.get_parameter(b_name), (adapter, "B")

    def computed_adapters(self, module, site):
        return list(site.adapters) if self.is_enabled(module) else []

    def split_key(self, key):
        for pair in self.key_suffixes():
            for role, rel in zip("AB", pair):
                if key == rel:
                    return "", role
                if key.endswith("." + rel):
                    return key[: -len(rel) - 1], role
        return None

    def key_suffixes(self) -> Tuple[Tuple[str, str], ...]:
        """The (A, B) parameter names layers of this format use in their state dicts, longest first."""
        raise NotImplementedError

    def default_scaling(self, site, rank):
        (weights,) = site.adapters.values()
        return weights.scaling if rank == weights.rank else None
