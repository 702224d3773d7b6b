"""The LoRA pattern library: pure FX passes over Dynamo-captured graphs.

Depends on torch alone.  This module is the engine: the pass list and
``run_passes``; ``patterns/`` holds the LoRA-site patterns (one file each,
and their table), ``passes/`` the other passes, and the modules beside this
one what they share (annotations, the context and report, the matcher, the
kernel spec and the one function that emits a site's delta).  Kernels reach
the passes as ``KernelSpec`` values in the ``RewriteContext``; the ops they
name (``torch.ops.xla_lora.*``) are registered by the caller before any pass
runs.  Graph invariants are written down in README.md beside this file.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Callable, Dict, List, Mapping, Tuple, Union

import torch.fx as fx

from .annotations import (BASE_WEIGHT, LORA_INPUT, LORA_WEIGHT, SAVED_PARAM, STACKED_A, STACKED_B, STACKED_BIAS,
                          STACKED_DORA, TOKEN_INDICES, GraphInputRequest, LoRAWeightRef, SavedParamRef)
from .context import RewriteContext
from .kernel_spec import KernelSpec
from .pattern_matcher import LinearMatch, Pattern, rewrite_patterns
from .passes.fold_linear_inputs import fold_linear_inputs
from .passes.fuse_shared_shrink import fuse_shared_shrinks
from .passes.lora_attach import attach_lora_sites, unserved_base_sites
from .passes.normalize import normalize
from .passes.saved_modules import serve_saved_modules, unserved_saved_modules
from .patterns import PATTERNS
from .report import NearMiss, RewriteReport, SiteRewrite

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class PassResult:
    """As ``torch.fx.passes.infra.pass_manager.PassResult``: the module and whether it changed."""

    graph_module: fx.GraphModule
    modified: bool


PATTERN_PASS = "patterns"

# name -> pass, in the order they run.  ``normalize`` strips identities the
# patterns would otherwise need variants for and finds the token layout;
# ``patterns`` runs ``PATTERNS`` (patterns/__init__.py); ``lora_attach`` serves the registered sites
# whose LoRA branch is not in the graph, after the patterns replaced the
# branches that are; ``saved_modules`` serves PEFT's modules_to_save; the
# fusion runs after every site is rewritten; ``fold_linear_inputs`` last, so
# that the patterns see every linear as Dynamo traced it.
PASSES: List[Tuple[str, Callable[..., bool]]] = [
    ("normalize", normalize),
    (PATTERN_PASS, rewrite_patterns),  # called with the enabled PATTERNS too
    ("lora_attach", attach_lora_sites),
    ("saved_modules", serve_saved_modules),
    ("fuse_shared_shrink", fuse_shared_shrinks),
    ("fold_linear_inputs", fold_linear_inputs),
]


def run_passes(gm: fx.GraphModule, ctx: RewriteContext, enabled: Mapping[str, bool]) -> PassResult:
    """Run every enabled pass (and pattern) over ``gm`` in place, in order; lint and recompile once at the end."""
    patterns = [p for p in PATTERNS if enabled.get(p.name, True)]
    modified = False
    for name, fn in PASSES:
        if not enabled.get(name, True):
            continue
        changed = fn(gm, ctx, patterns) if name == PATTERN_PASS else fn(gm, ctx)
        log.debug("pass %s: %s", name, "modified" if changed else "no change")
        modified |= changed
    if modified:
        gm.graph.lint()
        gm.recompile()
    return PassResult(gm, modified)


def unrewritten_lora_weights(gm: fx.GraphModule) -> Dict[str, Union[LoRAWeightRef, SavedParamRef]]:
    """Every registered site the graph computes for one adapter only, whatever the mapping, by site.

    A LoRA branch left alone (its adapter in ``.adapter``), a site whose base
    op is in the graph with no LoRA computation (``.adapter`` None: the base
    model for every token), a saved module running one variant (``.adapter``
    the copy's adapter, None for the original).  The uniform-mapping guard
    accepts only a mapping with every token on what these compute.
    """
    left: Dict[str, Union[LoRAWeightRef, SavedParamRef]] = {}
    for node in gm.graph.find_nodes(op="placeholder"):
        ref = node.meta.get(LORA_WEIGHT)
        if ref is not None and node.users:
            left[ref.site] = ref
    for site, ref in {**unserved_base_sites(gm), **unserved_saved_modules(gm)}.items():
        left.setdefault(site, ref)
    return left


__all__ = [
    "BASE_WEIGHT", "SAVED_PARAM", "SavedParamRef", "LORA_INPUT", "LORA_WEIGHT", "STACKED_A",
    "STACKED_B", "STACKED_BIAS", "STACKED_DORA", "TOKEN_INDICES", "GraphInputRequest", "LoRAWeightRef",
    "KernelSpec", "LinearMatch", "NearMiss", "PASSES", "PATTERNS", "PassResult", "Pattern", "RewriteContext",
    "RewriteReport", "SiteRewrite", "run_passes", "unrewritten_lora_weights",
]
