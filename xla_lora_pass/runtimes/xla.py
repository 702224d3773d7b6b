"""torch_xla's ``xla`` device: "openxla", lazy tensors, writes started by a sync, SPMD by annotation.

Every call into torch_xla the package makes is here or in the two modules
this one uses (``xla_cpu_flags.py``: XLA:CPU's scheduler flag, set when the
package is imported; ``xla_layer_norm.py``: ``layer_norm`` with symbolic
sizes).  torch_xla is imported only by the calls that need it, so the
package imports without it.
"""
from __future__ import annotations

import logging
from typing import Callable, List, Optional, Sequence

import torch

from . import xla_cpu_flags, xla_layer_norm, xla_writes
from .generic import Runtime

log = logging.getLogger(__name__)

# PJRT's CPU client took 4-8 ms (median at load 4-6 on 2 cores; 1.8 ms at best) to take one host buffer of
# 256 kB or more, against 0.1 ms for the same 512 kB as 8 pieces of 64 kB in one call
# (_xla_tensors_from_aten), and 0.05 ms for one of 128 kB: a swap's buffer goes as pieces of this size.
SEND_PIECE_BYTES = 64 * 1024


class XLARuntime(Runtime):
    """torch_xla: programs compiled by "openxla", which takes symbolic shapes (each bucket's program is
    still compiled from its static example inputs); tensors are lazy, so a write runs when synced."""

    name = "xla"
    device_type = "xla"
    inner_backend = "openxla"
    compiles_writes = True  # a lazy write is an XLA program per stack shape
    spmd = True

    def open_device(self, name: str) -> torch.device:
        """torch_xla's default device (on the CPU when ``PJRT_DEVICE=CPU``; set it before this call)."""
        import torch_xla

        return torch_xla.device()

    def before_tracing(self) -> None:
        xla_layer_norm.install()  # LayerNorm models need it to bucket
        if xla_cpu_flags.CPU_SCHEDULER_STATUS.startswith("too late"):
            log.warning("XLA:CPU started before xla_lora_pass was imported, so it keeps its breadth-first "
                        "scheduler, measured 1.4x slower on LoRA graphs here: import xla_lora_pass before the "
                        "first torch_xla.device(), or set "
                        "XLA_FLAGS=--xla_cpu_enable_concurrency_optimized_scheduler=false")

    def after_write(self, tensor: torch.Tensor) -> None:
        """Sync the written tensor alone, so the program depends on its shape only (a sync of several would
        compile one program per set of stacks), without waiting, so the writes of one swap run back to back."""
        import torch_xla

        torch_xla._XLAC._xla_sync_multi([tensor], devices=[], wait=False)

    def after_writes(self, tensors: Sequence[torch.Tensor]) -> None:
        """Sync the written tensors together: one program for one swap's writes into every stack (its key is
        the set of stacks and their shapes), started without waiting so the next step's program queues
        behind it."""
        import torch_xla

        torch_xla._XLAC._xla_sync_multi(list(tensors), devices=[], wait=False)

    def send(self, tensors: Sequence[torch.Tensor], device) -> List[List[torch.Tensor]]:
        """One transfer call for all of ``tensors``, each cut into pieces of at most ``SEND_PIECE_BYTES``."""
        import torch_xla

        pieces = [list(t.reshape(-1).split(max(1, SEND_PIECE_BYTES // t.element_size()))) if t.numel() else [t]
                  for t in tensors]
        arrived = iter(torch_xla._XLAC._xla_tensors_from_aten([p for ps in pieces for p in ps],
                                                               [str(device)] * sum(map(len, pieces))))
        return [[next(arrived) for _ in ps] for ps in pieces]

    def write_program(self, write: Callable[..., None], args: Sequence[torch.Tensor],
                      written: Sequence[int]) -> Callable[..., None]:
        """Compiled once and run on each call's device data, nothing traced again (xla_writes.py); traced on
        every call, as elsewhere, under SPMD, where a compiled program is bound to its inputs' shardings and
        ``meta.shard`` may change them after it is compiled."""
        import torch_xla.runtime as xr

        if xr.is_spmd():
            return super().write_program(write, args, written)
        return xla_writes.compile_writes(write, args, written)

    def storage_marks(self, tensors: Sequence[torch.Tensor]) -> List[Optional[int]]:
        """Each tensor's device data handle: a write, through ``.data`` or not, gives it a new one (None while a
        computation is pending: it has no handle yet, which counts as a change)."""
        import torch_xla

        try:
            return list(torch_xla._XLAC._get_tensors_handle(list(tensors)))
        except RuntimeError:  # one of them is a pending computation: ask one by one
            return [_handle(t) for t in tensors]

    def sharding_spec(self, tensor: torch.Tensor) -> Optional[str]:
        import torch_xla

        return torch_xla._XLAC._get_xla_sharding_spec(tensor) or None

    def mark_sharding(self, tensor: torch.Tensor, mesh, spec: tuple) -> None:
        import torch_xla.distributed.spmd as xs

        xs.mark_sharding(tensor, mesh, spec)

    def local_shards(self, tensor: torch.Tensor) -> Optional[List[torch.Tensor]]:
        import torch_xla

        if not self.sharding_spec(tensor):
            return None
        return [shard for shard, _ in torch_xla._XLAC._get_local_shards([tensor])[0]]


def _handle(t: torch.Tensor) -> Optional[int]:
    import torch_xla

    try:
        return torch_xla._XLAC._get_tensors_handle([t])[0]
    except RuntimeError:
        return None


RUNTIME = XLARuntime()
