"""One static program per bucket, for an inner backend that takes no symbolic shapes (TorchTPU's "tpu").

A rewritten Dynamo graph has symbolic sizes (the token dims, a cache
length) and ``torch.ops.xla_lora`` calls.  At a bucket's first call,
``compile_static`` traces it with ``make_fx`` on fake tensors of that call's
(padded) sizes, with every xla_lora op decomposed into the ATen ops of its
implementation (``kernels.table.decompositions()``).  The result is a graph
of ATen ops whose sizes are all ints, whose inputs are the call's tensors
only: the call's integer arguments (the size symbols) are constants of the
trace.  Each of them is a value of the bucket's program key
(``backend/program_inputs.py``), so a program is only ever called with the
sizes it was traced at.  The inner backend compiles that graph once;
``CompiledLoRAGraph`` keeps the program by its key, so a later call in the
same bucket compiles nothing.
"""
from __future__ import annotations

from typing import Callable, List, Sequence, Tuple

import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx

from ..kernels.table import decompositions


def specialise(gm: fx.GraphModule, example_args: Sequence) -> Tuple[fx.GraphModule, List[int]]:
    """``gm`` traced at the sizes of ``example_args``: (the static ATen graph over the tensor arguments, their
    positions in ``example_args``)."""
    positions = [i for i, a in enumerate(example_args) if isinstance(a, torch.Tensor)]
    # The non-tensor arguments (ints: size symbols) are baked in; the tensors' slots are filled per trace.
    constants = [None if isinstance(a, torch.Tensor) else a for a in example_args]

    def at_these_sizes(*tensors):
        args = list(constants)
        for i, t in zip(positions, tensors):
            args[i] = t
        return gm(*args)

    # Fake tensors without a shape environment: every size a plain int.  Tensors the graph holds as
    # attributes are real, hence _allow_non_fake_inputs.
    static = make_fx(at_these_sizes, decomposition_table=decompositions(), tracing_mode="fake",
                     _allow_non_fake_inputs=True)(*[example_args[i] for i in positions])
    return static, positions


class StaticProgram:
    """A bucket's program: the inner backend's compile of the static graph, called with the tensor arguments."""

    def __init__(self, compiled: Callable, positions: Sequence[int]):
        self.compiled = compiled
        self.positions = tuple(positions)

    def __call__(self, *args):
        return self.compiled(*[args[i] for i in self.positions])


def compile_static(gm: fx.GraphModule, inner: Callable, example_args: Sequence) -> StaticProgram:
    """The program of the bucket of ``example_args``: ``gm`` specialised to their sizes, compiled by ``inner``."""
    static, positions = specialise(gm, example_args)
    return StaticProgram(inner(static, [example_args[i] for i in positions]), positions)
