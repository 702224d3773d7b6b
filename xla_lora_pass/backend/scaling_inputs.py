"""PEFT float scalings that Dynamo made graph inputs, and the per-call check that the stacks still hold them.

torch 2.9 bakes PEFT's float ``scaling[adapter]`` into the graph as a
constant and guards on it (a change retraces, and the rewrite compares the
constant with the stacked scaling).  Newer Dynamo with ``dynamic=True``
(torch 2.14) makes the float a 0-d float64 tensor input instead, read with
``.item()``: no guard, a change reaches the same program as a new value.

The rewrite serves such a site when the input's value is the registered
adapter's scaling: the stacked B carries it, so the rewritten program reads
the input no more.  Because the value is a per-call input, each call checks
it against the stacked scaling first (``ScalingInputs.check``): a model
adapter whose float changed is read again from the model and re-stacked
(``LoRAMetadata.follow_scalings``), and if the stacks still cannot hold the
value the call is refused naming the adapter, never run with a stale
scaling.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.fx as fx

from graph_rewrites import LoRAWeightRef, RewriteReport
from graph_rewrites.dynamo_sources import node_source_name

from ..adapters.formats.peft import scaling_from_source
from ..metadata.model_weights import SCALING_TOLERANCE

# placeholder.meta key: (site, adapter) of a PEFT float scaling Dynamo lifted to a graph input.
SCALING_INPUT = "xla_lora_scaling_input"


def scaling_input_pair(meta, node: fx.Node, tensor) -> Optional[Tuple[str, str]]:
    """(site, adapter) if ``node`` is a registered adapter's float scaling lifted to a 0-d tensor input."""
    if not isinstance(tensor, torch.Tensor) or tensor.dim() != 0 or not tensor.is_floating_point():
        return None
    name = node_source_name(node)
    hit = scaling_from_source(name) if name is not None else None
    if hit is None or hit[0] not in meta.sites or hit[1] not in meta.sites[hit[0]].adapters:
        return None
    return hit


def scaling_ref(ref: LoRAWeightRef, tensor: torch.Tensor) -> LoRAWeightRef:
    """The input's ref (role "scaling"), unsupported when its value is not the adapter's stacked scaling."""
    value = float(tensor)
    if math.isclose(value, ref.scaling, rel_tol=SCALING_TOLERANCE):
        return ref
    return dataclasses.replace(ref, unsupported=(
        f"the graph scales adapter {ref.adapter!r}'s delta by an input of value {value}, the adapter's "
        f"stacked scaling is {ref.scaling}"))


class ScalingInputs:
    """The scalings one rewritten graph's sites were traced with, which the stacks must hold at each call.

    Inputs its program no longer reads (their sites rewritten), checked at
    their value of the call; and the constants Dynamo baked in: Dynamo
    runs such a graph only while the model's float equals its constant
    (it guards on it), but a newer graph's input may have re-stacked another
    value since, so the stacks are brought back to it.
    """

    def __init__(self, gm: fx.GraphModule, num_args: int, report: RewriteReport):
        placeholders = list(gm.graph.find_nodes(op="placeholder"))[:num_args]
        # An input the program still reads (its site left alone) computes with whatever value it has.
        self._at: List[Tuple[int, Tuple[str, str]]] = [
            (i, node.meta[SCALING_INPUT]) for i, node in enumerate(placeholders)
            if SCALING_INPUT in node.meta and not node.users]
        self._constants: Dict[Tuple[str, str], float] = {
            (s.site, s.adapter): s.scale for s in report.sites if s.scale is not None and s.adapter is not None}

    def check(self, meta, args: Sequence) -> None:
        """Before the program runs: re-stack, or refuse, any scaling the stacks no longer hold."""
        if self._at or self._constants:
            meta.follow_scalings({**self._constants, **{pair: float(args[i]) for i, pair in self._at}})


__all__ = ["SCALING_INPUT", "ScalingInputs", "scaling_input_pair", "scaling_ref"]
