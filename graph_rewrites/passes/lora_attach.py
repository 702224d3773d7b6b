"""Pattern 8: a registered site whose LoRA branch is not in the graph gets one.

Dynamo traces the active adapter only.  A layer that holds only inactive
adapters (adapters trained on other ``target_modules``) appears as its bare
base op, with no LoRA branch for patterns 1-5 to replace:

    y = linear(x, W[, b])          (PEFT ``Linear``)
    y = addmm(b, x2d, W)           (GPT-2 ``Conv1D``: W is [in, out], x2d a view of x)
    y = x @ W.T  (then + b)        (Falcon's ``FalconLinear``, an ``nn.Linear`` with its own forward)
    y = embedding(ids, W)          (PEFT ``Embedding``)

The caller marks W's placeholder (``BASE_WEIGHT``, found by the identity of
the example tensor, with every site that reads it: tied embeddings make
``embed_tokens`` and ``lm_head`` one tensor).  Each use of W is its site's by
the op's kind (an embedding lookup, a linear), and between sites of one kind
by the module the op runs in (``nn_module_stack``); every such op whose
output does not already feed a BGMV expand becomes

    y = bgmv_expand(bgmv_shrink(x2d, stacked_A, idx), stacked_B, y2d, idx)

the same shrink/expand patterns 1 and 2 emit (the rewrite's kernel, ``emit.emit_lora_delta``),
so every slot's adapter is served at every site whatever adapter is active.
Exact for every mapping: slots whose adapter is absent at the site have zero
stacks, -1 adds nothing, and the base op is untouched.

A use of W this pass cannot attach to (an unknown form, a shared W's use no
site can be told for, a site with an unsupported adapter, tokens not tied to
the mapping) is left alone and reported; ``unserved_base_sites`` then lists
its sites for the uniform-mapping guard, since it computes no LoRA for any
token.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.fx as fx

from .. import fx_utils
from ..annotations import LORA_INPUT, STACKED_BIAS, LoRAWeightRef
from ..emit import emit_lora_delta, stacks_and_base
from ..patterns.lora_linear import apply_site_dora
from ..context import RewriteContext
from ..report import NearMiss, SiteRewrite
from ..site_inputs import device_of, site_indices, stacked_input
from .base_uses import BaseOp, SiteUses, base_op, base_weight_inputs, feeds_lora_expand, lora_weight_sites, \
    site_uses, unserved_base_sites

PATTERN_NAME = "lora_attach"


def _attach(graph: fx.Graph, ctx: RewriteContext, op: BaseOp, ref: LoRAWeightRef) -> Optional[str]:
    """Add every slot's LoRA delta to one base op's output; None, or why it could not."""
    y = op.op
    anchor = y.next
    with graph.inserting_before(anchor):
        result = _emit(graph, ctx, op, ref, device_of(y))
    added, node = [], y.next
    while node is not anchor:
        added.append(node)
        node = node.next
    if isinstance(result, str):
        for node in reversed(added):
            graph.erase_node(node)
        _erase_unused_inputs(graph)
        return result
    new = set(added)
    y.replace_all_uses_with(result, delete_user_cb=lambda user: user not in new)
    return None


def _erase_unused_inputs(graph: fx.Graph) -> None:
    """Inputs a failed attach asked for and no longer uses: the caller would feed them for nothing."""
    for node in graph.find_nodes(op="placeholder"):
        if LORA_INPUT in node.meta and not node.users:
            graph.erase_node(node)


def _emit(graph: fx.Graph, ctx: RewriteContext, op: BaseOp, ref: LoRAWeightRef, device):
    """The replacement of ``op.op``'s value (a node), or the reason there is none (a str)."""
    y = op.op
    if ref.kind == "embedding":
        if ref.dora:
            return "DoRA on an embedding site whose LoRA branch is not in the graph is not attached"
        ids = fx_utils.call(graph, "call_method", "reshape", op.tokens, -1)
        idx, reason = site_indices(graph, ctx, op.tokens, ids, 0, device)
        if idx is None:
            return reason
        stacked_a, stacked_b, base2d = stacks_and_base(graph, _AsMatch(y), ref, device)
        shrunk = fx_utils.call(graph, "call_function", torch.ops.xla_lora.bgmv_embedding_shrink.default,
                               ids, stacked_a, idx)
        expanded = fx_utils.call(graph, "call_function", torch.ops.xla_lora.bgmv_expand.default,
                                 shrunk, stacked_b, base2d, idx, True)
        return fx_utils.call(graph, "call_method", "view_as", expanded, y)
    x2d = fx_utils.call(graph, "call_method", "reshape", op.tokens, -1, ref.in_features)
    emitted = emit_lora_delta(graph, ctx, _AsMatch(y), ref, op.tokens, x2d, op.n_feature_dims, device,
                              ref.lora_bias or ref.dora)
    if isinstance(emitted, str):
        return emitted
    expanded, idx = emitted
    if ref.lora_bias:
        stacked = stacked_input(graph, ref, STACKED_BIAS, (ref.num_slots, ref.out_features), device)
        expanded = fx_utils.call(graph, "call_function", torch.ops.xla_lora.bgmv_bias.default,
                                 expanded, stacked, idx)
    expanded = apply_site_dora(graph, ref, expanded, idx, device)
    return fx_utils.call(graph, "call_method", "view_as", expanded, y)


class _AsMatch:
    """The two fields ``stacks_and_base`` reads off a match: the base output is also the output here."""

    def __init__(self, y: fx.Node):
        self.base = self.output = y


def attach_lora_sites(gm: fx.GraphModule, ctx: RewriteContext) -> bool:
    """Attach the BGMV computation to every registered site's bare base op; record sites and near misses."""
    branches = lora_weight_sites(gm)
    modified = False
    for weight, refs in list(base_weight_inputs(gm)):
        uses = site_uses(weight, refs)  # before any attach: each op is one site's, whichever is served first
        for ref in refs:
            if ref.site not in branches:  # else its branch is here: patterns 1-5 replaced it or said why not
                modified |= _attach_site(gm, ctx, ref, uses[ref.site])
    return modified


def _attach_site(gm: fx.GraphModule, ctx: RewriteContext, ref: LoRAWeightRef, uses: SiteUses) -> bool:
    for use, reason in uses.unserved:
        ctx.report.near_misses.append(NearMiss(ref.site, PATTERN_NAME, reason, [use.name]))
    modified = False
    for op in uses.bare:
        reason = ref.unsupported or _attach(gm.graph, ctx, op, ref)
        if reason is not None:
            ctx.report.near_misses.append(NearMiss(ref.site, PATTERN_NAME, reason, [op.op.name]))
            continue
        ctx.report.sites.append(SiteRewrite(
            site=ref.site, pattern=PATTERN_NAME, adapter=None, x_shape=fx_utils.shape_of(op.tokens),
            out_shape=fx_utils.shape_of(op.op), rank=ref.stacked_rank, num_slots=ref.num_slots, replaced=[]))
        modified = True
    return modified


__all__ = ["attach_lora_sites", "unserved_base_sites", "feeds_lora_expand", "base_op", "PATTERN_NAME"]
