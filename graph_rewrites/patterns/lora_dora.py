"""Pattern 6: DoRA (PEFT ``use_dora=True`` on a linear layer), in eval.

PEFT's DoRA forward at inference, where ``d = magnitude / ||W + s B A||_row``
(``mag_norm_scale``) depends on the weights alone:

    y = base(x) + ((d - 1) * (base(x) - bias) + d * B(A(x)) * s)

(``- bias`` only when the base layer has one).  So ``d`` is a per-slot
constant ``[out]``, folded at registration; the site becomes the LoRA
shrink/expand of pattern 1 followed by ``bgmv_dora``, which rescales the
rows of DoRA slots and leaves every other row (plain LoRA, base) as it is
(``lora_linear.apply_site_dora``).  The ``d`` subgraph (an ``eye``, two
matmuls, a norm) goes with the match.
"""
from __future__ import annotations

from typing import Optional, Set

import torch.fx as fx
import torch.nn.functional as F

from ..annotations import LORA_WEIGHT
from .lora_linear import input_reason, lora_linear_replacement, weights_reason
from ..pattern_matcher import LinearMatch, Pattern
from ..context import RewriteContext


def _dora_with_bias(x, base, lora_a, lora_b, mag_norm_scale, bias, scale):
    lora_result = F.linear(F.linear(x, lora_a), lora_b)
    return base + ((mag_norm_scale - 1) * (base - bias) + mag_norm_scale * lora_result * scale)


def _dora_without_bias(x, base, lora_a, lora_b, mag_norm_scale, scale):
    lora_result = F.linear(F.linear(x, lora_a), lora_b)
    return base + ((mag_norm_scale - 1) * base + mag_norm_scale * lora_result * scale)


SEARCH_FORMS = (_dora_with_bias, _dora_without_bias)


def _placeholder_ancestors(node: fx.Node) -> Set[fx.Node]:
    seen, todo, found = set(), [node], set()
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "placeholder":
            found.add(n)
        todo.extend(n.all_input_nodes)
    return found


def _mag_norm_scale(m: LinearMatch) -> Optional[fx.Node]:
    return m.extra.get("mag_norm_scale") if m.extra else None


def near_miss_reason(m: LinearMatch) -> Optional[str]:
    """None if the match is the registered DoRA adapter's forward, else why not.

    Beyond pattern 1's checks (one adapter's A and B, its scaling): ``d`` must
    read that adapter's magnitude and no input the tokens come from, so it is
    the same for every token: the per-slot constant folded at registration.
    """
    reason = weights_reason(m) or input_reason(m)
    if reason is not None:
        return reason
    ref_a = m.lora_a.meta[LORA_WEIGHT]
    if not ref_a.dora:
        return "the site holds no registered DoRA adapter, but the graph rescales its output"
    scale = _mag_norm_scale(m)
    sources = _placeholder_ancestors(scale) if isinstance(scale, fx.Node) else set()
    magnitude = [p for p in sources if getattr(p.meta.get(LORA_WEIGHT), "role", None) == "magnitude"]
    if [(r.site, r.adapter) for r in (p.meta[LORA_WEIGHT] for p in magnitude)] != [(ref_a.site, ref_a.adapter)]:
        return "the output scale is not computed from this adapter's DoRA magnitude"
    if sources & _placeholder_ancestors(m.x):
        return "the output scale depends on the layer's input, so it is not a per-adapter constant"
    return None


def lora_dora_replacement(graph: fx.Graph, m: LinearMatch, ctx: RewriteContext):
    """Pattern 1's replacement (it rescales DoRA slots itself), then drop the now unused ``d`` subgraph."""
    out, reason = lora_linear_replacement(graph, m, ctx)
    if out is not None:
        scale = _mag_norm_scale(m)
        m.nodes.extend(n for n in _compute_ancestors(scale) if n not in m.nodes)
    return out, reason


def _compute_ancestors(node: fx.Node):
    seen, todo = [], [node]
    while todo:
        n = todo.pop()
        if n in seen or n.op in ("placeholder", "get_attr"):
            continue
        seen.append(n)
        todo.extend(n.all_input_nodes)
    return seen


LORA_DORA = Pattern("lora_dora", SEARCH_FORMS, near_miss_reason, lora_dora_replacement)
