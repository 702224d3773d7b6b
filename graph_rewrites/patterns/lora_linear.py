"""Pattern 1: a linear LoRA delta added to any base output.

    y = base(x) + B(A(dropout(x))) * s            (PEFT ``lora.Linear``)

becomes

    t = bgmv_shrink(x2d, stacked_A, idx, 1.0)
    y = bgmv_expand(t, stacked_B, base(x)2d, idx)  (each slot's scaling is folded into stacked_B)

The base op is left alone, whatever it is (``linear``, ``addmm`` for GPT-2's
Conv1D, ...).  ``LORA_LINEAR`` declares the pattern for the engine
(pattern_matcher.py): twelve search forms, ``near_miss_reason`` as the check,
``lora_linear_replacement``.
``lm_head`` on selected rows (pattern 4) is this pattern with the row
selection applied to the index grid (``site_inputs.site_indices``).
"""
from __future__ import annotations

import itertools
import math
from typing import Callable, Optional

import torch
import torch.fx as fx
import torch.nn.functional as F

from .. import fx_utils
from ..annotations import LORA_WEIGHT, STACKED_BIAS, STACKED_DORA, LoRAWeightRef
from ..emit import emit_lora_delta
from ..pattern_matcher import LinearMatch, Pattern
from ..context import RewriteContext
from ..site_inputs import device_of, dims_key, stacked_input


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


# Every form of the pattern: the delta's matmul form x where the scale stands.
SEARCH_FORMS = tuple(_make_pattern(d, c) for d, c in itertools.product(DELTA_FORMS, COMBINE_FORMS))


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
        # PEFT's prepare_model_for_compiled_hotswap turns each scaling into a tensor, and newer Dynamo
        # (dynamic=True) makes a float scaling a 0-d tensor input read with .item(): the adapter's own
        # scaling is folded into its stacked B like a constant one (the metadata keeps the stack in step
        # when the tensor or the input's value changes); any other tensor is not the adapter's scaling.
        scale_input = scaling_input(m.scale_node)
        ref_s = scale_input.meta.get(LORA_WEIGHT) if scale_input is not None else None
        if ref_s is None or ref_s.role != "scaling" or (ref_s.site, ref_s.adapter) != (ref_a.site, ref_a.adapter):
            return "the delta is scaled by a tensor, not the adapter's constant scaling"
        return ref_s.unsupported
    if not math.isclose(m.scale, ref_a.scaling, rel_tol=1e-6):
        return f"the graph scales the delta by {m.scale}, the adapter's scaling is {ref_a.scaling}"
    return None


# Ops after which a tensor still holds the same values, in the same order.
_SAME_VALUES = {"view", "reshape", "flatten", "contiguous", torch.reshape, torch.flatten}
# Ancestors of the base output searched for the LoRA input: the base layer's own input is a few ops up (a
# reshape, an inner LoRA layer of a chain); a bound keeps a miss from walking the whole model.
_ANCESTOR_BUDGET = 256


def _values_root(node):
    while isinstance(node, fx.Node) and node.op in ("call_method", "call_function") and node.target in _SAME_VALUES:
        node = node.args[0]
    return node


def input_reason(m: LinearMatch) -> Optional[str]:
    """Why the site's other adapters would not read the input the graph's branch reads (None if they would).

    The rewrite runs every adapter at the site on ``m.x``; the branch shows only the active adapter's
    input.  A LoRA layer reads the base layer's input (PEFT's eval dropout is gone by now), so ``m.x``
    must be what the base output was computed from.  ``B(A(f(x)))`` beside ``base(x)`` is one adapter's
    own input transform, which the other adapters' rows would wrongly get too.
    """
    root = _values_root(m.x)
    seen, todo = set(), [m.base]
    while todo and len(seen) < _ANCESTOR_BUDGET:
        node = todo.pop()
        if node in seen:
            continue
        if node is m.x or _values_root(node) is root:
            return None
        seen.add(node)
        todo.extend(node.all_input_nodes)
    return (f"the LoRA branch reads {m.x.name}, which is not the base layer's input: the site's other adapters "
            f"would read it too")


def scaling_input(scale_node: Optional[fx.Node]) -> Optional[fx.Node]:
    """The placeholder a non-constant scale is read from: itself, or the tensor of ``tensor.item()``."""
    if scale_node is not None and scale_node.op == "call_method" and scale_node.target == "item":
        return scale_node.args[0]
    return scale_node


def near_miss_reason(m: LinearMatch) -> Optional[str]:
    """None if the match may be rewritten, else why it must be left exactly as it is."""
    reason = weights_reason(m) or input_reason(m)
    if reason is None and _leading_key(m.x) != _leading_key(m.base):
        return f"token dims of x {_leading_key(m.x)} and of the base output {_leading_key(m.base)} differ"
    return reason


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


LORA_LINEAR = Pattern("lora_linear", SEARCH_FORMS, near_miss_reason, lora_linear_replacement)
