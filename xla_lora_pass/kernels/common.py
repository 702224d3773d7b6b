"""What every BGMV kernel's ops share: the compute dtype and the registration of a shrink/expand pair.

Every kernel is a pair of ``torch.ops.xla_lora`` custom ops with one calling
convention, which the graph pass relies on (``graph_rewrites.kernel_spec`` and ``graph_rewrites.emit``):

* ``bgmv_shrink<suffix>(x [T, D], w, *inputs, scale=1.0) -> [T, R]``
* ``bgmv_expand<suffix>(x [T, R], w, y [T, O], *inputs, add_inputs=True) -> [T, O]``

where ``inputs`` are the kernel's per-step index tensors (the masked kernel's
token indices, the row kernel's row slots, ...).  ``define_kernel_ops``
registers both from the kernel's check and its two implementations; the
references below define what every pair computes.

Every ``torch.ops.xla_lora`` op's implementation is also an ATen
decomposition (``DECOMPOSITIONS``, filled where each op is defined, by
``define_op``): a compiler given it traces the op into the ATen ops it runs
(inductor fuses them; a backend that takes ATen only gets no custom op).
"""
from __future__ import annotations

from typing import Callable, Dict, Optional, Sequence, Tuple

import torch

__all__ = ["DECOMPOSITIONS", "compute_dtype", "define_kernel_ops", "define_op", "bgmv_shrink_reference",
           "bgmv_expand_reference"]

# Each xla_lora op's overload -> its implementation, which calls ATen ops only (the table make_fx and
# inductor take as ``decompositions``).  Filled by define_op as the op modules are imported.
DECOMPOSITIONS: Dict[torch._ops.OpOverload, Callable] = {}


# Reference implementations: per-token gather, the definition of every kernel's shrink and expand.
def bgmv_shrink_reference(x, w, idx, scale: float = 1.0):
    """The definition of every kernel's shrink: x ``[T, D]``, w ``[N, R, D]``, idx ``[T]`` int32 -> ``[T, R]``::

        for t in range(T):
            s = idx[t]
            out[t] = scale * (w[s] @ x[t]) if s >= 0 else 0      # w[s]: [R, D]

    computed in w's dtype, returned in x's.
    """
    valid = idx >= 0
    wt = w[idx.clamp(min=0).long()]  # [T, R, D]
    out = torch.einsum("td,trd->tr", x.to(w.dtype), wt) * scale
    return torch.where(valid.unsqueeze(-1), out, torch.zeros_like(out)).to(x.dtype)


def bgmv_expand_reference(x, w, y, idx, add_inputs: bool = True):
    """The definition of every kernel's expand: x ``[T, R]``, w ``[N, O, R]``, y ``[T, O]`` -> ``[T, O]``::

        for t in range(T):
            s = idx[t]
            delta = w[s] @ x[t] if s >= 0 else 0                 # w[s]: [O, R]
            out[t] = y[t] + delta if add_inputs else delta

    so a row with idx == -1 is y's row unchanged (zero without add_inputs).
    """
    valid = idx >= 0
    wt = w[idx.clamp(min=0).long()]  # [T, O, R]
    delta = torch.einsum("tr,tor->to", x.to(w.dtype), wt)
    delta = torch.where(valid.unsqueeze(-1), delta, torch.zeros_like(delta))
    if y is None or not add_inputs:
        return delta.to(x.dtype if y is None else y.dtype)
    return y + delta.to(y.dtype)


def compute_dtype(w: torch.Tensor) -> torch.dtype:
    """Low-rank products in fp32 for bf16/fp16 weights: r is small, and the
    delta then rounds once, as in the eager module's own add."""
    return torch.float32 if w.dtype in (torch.bfloat16, torch.float16) else w.dtype


def define_kernel_ops(suffix: str, input_names: Sequence[str], check: Callable, shrink: Callable,
                      expand_delta: Callable, transposed: bool) -> Tuple:
    """Register ``bgmv_shrink<suffix>`` and ``bgmv_expand<suffix>``; returns the two ops.

    ``check(name, x, w, *inputs)`` validates shapes (also under fake tensors);
    ``shrink(x, w, *inputs, scale)`` and ``expand_delta(x, w, *inputs)``
    compute in any dtype (the ops cast back).  ``transposed``: w is
    ``[N, in, out]`` (the rank is its last dim for A, the output width its
    last dim for B) instead of ``[N, out, in]``.
    """
    out_dim = 2 if transposed else 1
    count = len(input_names)
    tensors = "".join(f", Tensor {n}" for n in input_names)
    shrink_name, expand_name = f"bgmv_shrink{suffix}", f"bgmv_expand{suffix}"

    # An explicit schema calls the function with the arguments given, defaults left out: read them here.
    def shrink_impl(x, w, *rest):
        check(shrink_name, x, w, *rest[:count])
        scale = rest[count] if len(rest) > count else 1.0
        return shrink(x, w, *rest[:count], scale).to(x.dtype)

    def shrink_fake(x, w, *rest):
        check(shrink_name, x, w, *rest[:count])
        return x.new_empty((x.shape[0], w.shape[out_dim]))

    def expand_impl(x, w, y, *rest):
        check(expand_name, x, w, *rest[:count])
        torch._check(y.shape == (x.shape[0], w.shape[out_dim]), lambda: f"{expand_name}: y is {tuple(y.shape)}")
        delta = expand_delta(x, w, *rest[:count]).to(y.dtype)
        add_inputs = rest[count] if len(rest) > count else True
        return y + delta if add_inputs else delta

    def expand_fake(x, w, y, *rest):
        check(expand_name, x, w, *rest[:count])
        return torch.empty_like(y)

    shrink_op = define_op(shrink_name, shrink_impl, shrink_fake,
                          schema=f"(Tensor x, Tensor w{tensors}, float scale=1.0) -> Tensor",
                          arg_names=("x", "w", *input_names, "scale"))
    expand_op = define_op(expand_name, expand_impl, expand_fake,
                          schema=f"(Tensor x, Tensor w, Tensor y{tensors}, bool add_inputs=True) -> Tensor",
                          arg_names=("x", "w", "y", *input_names, "add_inputs"))
    return shrink_op, expand_op


def define_op(name: str, impl: Callable, fake: Callable, schema: Optional[str] = None,
              arg_names: Sequence[str] = ()):
    """Register ``torch.ops.xla_lora.<name>`` (functional) from ``impl`` and its fake, and ``impl`` as its
    ATen decomposition in ``DECOMPOSITIONS``; returns the op.

    ``schema``: default inferred from ``impl``'s annotations.  ``arg_names``:
    the schema's argument names in order, for an ``impl`` taking ``*rest``
    (a caller of the decomposition may pass one by keyword; ``impl`` takes them by
    position).
    """
    op = torch.library.custom_op(f"xla_lora::{name}", impl, mutates_args=(), schema=schema)
    op.register_fake(fake)

    def decomposition(*args, **kwargs):
        # Keywords back to positions: only trailing arguments have defaults, so those given follow ``args``.
        rest = [kwargs[n] for n in tuple(arg_names)[len(args):] if n in kwargs]
        return impl(*args, *rest)

    DECOMPOSITIONS[getattr(torch.ops.xla_lora, name).default] = decomposition if arg_names else impl
    return op
