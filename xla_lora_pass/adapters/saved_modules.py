"""Find PEFT's ``modules_to_save`` and read each variant's tensors.

PEFT wraps a saved module (``modules_to_save=["lm_head"]``, every
``SEQ_CLS`` model's head) in a ``ModulesToSaveWrapper``: ``original_module``
serves the base model, ``modules_to_save[adapter]`` is one adapter's full
copy.  The pass (``graph_rewrites/passes/saved_modules.py``) runs every variant in
one batch; this module tells it which modules those are and feeds each
variant's tensors.  A kind of wrapper that cannot be served exactly is
refused here, by name, at ``register_adapters``.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, Iterator, Optional, Tuple

import torch

ORIGINAL = None  # the variant name of the original module (rows on the base model)


@dataclasses.dataclass
class SavedModuleSpec:
    """One saved module: its path, its wrapper, and the adapters that have their own copy."""

    name: str
    wrapper: torch.nn.Module = dataclasses.field(repr=False)
    adapters: Tuple[str, ...]

    def variant(self, adapter: Optional[str]) -> torch.nn.Module:
        """The module that computes ``adapter``'s rows (the original for None or an adapter without a copy)."""
        if adapter is not None and adapter in self.adapters:
            return self.wrapper.modules_to_save[adapter]
        return self.wrapper.original_module

    def tensors(self, adapter: Optional[str]) -> Dict[str, torch.Tensor]:
        """The variant's parameters and buffers by name, read from the live module."""
        module = self.variant(adapter)
        return {**dict(module.named_parameters()), **dict(module.named_buffers())}

    @property
    def module_key(self) -> str:
        """The wrapper's key in Dynamo's ``meta["nn_module_stack"]``: its identity."""
        return str(id(self.wrapper))


def _wrapper_types():
    try:
        from peft.utils.other import ModulesToSaveWrapper
    except ImportError:  # peft is optional
        return None, None
    try:
        from peft.utils.other import AuxiliaryTrainingWrapper  # newer peft: the base of every such wrapper
    except ImportError:
        AuxiliaryTrainingWrapper = ModulesToSaveWrapper
    return ModulesToSaveWrapper, AuxiliaryTrainingWrapper


def _layout(module: torch.nn.Module) -> Dict[str, Tuple]:
    return {name: (tuple(t.shape), t.dtype) for name, t in
            {**dict(module.named_parameters()), **dict(module.named_buffers())}.items()}


def iter_saved_modules(model: torch.nn.Module) -> Iterator[SavedModuleSpec]:
    """Yield every PEFT saved module of ``model``; refuse, by name, one that cannot be served exactly."""
    saved_type, aux_type = _wrapper_types()
    if saved_type is None:
        return
    for name, module in model.named_modules():
        if not isinstance(module, aux_type):
            continue
        if not isinstance(module, saved_type):
            raise ValueError(
                f"register_adapters: {name} is a PEFT {type(module).__name__}, which the pass cannot serve per "
                "token (only modules_to_save copies are served); merge it into the model or drop it")
        adapters = tuple(module.modules_to_save.keys())
        original = _layout(module.original_module)
        for adapter in adapters:
            copy = module.modules_to_save[adapter]
            if type(copy) is not type(module.original_module) or _layout(copy) != original:
                raise ValueError(
                    f"register_adapters: modules_to_save {name}: adapter {adapter!r}'s copy is a "
                    f"{type(copy).__name__} with tensors {_layout(copy)}, not the original "
                    f"{type(module.original_module).__name__}'s {original}; every copy must be the original's "
                    "structure to run in one batch")
        yield SavedModuleSpec(name, module, adapters)
