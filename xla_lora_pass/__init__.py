"""xla-lora-pass: a torch.compile backend that rewrites LoRA layers into BGMV calls.

    meta = xlp.LoRAMetadata(max_num_tokens=8192)
    slots = meta.register_adapters(peft_model)
    model = torch.compile(peft_model, backend=xlp.make_backend(meta))
    meta.set_token_adapters(["a", "a", None, "b", ...])
    out = model(input_ids=ids)
"""
from __future__ import annotations

from . import xla_cpu_flags  # first: XLA reads XLA_FLAGS when its runtime starts
from . import config, ops  # ops before the passes: registers torch.ops.xla_lora
from .backend import LoRABackend, make_backend
from .errors import UnsupportedAdapterError, UnsupportedMappingError
from .adapter_pool import SlotCapacityError
from .bucketing import Buckets
from .metadata import NO_LORA, LoRAMetadata
from .rewrite import capture_graphs, rewrite

_default_metadata = None


def default_metadata() -> LoRAMetadata:
    """The process-wide metadata used by ``torch.compile(m, backend="xla_lora")``."""
    global _default_metadata
    if _default_metadata is None:
        _default_metadata = LoRAMetadata()
    return _default_metadata


def xla_lora_backend(gm, example_inputs):
    """Entry point for ``backend="xla_lora"``: the default metadata, default buckets."""
    backend = getattr(xla_lora_backend, "_backend", None)
    if backend is None or backend.meta is not default_metadata():
        backend = xla_lora_backend._backend = make_backend(default_metadata())
    return backend(gm, example_inputs)


__all__ = [
    "Buckets", "LoRABackend", "SlotCapacityError", "capture_graphs", "LoRAMetadata", "NO_LORA", "UnsupportedAdapterError",
    "UnsupportedMappingError", "config",
    "default_metadata", "make_backend", "ops", "rewrite", "xla_lora_backend",
]
