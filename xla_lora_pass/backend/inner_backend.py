"""The compile backend each bucket's program goes to, and inductor given the kernels' decompositions.

Inductor calls a custom op it has no decomposition for as an opaque kernel,
outside its fused code.  Given each ``torch.ops.xla_lora`` op's ATen
decomposition (``kernels.table.decompositions()``, the op's own
implementation), it traces the op into those ATen ops and fuses them with
their neighbours.  It computes what the op computes (the decomposition is
its implementation); fused code may round fp32 differently in the last bits
(tests/test_static_programs.py holds the model to 1e-4 of PEFT's).  Every
other backend ("openxla", "tpu", ``aot_eager``, a callable) is looked up
unchanged.
"""
from __future__ import annotations

from typing import Callable, Sequence, Union

from .. import runtimes
from ..kernels.table import decompositions

INDUCTOR = "inductor"


def inner_compiler(inner: Union[str, Callable, None], example_inputs: Sequence) -> Callable:
    """The compile backend each bucket's program goes to: ``inner`` (a backend or its registered name), else
    the inner backend of the runtime of the graph's inputs (runtimes/: "openxla", "tpu" or "inductor").
    "inductor", by name, is ``inductor_decomposing_kernels``."""
    if inner is None:
        inner = runtimes.for_inputs(example_inputs).inner_backend
    if inner == INDUCTOR:
        return inductor_decomposing_kernels
    if isinstance(inner, str):
        from torch._dynamo import lookup_backend

        return lookup_backend(inner)
    return inner


def inductor_decomposing_kernels(gm, example_inputs):
    """Inductor's ``compile_fx`` with its default decompositions and every xla_lora op's."""
    from torch._inductor.compile_fx import compile_fx
    from torch._inductor.decomposition import select_decomp_table

    return compile_fx(gm, example_inputs, decompositions={**select_decomp_table(), **decompositions()})
