"""Pattern 1: a linear LoRA delta added to any base output.

    y = base(x) + B(A(dropout(x))) * s            (PEFT ``lora.Linear``)

becomes

    t = bgmv_shrink(x2d, stacked_A, idx, 1.0)
    y = bgmv_expand(t, stacked_B, base(x)2d, idx)  (each slot's scaling is folded into stacked_B)

The base op is left alone, whatever it is (``linear``, ``addmm``, ...).  The
patterns are example functions traced into graphs and matched with
``SubgraphMatcher``; ``near_miss_reason`` is the extra check.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Callable, List, Optional

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.fx.passes.utils.matcher_utils import InternalMatch, SubgraphMatcher

from . import fx_utils
from .annotations import LORA_WEIGHT, STACKED_A, STACKED_B, TOKEN_INDICES, GraphInputRequest, LoRAWeightRef
from .report import NearMiss, RewriteContext, SiteRewrite

PATTERN_NAME = "lora_linear"


def _delta_linear(x, lora_a, lora_b):
    return F.linear(F.linear(x, lora_a), lora_b)


def _delta_matmul(x, lora_a, lora_b):
    return (x @ lora_a.t()) @ lora_b.t()


# The scale is a pattern input: a placeholder matches the literal Dynamo baked
# in, and near_miss_reason checks its value.
def _combine_delta_scale(base, delta, scale):
    return base + delta * scale


def _combine_scale_delta(base, delta, scale):
    return base + scale * delta


def _combine_delta_first(base, delta, scale):
    return delta * scale + base


def _make_pattern(delta_fn: Callable, combine_fn: Callable) -> Callable:
    def lora_linear_pattern(x, base, lora_a, lora_b, scale):
        return combine_fn(base, delta_fn(x, lora_a, lora_b), scale)

    return lora_linear_pattern


def lora_linear_patterns() -> List[fx.Graph]:
    """Every traced form of the pattern: the delta's matmul form x where the scale stands."""
    graphs = []
    for delta_fn, combine_fn in itertools.product(
        (_delta_linear, _delta_matmul), (_combine_delta_scale, _combine_scale_delta, _combine_delta_first)
    ):
        graphs.append(fx.symbolic_trace(_make_pattern(delta_fn, combine_fn)).graph)
    return graphs


@dataclasses.dataclass
class LinearMatch:
    """One matched site: the graph nodes bound to the pattern's inputs and its output."""

    x: fx.Node
    base: fx.Node
    lora_a: fx.Node
    lora_b: fx.Node
    scale: Optional[float]
    output: fx.Node
    nodes: List[fx.Node]  # every matched compute node, to erase once replaced

    @property
    def weight(self) -> Optional[LoRAWeightRef]:
        return self.lora_a.meta.get(LORA_WEIGHT)


def _to_linear_match(match: InternalMatch, pattern: fx.Graph) -> LinearMatch:
    by_name = {p.name: match.nodes_map[p] for p in pattern.find_nodes(op="placeholder")}
    compute = [n for p, n in match.nodes_map.items() if p.op not in ("placeholder", "output")]
    scale = by_name["scale"]
    is_number = isinstance(scale, (int, float)) and not isinstance(scale, bool)
    return LinearMatch(
        x=by_name["x"], base=by_name["base"], lora_a=by_name["lora_a"], lora_b=by_name["lora_b"],
        scale=float(scale) if is_number else None, output=match.returning_nodes[0], nodes=compute,
    )


def _leading_dims(node: fx.Node):
    value = fx_utils.example_value(node)
    return None if value is None else tuple(value.shape[:-1])


def near_miss_reason(m: LinearMatch) -> Optional[str]:
    """None if the match may be rewritten, else why it must be left exactly as it is."""
    ref_a, ref_b = m.lora_a.meta.get(LORA_WEIGHT), m.lora_b.meta.get(LORA_WEIGHT)
    if ref_a is None or ref_b is None:
        return "the LoRA weights are not registered adapter parameters"
    if ref_a.role != "A" or ref_b.role != "B" or (ref_a.site, ref_a.adapter) != (ref_b.site, ref_b.adapter):
        return f"A and B are not one adapter's pair ({ref_a.site}:{ref_a.role}, {ref_b.site}:{ref_b.role})"
    if ref_a.kind != "linear":
        return f"site kind is {ref_a.kind}, not linear"
    if ref_a.unsupported:
        return ref_a.unsupported
    if m.scale is None:
        return "the delta is scaled by a tensor, not the adapter's constant scaling"
    if not math.isclose(m.scale, ref_a.scaling, rel_tol=1e-6):
        return f"the graph scales the delta by {m.scale}, the adapter's scaling is {ref_a.scaling}"
    x_dims, base_dims = _leading_dims(m.x), _leading_dims(m.base)
    if x_dims is not None and x_dims != base_dims:
        return f"token dims of x {x_dims} and of the base output {base_dims} differ"
    return None


