"""Every form Dynamo records a transpose in, across torch versions: one predicate for the passes.

``w.T`` is ``getattr(w, "T")`` on torch 2.9 and ``aten.numpy_T(w)`` on newer
torch; ``w.mT`` is ``getattr(w, "mT")`` or ``aten.mT(w)``; ``w.H`` /
``w.mH`` likewise (``aten.matrix_H`` / ``aten.mH``).  Methods and functions
(``t``, ``transpose``, ``swapaxes``, ``permute``, ...) are recorded as
written.  The ``normalize`` pass turns every transpose of a LoRA weight into
``w.t()`` with ``is_matrix_transpose``, so the patterns see one form; the
other passes ask the same predicate where they meet a transpose of a weight
or an activation.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from .fx_values import example_value

# Attribute reads that swap the last two dims (on a 2-d tensor: its transpose); H/mH conjugate too.
_ATTRS = {"T", "mT", "H", "mH"}
_CONJUGATING = {"H", "mH", "adjoint"}
# The aten ops newer Dynamo records those attribute reads as (overload packets; overloads map to them).
_ATEN_ATTRS = {"numpy_T": "T", "mT": "mT", "matrix_H": "H", "mH": "mH"}
_NO_ARG = {"t", "adjoint"}  # methods, and torch.t / torch.adjoint
_TWO_DIMS = {"transpose", "swapaxes", "swapdims"}
_PERMUTE = {"permute"}
# Everything that can move dims, for passes that only need to know rows may have moved.
_REORDERING = _NO_ARG | _TWO_DIMS | _PERMUTE | {"movedim", "moveaxis"}


def _aten_attr(target) -> str:
    """The attribute an aten op stands for (``aten.numpy_T`` -> "T"), or ""."""
    packet = getattr(target, "overloadpacket", target)
    if not isinstance(packet, torch._ops.OpOverloadPacket):
        return ""
    namespace, _, name = packet._qualified_op_name.partition("::")
    return _ATEN_ATTRS.get(name, "") if namespace == "aten" else ""


def aten_attribute(node: fx.Node) -> str:
    """The attribute read a call of an aten op stands for ("T" for ``aten.numpy_T(x)``, newer torch's record of
    ``x.T``), or "" for any other node."""
    return _aten_attr(node.target) if node.op == "call_function" and len(node.args) == 1 and not node.kwargs else ""


def op_name(node: fx.Node) -> str:
    """The transpose-like operation a call node performs, as a method name ("T" for ``.T``), or ""."""
    if node.op == "call_method":
        return node.target
    if node.op != "call_function":
        return ""
    if node.target is getattr and len(node.args) == 2 and node.args[1] in _ATTRS:
        return node.args[1]
    attr = _aten_attr(node.target)
    if attr:
        return attr
    if getattr(torch, getattr(node.target, "__name__", ""), None) is node.target:
        return node.target.__name__  # torch.t, torch.transpose, torch.permute, ...
    return ""


def reorders_dims(node: fx.Node) -> bool:
    """Whether the node is any transpose or permutation (its result's rows need not be its input's)."""
    return op_name(node) in _REORDERING | _ATTRS


def _dims(node: fx.Node):
    """The dim arguments after the tensor, flattened (``permute((1, 0))`` and ``permute(1, 0)`` alike)."""
    if node.op == "call_function" and node.target is getattr:
        return []
    rest = list(node.args[1:])
    if len(rest) == 1 and isinstance(rest[0], (tuple, list)):
        rest = list(rest[0])
    for key in ("dim0", "dim1", "axis0", "axis1", "dims"):
        if key in node.kwargs:
            value = node.kwargs[key]
            rest.extend(value if isinstance(value, (tuple, list)) else [value])
    return rest


def is_matrix_transpose(node: fx.Node) -> bool:
    """Whether ``node`` is the transpose of a real 2-d tensor (its first argument), in any recorded form."""
    if node.op not in ("call_function", "call_method") or not node.args or not isinstance(node.args[0], fx.Node):
        return False
    value = example_value(node.args[0])
    if not isinstance(value, torch.Tensor) or value.dim() != 2:
        return False
    name = op_name(node)
    if name in _CONJUGATING and value.is_complex():
        return False
    if name in _ATTRS or name in _NO_ARG:
        return not _dims(node)
    dims = _dims(node)
    if not all(isinstance(d, int) for d in dims):
        return False
    if name in _TWO_DIMS:
        return len(dims) == 2 and {d % 2 for d in dims} == {0, 1}
    if name in _PERMUTE:
        return [d % 2 for d in dims] == [1, 0]
    return False
