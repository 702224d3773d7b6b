"""Pattern 1: a linear LoRA delta added to any base output.

    y = base(x) + B(A(dropout(x))) * s            (PEFT ``lora.Linear``)

becomes

    t = bgmv_shrink(x2d, stacked_A, idx, 1.0)
    y = bgmv_expand(t, stacked_B, base(x)2d, idx)  (each slot's scaling is folded into stacked_B)

The base op is left alone, whatever it is (``linear``, ``addmm`` for GPT-2's
Conv1D, ...).  The patterns are example functions traced into graphs and
matched with ``SubgraphMatcher``; ``near_miss_reason`` is the extra check.
``lm_head`` on selected rows (pattern 4) is this pattern with the row
selection applied to the index grid (``site_inputs.site_indices``).
"""
from __future__ import annotations

import functools

import dataclasses
import itertools
import math
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.fx.passes.utils.matcher_utils import InternalMatch, SubgraphMatcher

from . import fx_utils
from .annotations import LORA_WEIGHT, STACKED_BIAS, STACKED_DORA, LoRAWeightRef
from .kernels import emit_lora_delta
from .report import NearMiss, RewriteContext, SiteRewrite
from .site_inputs import device_of, dims_key, stacked_input

PATTERN_NAME = "lora_linear"


def _delta_linear(x, lora_a, lora_b):
    return F.linear(F.linear(x, lora_a), lora_b)


def _delta_matmul(x, lora_a, lora_b):
    return (x @ lora_a.t()) @ lora_b.t()


def _delta_torch_matmul(x, lora_a, lora_b):
    return torch.matmul(torch.matmul(x, lora_a.t()), lora_b.t())


# The scale is a pattern input: a placeholder matches the literal Dynamo baked
# in, and near_miss_reason checks its value.
def _combine_delta_scale(base, delta, scale):
    return base + delta * scale


def _combine_scale_delta(base, delta, scale):
    return base + scale * delta


def _combine_delta_first(base, delta, scale):
    return delta * scale + base


def _combine_scale_first(base, delta, scale):
    return scale * delta + base


COMBINE_FORMS = (_combine_delta_scale, _combine_scale_delta, _combine_delta_first, _combine_scale_first)
DELTA_FORMS = (_delta_linear, _delta_matmul, _delta_torch_matmul)


def _make_pattern(delta_fn: Callable, combine_fn: Callable) -> Callable:
    def lora_linear_pattern(x, base, lora_a, lora_b, scale):
        return combine_fn(base, delta_fn(x, lora_a, lora_b), scale)

    return lora_linear_pattern


@functools.lru_cache(maxsize=None)  # traced once per process; the matcher only reads them
def lora_linear_patterns() -> Tuple[fx.Graph, ...]:
    """Every traced form of the pattern: the delta's matmul form x where the scale stands."""
    return tuple(fx.symbolic_trace(_make_pattern(d, c)).graph
                 for d, c in itertools.product(DELTA_FORMS, COMBINE_FORMS))


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
    lora_bias: Optional[fx.Node] = None
    extra: Dict[str, Any] = dataclasses.field(default_factory=dict)  # a pattern's own inputs (DoRA's scale)

    @property
    def weight(self) -> Optional[LoRAWeightRef]:
        return self.lora_a.meta.get(LORA_WEIGHT)


def to_match(match: InternalMatch, pattern: fx.Graph) -> LinearMatch:
    """Name the matched graph nodes after the pattern's placeholders."""
    by_name = {p.name: match.nodes_map[p] for p in pattern.find_nodes(op="placeholder")}
    compute = [n for p, n in match.nodes_map.items() if p.op not in ("placeholder", "output")]
    scale = by_name["scale"]
    is_number = isinstance(scale, (int, float)) and not isinstance(scale, bool)
    return LinearMatch(
        x=by_name["x"], base=by_name["base"], lora_a=by_name["lora_a"], lora_b=by_name["lora_b"],
        scale=float(scale) if is_number else None, output=match.returning_nodes[0], nodes=compute,
        lora_bias=by_name.get("lora_bias"),
        extra={k: v for k, v in by_name.items() if k not in ("x", "base", "lora_a", "lora_b", "scale", "lora_bias")},
    )


def _leading_key(node: fx.Node):
    value = fx_utils.example_value(node)
    return None if not isinstance(value, torch.Tensor) else dims_key(value.shape[:-1])


def weights_reason(m: LinearMatch, kind: str = "linear") -> Optional[str]:
    """Why A/B/scale do not make one registered adapter's delta (None if they do)."""
    ref_a, ref_b = m.lora_a.meta.get(LORA_WEIGHT), m.lora_b.meta.get(LORA_WEIGHT)
    if ref_a is None or ref_b is None:
        return "the LoRA weights are not registered adapter parameters"
    if ref_a.unsupported:
        return ref_a.unsupported
    if ref_a.role != "A" or ref_b.role != "B" or (ref_a.site, ref_a.adapter) != (ref_b.site, ref_b.adapter):
        return f"A and B are not one adapter's pair ({ref_a.site}:{ref_a.role}, {ref_b.site}:{ref_b.role})"
    if ref_a.kind != kind:
        return f"site kind is {ref_a.kind}, not {kind}"
    if m.scale is None:
        return "the delta is scaled by a tensor, not the adapter's constant scaling"
    if not math.isclose(m.scale, ref_a.scaling, rel_tol=1e-6):
        return f"the graph scales the delta by {m.scale}, the adapter's scaling is {ref_a.scaling}"
    return None


