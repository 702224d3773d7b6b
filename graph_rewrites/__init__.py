"""The LoRA pattern library: pure FX passes over Dynamo-captured graphs.

Depends on torch alone.  Kernels are named through ``torch.ops.xla_lora.*``,
which ``xla_lora_pass.ops`` registers before any pass runs.  Graph invariants
are written down in README.md beside this file.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Callable, Dict, List, Mapping, Tuple

import torch.fx as fx

from .annotations import (LORA_INPUT, LORA_WEIGHT, STACKED_A, STACKED_B, STACKED_BIAS, STACKED_DORA, TOKEN_INDICES,
                          GraphInputRequest, LoRAWeightRef)
from .fuse_shared_shrink import GROUP_SEPARATOR, fuse_shared_shrinks
from .fx_utils import (canonicalize_weight_transposes, drop_none_bias, functionalize_fresh_updates,
                       remove_eval_dropout)
from .lora_bias import rewrite_lora_bias
from .lora_dora import rewrite_lora_dora
from .lora_embedding import rewrite_lora_embedding
from .lora_linear import rewrite_lora_linear
from .report import NearMiss, RewriteContext, RewriteReport, SiteRewrite
from .site_inputs import find_token_layout

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class PassResult:
    """As ``torch.fx.passes.infra.pass_manager.PassResult``: the module and whether it changed."""

    graph_module: fx.GraphModule
    modified: bool


def _normalize(gm: fx.GraphModule, ctx: RewriteContext) -> bool:
    removed = remove_eval_dropout(gm)
    changed = (drop_none_bias(gm) + removed + functionalize_fresh_updates(gm)
               + canonicalize_weight_transposes(gm)) > 0
    # The mapping's layout: the token dims most LoRA sites apply to.
    ctx.token_layout = ctx.report.token_layout = find_token_layout(gm)
    return changed


# name -> pass, in the order they run.  ``normalize`` strips identities the
# patterns would otherwise need variants for (eval dropout, a None bias, an
# in-place ``+=`` on a fresh result, ``.T`` / ``.transpose(0, 1)`` of a LoRA
# weight) and finds the token layout; the fusion runs after every site is rewritten.
PASSES: List[Tuple[str, Callable[[fx.GraphModule, RewriteContext], bool]]] = [
    ("normalize", _normalize),
    ("lora_embedding", rewrite_lora_embedding),
    ("lora_bias", rewrite_lora_bias),
    ("lora_dora", rewrite_lora_dora),
    ("lora_linear", rewrite_lora_linear),
    ("fuse_shared_shrink", fuse_shared_shrinks),
]


def run_passes(gm: fx.GraphModule, ctx: RewriteContext, enabled: Mapping[str, bool]) -> PassResult:
    """Run every enabled pass over ``gm`` in place, in order; lint and recompile once at the end."""
    modified = False
    for name, fn in PASSES:
        if not enabled.get(name, True):
            continue
        changed = fn(gm, ctx)
        log.debug("pass %s: %s", name, "modified" if changed else "no change")
        modified |= changed
    if modified:
        gm.graph.lint()
        gm.recompile()
    return PassResult(gm, modified)


def unrewritten_lora_weights(gm: fx.GraphModule) -> Dict[str, LoRAWeightRef]:
    """LoRA weight placeholders still used by the graph: the layers left computing eagerly."""
    left: Dict[str, LoRAWeightRef] = {}
    for node in gm.graph.find_nodes(op="placeholder"):
        ref = node.meta.get(LORA_WEIGHT)
        if ref is not None and node.users:
            left[ref.site] = ref
    return left


__all__ = [
    "GROUP_SEPARATOR", "LORA_INPUT", "LORA_WEIGHT", "STACKED_A", "STACKED_B", "STACKED_BIAS", "STACKED_DORA",
    "TOKEN_INDICES", "GraphInputRequest", "LoRAWeightRef",
    "NearMiss", "PASSES", "PassResult", "RewriteContext", "RewriteReport", "SiteRewrite", "run_passes",
    "unrewritten_lora_weights",
]
