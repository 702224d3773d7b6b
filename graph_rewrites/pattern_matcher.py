"""The pattern engine: declared LoRA-site patterns, matched and rewritten by one pass.

As ``torch/_inductor/pattern_matcher.py``: a pattern is example functions
traced into graphs (its search forms), an extra check that says why a match
must be left alone, and a replacement.  Each pattern file declares one
``Pattern``; ``graph_rewrites.PATTERNS`` registers them in the order they run,
and ``rewrite_patterns`` runs them, recording every site and near miss in the
report.  Matching is ``SubgraphMatcher``'s, on every form of a pattern.

Every pattern here is a LoRA delta around a base op, so a match names its
inputs ``x``, ``base``, ``lora_a``, ``lora_b``, ``scale`` (and optionally
``lora_bias``); any other input of the example functions lands in
``LinearMatch.extra`` by name.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch.fx as fx
from torch.fx.passes.utils.matcher_utils import InternalMatch, SubgraphMatcher

from . import fx_utils
from .annotations import LORA_WEIGHT, LoRAWeightRef
from .context import RewriteContext
from .report import NearMiss, SiteRewrite

log = logging.getLogger(__name__)

_NAMED_INPUTS = ("x", "base", "lora_a", "lora_b", "scale", "lora_bias")


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
    scale_node: Optional[fx.Node] = None  # the tensor the delta is scaled by, when ``scale`` is not a number
    extra: Dict[str, Any] = dataclasses.field(default_factory=dict)  # a pattern's own inputs (DoRA's scale)

    @property
    def weight(self) -> Optional[LoRAWeightRef]:
        return self.lora_a.meta.get(LORA_WEIGHT)


# check(match) -> None to rewrite, else the near-miss reason.
Check = Callable[[LinearMatch], Optional[str]]
# replacement(graph, match, ctx) -> (new output, None), or (None, reason) when it cannot serve the site.
Replacement = Callable[[fx.Graph, LinearMatch, RewriteContext], Tuple[Optional[fx.Node], Optional[str]]]


@dataclasses.dataclass(frozen=True)
class Pattern:
    """A declared pattern: its name (report, and the caller's ``enabled`` switches), search forms, check and replacement."""

    name: str
    search_forms: Tuple[Callable, ...]  # example functions; their argument names bind the match
    check: Check
    replacement: Replacement

    def graphs(self) -> Tuple[fx.Graph, ...]:
        """The traced search forms."""
        return tuple(traced_form(fn) for fn in self.search_forms)


@functools.lru_cache(maxsize=None)  # traced once per process; the matcher only reads them
def traced_form(fn: Callable) -> fx.Graph:
    """``fn`` traced into the graph the matcher searches for."""
    return fx.symbolic_trace(fn).graph


def to_match(match: InternalMatch, pattern: fx.Graph) -> LinearMatch:
    """Name the matched graph nodes after the pattern's placeholders."""
    by_name = {p.name: match.nodes_map[p] for p in pattern.find_nodes(op="placeholder")}
    compute = [n for p, n in match.nodes_map.items() if p.op not in ("placeholder", "output")]
    scale = by_name["scale"]
    is_number = isinstance(scale, (int, float)) and not isinstance(scale, bool)
    return LinearMatch(
        x=by_name["x"], base=by_name["base"], lora_a=by_name["lora_a"], lora_b=by_name["lora_b"],
        scale=float(scale) if is_number else None, output=match.returning_nodes[0], nodes=compute,
        lora_bias=by_name.get("lora_bias"), scale_node=scale if isinstance(scale, fx.Node) else None,
        extra={k: v for k, v in by_name.items() if k not in _NAMED_INPUTS},
    )


def find_matches(gm: fx.GraphModule, patterns: Sequence[fx.Graph]) -> List[LinearMatch]:
    """Every non-overlapping match of any of ``patterns``, in graph order (earlier forms win)."""
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


def _guarded(pattern: Pattern, m: LinearMatch, step: str, fn: Callable, *args):
    """``fn(*args)``; an exception keeps its type and gets the pattern and matched output node appended.

    As ``torch.fx.Interpreter`` does ("While executing ..."): the type stays
    what the code raised, so callers and logs see the real failure and where.
    """
    try:
        return fn(*args)
    except Exception as exc:
        where = f"pattern {pattern.name}, {step} of the site ending at {m.output.format_node()}"
        exc.args = (f"{exc.args[0]} [{where}]" if exc.args else where,) + exc.args[1:]
        if isinstance(exc, KeyError):  # str(KeyError) is the repr of its key: the message would read as one
            raise RuntimeError(*exc.args) from exc
        raise


def apply_pattern(gm: fx.GraphModule, ctx: RewriteContext, pattern: Pattern) -> int:
    """Rewrite each match of ``pattern`` its check accepts; record sites and near misses.  Returns the sites."""
    rewritten = 0
    for m in find_matches(gm, pattern.graphs()):
        ref = m.weight
        if ref is not None and _drop_other_active_branch(m, ref, ctx):
            continue
        reason = _guarded(pattern, m, "check", pattern.check, m)
        new_out = None
        if reason is None:
            new_out, reason = _guarded(pattern, m, "replacement", pattern.replacement, gm.graph, m, ctx)
        if reason is not None:
            ctx.report.near_misses.append(NearMiss(ref.site if ref else None, pattern.name, reason,
                                                   [n.name for n in m.nodes]))
            continue
        replaced = [n.name for n in m.nodes]
        m.output.replace_all_uses_with(new_out)
        # A scale read with ``.item()`` (Dynamo's float scaling input) is dead too once the site reads the stacks.
        fx_utils.erase_dead(m.nodes + _item_of(m.scale_node))
        ctx.report.sites.append(SiteRewrite(
            site=ref.site, pattern=pattern.name, adapter=ref.adapter, x_shape=fx_utils.shape_of(m.x),
            out_shape=fx_utils.shape_of(new_out), rank=ref.stacked_rank, num_slots=ref.num_slots,
            replaced=replaced, scale=m.scale,
        ))
        rewritten += 1
    return rewritten


def _drop_other_active_branch(m: LinearMatch, ref: LoRAWeightRef, ctx: RewriteContext) -> bool:
    """Remove ``m``'s branch if its site is rewritten already for another adapter; True if removed.

    PEFT with several active adapters (``set_adapter([...])``) adds each
    one's branch at a site in turn.  The site's rewrite adds the delta of the
    adapter each token is mapped to, whichever adapter's branch it replaced,
    so another branch left in would add a second adapter's delta (and one
    rewritten too would add the mapped adapter's delta twice).
    """
    if not any(s.site == ref.site and s.adapter != ref.adapter for s in ctx.report.sites):
        return False
    inside = set(m.nodes)
    # What the branch's delta is added to now: ``m.base`` may be the earlier branch's sum, replaced since.
    added_to = [n for n in m.output.all_input_nodes if n not in inside]
    if len(added_to) != 1:
        return False
    m.output.replace_all_uses_with(added_to[0])
    fx_utils.erase_dead(m.nodes + _item_of(m.scale_node))
    ctx.report.dropped_branches.append((ref.site, ref.adapter))
    return True


def _item_of(node: Optional[fx.Node]) -> List[fx.Node]:
    return [node] if node is not None and node.op == "call_method" and node.target == "item" else []


def rewrite_patterns(gm: fx.GraphModule, ctx: RewriteContext, patterns: Sequence[Pattern]) -> bool:
    """Run ``patterns`` over ``gm`` in order, each on the graph the earlier ones left; True if any site changed."""
    modified = False
    for pattern in patterns:
        count = apply_pattern(gm, ctx, pattern)
        log.debug("pattern %s: %d sites", pattern.name, count)
        modified |= count > 0
    return modified


__all__ = ["LinearMatch", "Pattern", "apply_pattern", "find_matches", "rewrite_patterns",
           "to_match", "traced_form"]