def near_miss_reason(m: LinearMatch) -> Optional[str]:
    """None if the match may be rewritten, else why it must be left exactly as it is."""
    reason = weights_reason(m)
    if reason is None and _leading_key(m.x) != _leading_key(m.base):
        return f"token dims of x {_leading_key(m.x)} and of the base output {_leading_key(m.base)} differ"
    return reason


def should_rewrite_lora_linear(m: LinearMatch) -> bool:
    """The extra check beside the pattern (see near_miss_reason for why not)."""
    return near_miss_reason(m) is None


def lora_linear_replacement(graph: fx.Graph, m: LinearMatch, ctx: RewriteContext):
    """Insert the shrink/expand nodes before ``m.output``; returns (new output, None) or (None, reason).

    Sites the rewrite's kernel applies to use it (``ctx.kernel``); the others
    (a row selection such as ``lm_head`` on the last rows) the fallback, fed
    the token indices, which a LoRA bias and DoRA read too.
    """
    ref: LoRAWeightRef = m.weight
    device = device_of(m.x)
    with graph.inserting_before(m.output):
        x2d = fx_utils.call(graph, "call_method", "reshape", m.x, -1, ref.in_features)
        emitted = emit_lora_delta(graph, ctx, m, ref, m.x, x2d, 1, device, _has_bias(m, ref) or ref.dora)
        if isinstance(emitted, str):
            graph.erase_node(x2d)
            return None, emitted
        expanded, idx = emitted
        expanded = add_site_bias(graph, m, ref, expanded, idx, device)
        expanded = apply_site_dora(graph, ref, expanded, idx, device)
        out = fx_utils.call(graph, "call_method", "view_as", expanded, m.base)
    return out, None


def _has_bias(m: LinearMatch, ref: LoRAWeightRef) -> bool:
    """The traced branch has a LoRA bias, or another adapter at the site has one (its slot needs it too)."""
    return m.lora_bias is not None or ref.lora_bias


def apply_site_dora(graph, ref: LoRAWeightRef, y2d, idx, device):
    """DoRA (pattern 6) at a site holding a DoRA adapter, whatever adapter the graph had active.

    ``y2d`` is base output + LoRA delta (+ LoRA bias); DoRA slots rescale it
    by their per-slot constants, every other row is left as it is.
    """
    if not ref.dora:
        return y2d
    stacked = stacked_input(graph, ref, STACKED_DORA, (ref.num_slots, 2, ref.out_features), device)
    return fx_utils.call(graph, "call_function", torch.ops.xla_lora.bgmv_dora.default, y2d, stacked, idx)


def add_site_bias(graph, m: LinearMatch, ref: LoRAWeightRef, y2d, idx, device):
    """LoRA bias (pattern 5): per-slot bias rows, scaled, gathered per token; none for -1.

    Added whenever any adapter at the site has a bias, not only when the
    active one's branch shows it: the other slots' biases are in the stack.
    """
    if not _has_bias(m, ref):
        return y2d
    stacked = stacked_input(graph, ref, STACKED_BIAS, (ref.num_slots, ref.out_features), device)
    return fx_utils.call(graph, "call_function", torch.ops.xla_lora.bgmv_bias.default, y2d, stacked, idx)


def find_matches(gm: fx.GraphModule, patterns: Sequence[fx.Graph]) -> List[LinearMatch]:
    """Every non-overlapping match of any of ``patterns``, in graph order."""
    matches: List[LinearMatch] = []
    claimed = set()
    for pattern in patterns:
        matcher = SubgraphMatcher(pattern, match_output=False, match_placeholder=False,
                                  remove_overlapping_matches=True, ignore_literals=False)
        for im in matcher.match(gm.graph):
            m = to_match(im, pattern)
            if any(n in claimed for n in m.nodes):
                continue
            claimed.update(m.nodes)
            matches.append(m)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    return sorted(matches, key=lambda m: order[m.output])


def apply_matches(gm: fx.GraphModule, ctx: RewriteContext, matches: List[LinearMatch], pattern_name: str,
                  reason_fn: Callable[[LinearMatch], Optional[str]], replace_fn: Callable) -> bool:
    """Rewrite each match the check accepts; record sites and near misses.  Shared by patterns."""
    modified = False
    for m in matches:
        ref = m.weight
        reason = reason_fn(m)
        new_out = None
        if reason is None:
            new_out, reason = replace_fn(gm.graph, m, ctx)
        if reason is not None:
            ctx.report.near_misses.append(NearMiss(ref.site if ref else None, pattern_name, reason,
                                                   [n.name for n in m.nodes]))
            continue
        replaced = [n.name for n in m.nodes]
        m.output.replace_all_uses_with(new_out)
        fx_utils.erase_dead(m.nodes)
        ctx.report.sites.append(SiteRewrite(
            site=ref.site, pattern=pattern_name, adapter=ref.adapter, x_shape=_shape(m.x),
            out_shape=_shape(new_out), rank=ref.stacked_rank, num_slots=ref.num_slots, replaced=replaced,
        ))
        modified = True
    return modified


def rewrite_lora_linear(gm: fx.GraphModule, ctx: RewriteContext) -> bool:
    """Rewrite every LoRA linear site of ``gm`` in place; record sites and near misses."""
    return apply_matches(gm, ctx, find_matches(gm, lora_linear_patterns()), PATTERN_NAME, near_miss_reason,
                         lora_linear_replacement)


def _shape(node: fx.Node):
    value = fx_utils.example_value(node)
    return None if value is None else tuple(value.shape)
