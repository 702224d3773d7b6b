"""What selects a graph's program and what reaches it: the program key and contiguous varying inputs.

A ``CompiledLoRAGraph`` keeps one program per key, compiled by the inner
backend from the first call's inputs.  Inductor specialises a program on its
inputs' sizes and strides; XLA on sizes.  The key holds the sizes; strides
are made the same for every call instead (``contiguous``).

Newer Dynamo (torch 2.14, under ``dynamic=True`` or once a float attribute
had two values) lifts a Python float the model reads (``F.embedding``'s
``norm_type``, an RMSNorm's ``variance_epsilon``) to a 0-d tensor input read
with ``.item()``.  Dynamo's own inductor compiles that inside its tracing
context; the programs here are compiled later, per bucket, where the fake
tensors of aot_autograd and ``make_fx`` refuse a data-dependent scalar
(``DataDependentOutputException``).  So each such input's value is part of
the key and its reads are constants of the program (``program_graph``): one
program per value, as torch 2.9 gets by baking the float in and guarding
on it.
"""
from __future__ import annotations

from typing import Dict, Sequence

import sympy
import torch
import torch.fx as fx

from ..shapes.bucketing import GraphShapes
from .rewrite import copy_graph_module


class ProgramInputs:
    """The key and the input preparation of one graph's programs."""

    def __init__(self, gm: fx.GraphModule, num_args: int, shapes: GraphShapes):
        # The inputs whose sizes vary between calls (a size symbol in a dim).
        self.varying = tuple(i for i, (kind, dims) in enumerate(shapes.inputs)
                             if kind == "tensor" and not all(isinstance(d, int) for d in dims))
        self.unread_symbols = unread_symbols(gm, num_args, shapes)
        # The inputs whose value the graph reads as a Python number (``x.item()``): constants of each program.
        self.read_values = tuple(i for i, node in enumerate(list(gm.graph.find_nodes(op="placeholder"))[:num_args])
                                 if any(_is_item(user) for user in node.users))

    def key(self, padded: Dict[sympy.Symbol, int], args: Sequence) -> tuple:
        """One program per key: every size symbol's value (padded for token dims, real for the others), and
        the value of every input the graph reads with ``.item()``.

        A program is specialised on every size of its inputs, not only the
        token dims: a KV-cache or encoder length that changes under the same
        token dims must get its own program, never reuse another's.  Strides
        need no place in it: the inputs whose sizes vary reach the programs
        contiguous, and a symbol nothing reads is left out.
        """
        sizes = tuple((str(s), padded[s]) for s in sorted(padded, key=str) if s not in self.unread_symbols)
        return sizes + tuple((i, args[i].item()) for i in self.read_values)

    def program_graph(self, gm: fx.GraphModule, args: Sequence) -> fx.GraphModule:
        """``gm`` with every ``.item()`` of an input in ``read_values`` replaced by that input's value in
        ``args`` (a copy; ``gm`` itself when there is none)."""
        if not self.read_values:
            return gm
        out = copy_graph_module(gm)
        placeholders = list(out.graph.find_nodes(op="placeholder"))
        for i in self.read_values:
            value = args[i].item()
            for user in [u for u in placeholders[i].users if _is_item(u)]:
                for reader in list(user.users):
                    reader.args = fx.node.map_arg(reader.args, lambda a: value if a is user else a)
                    reader.kwargs = fx.node.map_arg(reader.kwargs, lambda a: value if a is user else a)
                out.graph.erase_node(user)
        out.recompile()
        return out

    def contiguous(self, args: Sequence) -> list:
        """``args`` with every input whose sizes vary made contiguous.

        Inductor checks each input's strides against its program's: a padded
        input is a new contiguous tensor, so an input at exactly the bucket's
        size that is a strided slice (``ids[:, :16]`` of a wider buffer) would
        fail the check of a program compiled for a padded call (or, compiled
        first, make the padded calls fail).  Made contiguous, a strided input
        costs a copy, no more than padding it costs; keying on strides
        instead would compile a second program for the bucket.  Inputs of
        fixed sizes (the weights) keep their strides, which Dynamo guards.
        """
        if all(args[i].is_contiguous() for i in self.varying):
            return list(args)
        out = list(args)
        for i in self.varying:
            out[i] = out[i].contiguous()
        return out


def unread_symbols(gm: fx.GraphModule, num_args: int, shapes: GraphShapes) -> frozenset:
    """The size symbols that are integer inputs no node reads and no input's size holds: left out of the keys.

    Dynamo lifts the stride of a strided input as such a symbol (after a call
    with ``ids[:, :n]`` of a wider buffer, its graph takes the buffer's width).
    The inputs reach the programs contiguous, so its value selects nothing;
    keyed on it, every contiguous call of a new length would compile a program
    of its own.
    """
    placeholders = list(gm.graph.find_nodes(op="placeholder"))[:num_args]
    sized = set()
    for kind, dims in shapes.inputs:
        if kind == "tensor":
            sized.update(*(d.free_symbols for d in dims if not isinstance(d, int)))
    return frozenset(s for s, (i, dim) in shapes.sources.items()
                     if dim is None and not placeholders[i].users and s not in sized)


def _is_item(node: fx.Node) -> bool:
    """``node`` reads a 0-d tensor's value as a Python number (Dynamo's ``.item()``, or ATen's after tracing)."""
    return ((node.op == "call_method" and node.target == "item")
            or (node.op == "call_function" and node.target in (torch.ops.aten._local_scalar_dense.default,
                                                                torch.ops.aten.item.default)))
