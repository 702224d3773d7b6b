"""The LoRA pattern library: pure FX passes over Dynamo-captured graphs.

Depends on torch alone.  Kernels are named through ``torch.ops.xla_lora.*``,
which ``xla_lora_pass.ops`` registers before any pass runs.  Graph invariants
are written down in README.md beside this file.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Callable, Dict, List, Mapping, Tuple, Union

import torch.fx as fx

from .annotations import (BASE_WEIGHT, LORA_INPUT, LORA_WEIGHT, SAVED_PARAM, STACKED_A, STACKED_B, STACKED_BIAS,
                          STACKED_DORA, TOKEN_INDICES, GraphInputRequest, LoRAWeightRef, SavedParamRef)
from .flat_tokens import flat_token_nodes
from .fold_linear_inputs import fold_linear_inputs
from .fuse_shared_shrink import fuse_shared_shrinks
from .fx_utils import (canonicalize_lora_embeddings, canonicalize_weight_transposes, drop_none_bias,
                       functionalize_fresh_index_puts, functionalize_fresh_updates, remove_eval_dropout)
from .lora_attach import attach_lora_sites, unserved_base_sites
from .lora_bias import LORA_BIAS
from .lora_dora import LORA_DORA
from .lora_embedding import LORA_EMBEDDING
from .lora_linear import LORA_LINEAR
from .lora_merged import LORA_MERGED
from .pattern_matcher import LinearMatch, Pattern, rewrite_patterns
from .report import NearMiss, RewriteContext, RewriteReport, SiteRewrite
from .saved_modules import serve_saved_modules, unserved_saved_modules
from .site_inputs import find_token_layout

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class PassResult:
    """As ``torch.fx.passes.infra.pass_manager.PassResult``: the module and whether it changed."""

    graph_module: fx.GraphModule
    modified: bool


def _normalize(gm: fx.GraphModule, ctx: RewriteContext) -> bool:
    removed = remove_eval_dropout(gm)
    changed = (drop_none_bias(gm) + removed + functionalize_fresh_index_puts(gm) + functionalize_fresh_updates(gm)
               + canonicalize_weight_transposes(gm) + canonicalize_lora_embeddings(gm)) > 0
    # The mapping's layout: the token dims most LoRA sites apply to.
    ctx.token_layout = ctx.report.token_layout = find_token_layout(gm)
    ctx.flat_token_nodes = frozenset(flat_token_nodes(gm, ctx.token_layout))
    return changed


# The subgraph patterns, in the order the "patterns" pass runs them, each on
# the graph the earlier ones left: the more specific linear forms (a LoRA bias,
# DoRA's rescaling) before pattern 1's plain delta.
# Each is switched by its name in ``config.passes`` (a missing name is on).
PATTERNS: Tuple[Pattern, ...] = (LORA_EMBEDDING, LORA_BIAS, LORA_DORA, LORA_MERGED, LORA_LINEAR)
PATTERN_PASS = "patterns"

# name -> pass, in the order they run.  ``normalize`` strips identities the
# patterns would otherwise need variants for (eval dropout, a None bias, an
# in-place ``+=`` on a fresh result, ``.T`` / ``.transpose(0, 1)`` of a LoRA
# weight, an embedding's gradient-only arguments, a store into fresh zeros)
# and finds the token layout;
# ``patterns`` runs ``PATTERNS``; ``lora_attach`` serves the registered sites
# whose LoRA branch is not in the graph, after the patterns replaced the
# branches that are; ``saved_modules`` serves PEFT's modules_to_save; the
# fusion runs after every site is rewritten; ``fold_linear_inputs`` last, so
# that the patterns see every linear as Dynamo traced it.
PASSES: List[Tuple[str, Callable[..., bool]]] = [
    ("normalize", _normalize),
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
    "LinearMatch", "NearMiss", "PASSES", "PATTERNS", "PassResult", "Pattern", "RewriteContext",
    "RewriteReport", "SiteRewrite", "run_passes", "unrewritten_lora_weights",
]
