"""``Runtime``: what the backend and the metadata do differently per device, as CPU and CUDA do it.

Every runtime is one ``Runtime`` (a subclass for a device that differs, in a
module of its own: ``xla.py``, ``tpu.py``), chosen per device by
``runtimes.for_device``.  This base is the runtime of every device without a
module of its own: eager tensors with real storage, compiled by inductor,
which takes symbolic shapes, so a stack written in place needs nothing more
and there is no mesh to place tensors over.
"""
from __future__ import annotations

from typing import Callable, List, Optional, Sequence

import torch


class Runtime:
    """One device runtime: its inner compile backend and the few device calls the package makes."""

    name = "generic"
    device_type: Optional[str] = None  # the torch device type this runtime serves (None: every other one)
    inner_backend = "inductor"  # the torch.compile backend each bucket's program goes to unless inner= says
    # Whether the inner backend takes symbolic shapes: False hands it one graph specialised to each
    # bucket's sizes instead (backend/compiled_graph.py reads it through make_backend).
    static_shapes = False
    # Whether an in-place write into a stack is a compiled program per shape, to be compiled when the
    # stack is first sent rather than at the first swap (metadata/device_stacks.py).
    compiles_writes = False
    # Whether tensors are placed over a mesh by annotating them (``meta.shard``, metadata/sharding.py).
    spmd = False

    def open_device(self, name: str) -> torch.device:
        """The device called ``name`` (``"cpu"``, ``"cuda:1"``), its runtime's package imported first if it has one."""
        return torch.device(name)

    def before_tracing(self) -> None:
        """Make ready whatever Dynamo's tracing needs on this runtime (``make_backend`` calls it)."""

    def after_write(self, tensor: torch.Tensor) -> None:
        """Start the in-place write just made into ``tensor`` (eager devices already have)."""

    def after_writes(self, tensors: Sequence[torch.Tensor]) -> None:
        """Start the in-place writes just made into ``tensors`` (one swap's: metadata/slot_swap.py)."""
        for tensor in tensors:
            self.after_write(tensor)

    def send(self, tensors: Sequence[torch.Tensor], device) -> List[List[torch.Tensor]]:
        """Copies of host ``tensors`` on ``device``, sent in one call where the runtime has one, each as the
        pieces it went in (``joined`` makes it whole inside the program that reads it): a swap's buffer and
        slot numbers (metadata/slot_swap.py)."""
        return [[t.to(device)] for t in tensors]

    @staticmethod
    def joined(pieces: Sequence[torch.Tensor], shape: torch.Size) -> torch.Tensor:
        """The tensor of ``shape`` that ``send`` sent as ``pieces``."""
        whole = pieces[0] if len(pieces) == 1 else torch.cat(list(pieces))
        # No view op unless needed: on XLA a tensor read as device data in one program and through a view in
        # another makes them two programs (measured: a swap compiled again after warm-up).
        return whole if whole.shape == shape else whole.view(shape)

    def write_program(self, write: Callable[..., None], args: Sequence[torch.Tensor],
                      written: Sequence[int]) -> Callable[..., None]:
        """``write`` (in place into ``args[i]`` for ``i`` in ``written``, returning nothing) as a callable for
        arguments shaped as ``args`` that also starts the writes: here ``write`` itself, then ``after_writes``
        (a runtime that traces ops again on every call compiles it once instead: xla.py)."""

        def run(*values: torch.Tensor) -> None:
            write(*values)
            self.after_writes([values[i] for i in written])

        return run

    def storage_marks(self, tensors: Sequence[torch.Tensor]) -> List[Optional[int]]:
        """Each tensor's storage, as a value that changes when the tensor gets new storage (its data pointer)."""
        return [t.data_ptr() for t in tensors]

    def sharding_spec(self, tensor: torch.Tensor) -> Optional[str]:
        """The tensor's sharding over a mesh as an XLA spec string; None when the runtime places nothing."""
        return None

    def mark_sharding(self, tensor: torch.Tensor, mesh, spec: tuple) -> None:
        """Place ``tensor`` over ``mesh`` split as ``spec`` (a partition spec), in place."""
        raise ValueError(f"placing tensors over a mesh needs torch_xla's SPMD; this tensor is on {tensor.device}")

    def local_shards(self, tensor: torch.Tensor) -> Optional[List[torch.Tensor]]:
        """The tensor's shards on this host's devices; None when it is not split over a mesh."""
        return None

    def __repr__(self) -> str:
        return f"<{self.name} runtime: inner {self.inner_backend!r}>"


GENERIC = Runtime()
