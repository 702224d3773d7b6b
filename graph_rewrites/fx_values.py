"""Reading the values Dynamo records on FX nodes: torch and sympy only, no LoRA.

The one place that knows where a node's fake value lives and how a size
becomes a sympy expression; the patterns (``fx_utils``) and the shape
bucketing (``xla_lora_pass.bucketing``, which must know no LoRA) both read
values through it.
"""
from __future__ import annotations

from typing import Any, Union

import sympy
import torch
import torch.fx as fx

VALUE_KEY = "example_value"  # Dynamo-level graphs keep their fake values here


def example_value(node: Any) -> Any:
    """The node's fake value (Dynamo keeps it in ``example_value``); literals pass through."""
    if isinstance(node, fx.Node):
        return node.meta.get(VALUE_KEY, node.meta.get("val"))
    return node


def size_expr(d: Union[int, torch.SymInt]) -> Union[int, sympy.Expr]:
    """A size as a plain int, or a SymInt as its sympy expression (reading it adds no shape guard)."""
    return d.node.expr if isinstance(d, torch.SymInt) else int(d)
