"""The device layer: one ``Runtime`` per device runtime, chosen by the device a tensor is on.

``generic.py`` is the base and the runtime of CPU and CUDA (inductor);
``xla.py`` torch_xla's ``xla`` device ("openxla"); ``tpu.py`` TorchTPU's
``tpu`` device ("tpu", static shapes only).  A new runtime is one module with
a ``Runtime`` subclass and one entry in ``RUNTIMES``.  Nothing here imports
torch_xla or torch_tpu: their calls import them when made.
"""
from __future__ import annotations

from typing import Dict, Iterable

import torch

from . import tpu, xla
from .generic import GENERIC, Runtime

RUNTIMES: Dict[str, Runtime] = {r.device_type: r for r in (xla.RUNTIME, tpu.RUNTIME)}


def for_device(device) -> Runtime:
    """The runtime of ``device`` (a ``torch.device`` or its string); the generic one for any device without
    a runtime of its own."""
    kind = device.type if isinstance(device, torch.device) else str(device).split(":")[0]
    return RUNTIMES.get(kind, GENERIC)


def open_device(name: str) -> torch.device:
    """The device called ``name`` (``"xla"``, ``"tpu"``, ``"cpu"``, ``"cuda"``), importing its runtime's package
    (torch_xla, torch_tpu) first: how the demo and ``xla-lora-dump --device`` get theirs."""
    return for_device(name).open_device(name)


def for_inputs(values: Iterable) -> Runtime:
    """The runtime of a graph's inputs: the first tensor's on a device with a runtime of its own (a graph
    on such a device may still take host tensors), else the generic one."""
    for value in values:
        if isinstance(value, torch.Tensor):
            runtime = RUNTIMES.get(value.device.type)
            if runtime is not None:
                return runtime
    return GENERIC


def static_shapes_only(inner, values: Iterable) -> bool:
    """Whether the inner backend takes static shapes only (then it gets one graph per bucket, specialised to
    the bucket's sizes): ``inner=None`` is the inputs' runtime's own backend, a name is the runtime's whose
    backend it names (TorchTPU's "tpu"), and any other backend takes symbolic shapes."""
    if inner is None:
        return for_inputs(values).static_shapes
    return isinstance(inner, str) and any(r.static_shapes for r in RUNTIMES.values() if r.inner_backend == inner)


def before_tracing() -> None:
    """Every runtime's preparations for Dynamo's tracing (each does nothing where its package is absent)."""
    for runtime in RUNTIMES.values():
        runtime.before_tracing()


__all__ = ["GENERIC", "RUNTIMES", "Runtime", "before_tracing", "for_device", "for_inputs", "open_device",
           "static_shapes_only"]
