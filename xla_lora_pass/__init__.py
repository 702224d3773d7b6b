"""xla-lora-pass: a torch.compile backend that rewrites LoRA layers into BGMV calls.

    meta = xlp.LoRAMetadata(max_num_tokens=8192)
    slots = meta.register_adapters(peft_model)
    model = torch.compile(peft_model, backend=xlp.make_backend(meta))
    meta.set_token_adapters(["a", "a", None, "b", ...])
    out = model(input_ids=ids)
"""
from __future__ import annotations

from .runtimes import xla_cpu_flags  # first: XLA reads XLA_FLAGS when its runtime starts
from . import config
from .kernels import table as _kernel_table  # noqa: F401  registers torch.ops.xla_lora before any pass runs
from .backend import LoRABackend, make_backend
from .backend.rewrite import capture_graphs, rewrite
from .errors import AdapterFileError, AdapterFileNotFoundError, UnsupportedAdapterError, UnsupportedMappingError
from .metadata import NO_LORA, LoRAMetadata
from .metadata.pool import SlotCapacityError
from .shapes import Buckets

_default = None  # (metadata, backend) that backend="xla_lora" uses, made on first need


def _default_backend() -> LoRABackend:
    global _default
    if _default is None:
        meta = LoRAMetadata()
        _default = (meta, make_backend(meta))  # made now, so the model registered later is served by it
    return _default[1]


def default_metadata() -> LoRAMetadata:
    """The process-wide metadata used by ``torch.compile(m, backend="xla_lora")``."""
    return _default_backend().meta


def xla_lora_backend(gm, example_inputs):
    """Entry point for ``backend="xla_lora"``: the default metadata, default buckets."""
    return _default_backend()(gm, example_inputs)


__all__ = [
    "AdapterFileError", "AdapterFileNotFoundError", "Buckets", "LoRABackend", "SlotCapacityError", "capture_graphs",
    "LoRAMetadata", "NO_LORA", "UnsupportedAdapterError", "UnsupportedMappingError", "config",
    "default_metadata", "make_backend", "rewrite", "xla_lora_backend",
]