def should_rewrite_lora_linear(m: LinearMatch) -> bool:
    """The extra check beside the pattern (see near_miss_reason for why not)."""
    return near_miss_reason(m) is None


def lora_linear_replacement(graph: fx.Graph, m: LinearMatch, ctx: RewriteContext) -> fx.Node:
    """Insert the shrink/expand nodes before ``m.output`` and return the new output node."""
    ref: LoRAWeightRef = m.weight
    device = fx_utils.example_value(m.x).device if fx_utils.example_value(m.x) is not None else None
    idx = fx_utils.get_or_add_input(
        graph, "lora_token_indices", GraphInputRequest(TOKEN_INDICES, None, (ctx.max_num_tokens,)), device
    )
    safe = ref.site.replace(".", "_")
    stacked_a = fx_utils.get_or_add_input(
        graph, f"lora_a_{safe}",
        GraphInputRequest(STACKED_A, ref.site, (ref.num_slots, ref.stacked_rank, ref.in_features), ref.dtype), device,
    )
    stacked_b = fx_utils.get_or_add_input(
        graph, f"lora_b_{safe}",
        GraphInputRequest(STACKED_B, ref.site, (ref.num_slots, ref.out_features, ref.stacked_rank), ref.dtype), device,
    )
    with graph.inserting_before(m.output):
        x2d = fx_utils.call(graph, "call_method", "reshape", m.x, -1, ref.in_features)
        base2d = fx_utils.call(graph, "call_method", "reshape", m.base, -1, ref.out_features)
        num_tokens = fx_utils.call(graph, "call_method", "size", x2d, 0)
        idx_t = fx_utils.call(graph, "call_method", "narrow", idx, 0, 0, num_tokens)
        shrunk = fx_utils.call(graph, "call_function", torch.ops.xla_lora.bgmv_shrink.default,
                               x2d, stacked_a, idx_t, 1.0)
        expanded = fx_utils.call(graph, "call_function", torch.ops.xla_lora.bgmv_expand.default,
                                 shrunk, stacked_b, base2d, idx_t, True)
        out = fx_utils.call(graph, "call_method", "view_as", expanded, m.base)
    return out


def find_lora_linear(gm: fx.GraphModule) -> List[LinearMatch]:
    """Every non-overlapping match of any traced form, in graph order."""
    matches: List[LinearMatch] = []
    claimed = set()
    for pattern in lora_linear_patterns():
        matcher = SubgraphMatcher(pattern, match_output=False, match_placeholder=False,
                                  remove_overlapping_matches=True, ignore_literals=False)
        for im in matcher.match(gm.graph):
            m = _to_linear_match(im, pattern)
            if any(n in claimed for n in m.nodes):
                continue
            claimed.update(m.nodes)
            matches.append(m)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    return sorted(matches, key=lambda m: order[m.output])


def rewrite_lora_linear(gm: fx.GraphModule, ctx: RewriteContext) -> bool:
    """Rewrite every LoRA linear site of ``gm`` in place; record sites and near misses."""
    modified = False
    report = ctx.report
    for m in find_lora_linear(gm):
        ref = m.weight
        reason = near_miss_reason(m)
        if reason is not None:
            report.near_misses.append(NearMiss(ref.site if ref else None, PATTERN_NAME, reason,
                                               [n.name for n in m.nodes]))
            continue
        new_out = lora_linear_replacement(gm.graph, m, ctx)
        replaced = [n.name for n in m.nodes]
        m.output.replace_all_uses_with(new_out)
        fx_utils.erase_dead(m.nodes)
        report.sites.append(SiteRewrite(
            site=ref.site, pattern=PATTERN_NAME, adapter=ref.adapter,
            x_shape=_shape(m.x), out_shape=_shape(new_out), rank=ref.stacked_rank,
            num_slots=ref.num_slots, replaced=replaced,
        ))
        modified = True
    return modified


def _shape(node: fx.Node):
    value = fx_utils.example_value(node)
    return None if value is None else tuple(value.shape)
