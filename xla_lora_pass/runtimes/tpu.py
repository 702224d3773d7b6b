"""TorchTPU's ``tpu`` device (package ``torch_tpu``): compile backend "tpu", static shapes only.

UNTESTED on a TPU: ``torch_tpu`` is not installed where this package is
tested.  Written against TorchTPU's announced interface, and assuming:

- ``torch_tpu`` registers its device as PyTorch's PrivateUse1 backend
  renamed ``tpu`` (so its tensors' ``device.type`` is ``"tpu"``) and its
  ``torch.compile`` backend as "tpu", both when it is imported, which a
  program with tensors on that device has done;
- the "tpu" backend lowers an FX graph to StableHLO and accepts static
  shapes only, so it gets one graph per bucket specialised to the bucket's
  sizes (``static_shapes``);
- tensors are eager, with real storage, and ordered on the device like
  CUDA's: a stack written in place needs no sync (``after_write`` does
  nothing), and a write is not a compiled program per shape, so nothing is
  warmed when a stack is first sent; a tensor's data pointer changes when it
  gets new storage (``storage_marks`` as on the CPU);
- ``meta.shard`` (torch_xla SPMD annotations) does not apply: TorchTPU
  splits tensors with DTensor, which the stacks do not follow yet.

This package imports ``torch_tpu`` only in ``open_device`` and never
requires it.  tests/test_runtimes.py checks, on the CPU, that fake tensors of
a PrivateUse1 device renamed ``tpu`` get this runtime, a stand-in "tpu"
compile backend and ``static_shapes``; nothing here ran on a TPU.
"""
from __future__ import annotations

import torch

from .generic import Runtime


class TorchTPURuntime(Runtime):
    """TorchTPU: programs compiled by "tpu" from one static graph per bucket."""

    name = "torch_tpu"
    device_type = "tpu"
    inner_backend = "tpu"
    static_shapes = True

    def open_device(self, name: str) -> torch.device:
        import torch_tpu  # noqa: F401  registers the "tpu" device and compile backend

        return torch.device(name)


RUNTIME = TorchTPURuntime()
