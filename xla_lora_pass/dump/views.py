"""The views of a graph dump: plain text, side-by-side HTML, Graphviz DOT.

Pure functions of :class:`GraphDump` records; ``dump.py`` captures the graphs
and writes the files.  Nodes are told apart by name: the rewrite works on a
copy that keeps every original node's name, so a name found only after the
rewrite is a node the rewrite added.
"""
from __future__ import annotations

import dataclasses
import html
from typing import Dict, List, Mapping, Optional, Sequence, Set

import torch
import torch.fx as fx
from torch.utils._dtype_abbrs import dtype_abbrs

from graph_rewrites import LORA_INPUT, RewriteReport
from graph_rewrites.fx_utils import example_value

from ..shapes.bucketing import Buckets


@dataclasses.dataclass
class GraphDump:
    """One Dynamo graph: as captured, as rewritten, and the report of what changed."""

    index: int
    before: fx.GraphModule
    after: fx.GraphModule
    report: RewriteReport

    def changes(self) -> "NodeChanges":
        return NodeChanges.of(self)


@dataclasses.dataclass
class NodeChanges:
    """Which node names to highlight, and why (the value is a site name or a short note)."""

    new: Set[str]  # in the rewritten graph only: BGMV calls, their reshapes, new inputs
    replaced: Dict[str, str]  # SiteRewrite.replaced -> site
    near_miss: Dict[str, str]  # NearMiss.nodes -> site, present in both graphs
    removed: Set[str]  # gone for another reason (normalization: eval dropout)

    @classmethod
    def of(cls, dump: GraphDump) -> "NodeChanges":
        before = {n.name for n in dump.before.graph.nodes}
        after = {n.name for n in dump.after.graph.nodes}
        replaced = {name: s.site for s in dump.report.sites for name in s.replaced}
        near_miss = {name: str(m.site) for m in dump.report.near_misses for name in m.nodes}
        return cls(new=after - before, replaced=replaced, near_miss=near_miss,
                   removed=before - after - set(replaced))


# ---------------------------------------------------------------- node lines


def _value_str(value) -> str:
    if isinstance(value, torch.Tensor):
        return f": {dtype_abbrs.get(value.dtype, str(value.dtype))}{list(value.shape)}"
    if isinstance(value, torch.SymInt):
        return f": Sym({value})"
    return ""


def _target_name(target) -> str:
    if isinstance(target, torch._ops.OpOverload):
        return f"torch.ops.{target}"
    try:
        return fx.node._get_qualified_name(target)
    except Exception:  # not every callable has a qualified name (lambdas, bound methods)
        return getattr(target, "__name__", str(target))


def _arg_str(arg) -> str:
    if isinstance(arg, fx.Node):
        return arg.name
    if isinstance(arg, tuple):
        return "(" + ", ".join(_arg_str(a) for a in arg) + ("," if len(arg) == 1 else "") + ")"
    if isinstance(arg, list):
        return "[" + ", ".join(_arg_str(a) for a in arg) + "]"
    if isinstance(arg, dict):
        return "{" + ", ".join(f"{k!r}: {_arg_str(v)}" for k, v in arg.items()) + "}"
    return repr(arg)


def _call_args(args, kwargs) -> str:
    return ", ".join([_arg_str(a) for a in args] + [f"{k}={_arg_str(v)}" for k, v in kwargs.items()])


def node_line(node: fx.Node) -> str:
    """One line per node, Python-like: ``name: f32[2, 6, 32] = torch.ops.xla_lora.bgmv_shrink.default(...)``."""
    head = f"{node.name}{_value_str(example_value(node))}"
    if node.op == "placeholder":
        request = node.meta.get(LORA_INPUT)
        return f"{head}  # input" + (f", fed by the backend: {request.kind}" if request is not None else "")
    if node.op == "output":
        return f"return {_arg_str(node.args[0])}"
    if node.op == "call_method":
        self_arg, *rest = node.args
        return f"{head} = {_arg_str(self_arg)}.{node.target}({_call_args(rest, node.kwargs)})"
    if node.op == "call_function":
        return f"{head} = {_target_name(node.target)}({_call_args(node.args, node.kwargs)})"
    if node.op == "call_module":
        return f"{head} = self.{node.target}({_call_args(node.args, node.kwargs)})"
    return f"{head} = self.{node.target}"  # get_attr


def is_kernel_call(node: fx.Node) -> bool:
    """A call of one of the ``torch.ops.xla_lora`` kernels."""
    return isinstance(node.target, torch._ops.OpOverload) and str(node.target).startswith("xla_lora.")


# ---------------------------------------------------------------- text


def bucket_lines(buckets: Buckets) -> List[str]:
    """``Buckets.table()`` as aligned text rows."""
    lines = [f"{'bucket':>8}  {'serves sizes':<14}  worst-case padding"]
    for size, smallest, waste in buckets.table():
        lines.append(f"{size:>8}  {f'{smallest}-{size}':<14}  {waste:.0%}")
    return lines


def stats_lines(stats: Mapping) -> List[str]:
    return [f"{key}: {dict(value) if isinstance(value, Mapping) else value}" for key, value in stats.items()]


def render_text(dumps: Sequence[GraphDump], buckets: Optional[Buckets] = None, stats: Optional[Mapping] = None,
                title: str = "", graphs: bool = True) -> str:
    """Report, bucket table, backend stats, then each graph before and after (``print_readable``)."""
    out = [f"xla-lora-dump {title}".rstrip() + f": {len(dumps)} Dynamo graph(s)"]
    for d in dumps:
        out += ["", f"=== graph {d.index}: site report ===", d.report.format()]
    if buckets is not None:
        out += ["", f"=== token buckets {buckets!r} ===", *bucket_lines(buckets)]
    if stats is not None:
        out += ["", "=== backend stats after one call (meta.stats) ===", *stats_lines(stats)]
    if graphs:
        for d in dumps:
            out += ["", f"=== graph {d.index}: before the rewrite ===", d.before.print_readable(print_output=False),
                    f"=== graph {d.index}: after the rewrite ===", d.after.print_readable(print_output=False)]
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------- html

_CSS = """
body { font-family: sans-serif; margin: 16px; color: #222; }
table { border-collapse: collapse; margin: 6px 0 14px; font-size: 13px; }
td, th { border: 1px solid #ccc; padding: 3px 8px; text-align: left; vertical-align: top; }
.legend span { padding: 2px 8px; margin-right: 8px; font-family: monospace; }
.cols { display: grid; grid-template-columns: 1fr 1fr; gap: 12px; }
.graph { font-family: monospace; font-size: 12px; border: 1px solid #bbb; padding: 4px; }
.n { white-space: pre-wrap; overflow-wrap: anywhere; padding: 1px 4px; border-left: 4px solid transparent; }
.new { background: #dcf5dc; border-left-color: #2e9b2e; }
.kernel { background: #b5eab5; font-weight: bold; }
.replaced { background: #f9d2d2; border-left-color: #c62828; }
.nearmiss { background: #fff0bf; border-left-color: #d49b00; }
.removed { background: #eee; color: #777; border-left-color: #999; }
"""


def _node_class(node: fx.Node, side: str, ch: NodeChanges) -> Optional[str]:
    name = node.name
    if side == "after" and name in ch.new:
        return "new kernel" if is_kernel_call(node) else "new"
    if side == "before" and name in ch.replaced:
        return "replaced"
    if side == "before" and name in ch.removed:
        return "removed"
    if name in ch.near_miss:
        return "nearmiss"
    return None


def _node_title(name: str, ch: NodeChanges) -> str:
    if name in ch.replaced:
        return f"replaced: site {ch.replaced[name]}"
    if name in ch.near_miss:
        return f"near miss: site {ch.near_miss[name]}"
    return ""


def _graph_html(gm: fx.GraphModule, side: str, ch: NodeChanges, index: int) -> str:
    rows = []
    for node in gm.graph.nodes:
        cls = _node_class(node, side, ch)
        title = _node_title(node.name, ch)
        attrs = f'class="n{" " + cls if cls else ""}" data-node="{html.escape(node.name)}"'
        if title:
            attrs += f' title="{html.escape(title)}"'
        rows.append(f"<div {attrs}>{html.escape(node_line(node))}</div>")
    heading = "before the rewrite (as Dynamo captured it)" if side == "before" else "after the rewrite"
    return (f'<div><h3>{heading}: {len(rows)} nodes</h3>'
            f'<div class="graph" id="graph{index}-{side}">{"".join(rows)}</div></div>')


def _table(headers: Sequence[str], rows: Sequence[Sequence]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _report_html(report: RewriteReport) -> str:
    parts = [f"<p>{len(report.sites)} LoRA sites rewritten, {len(report.near_misses)} near misses</p>"]
    if report.sites:
        parts.append(_table(
            ["site", "pattern", "active adapter", "x shape", "out shape", "rank", "slots", "nodes replaced"],
            [(s.site, s.pattern, s.adapter, list(s.x_shape or ()), list(s.out_shape or ()), s.rank, s.num_slots,
              ", ".join(s.replaced)) for s in report.sites]))
    if report.near_misses:
        parts.append(_table(["near miss: site", "pattern", "reason", "nodes left alone"],
                            [(m.site, m.pattern or "-", m.reason, ", ".join(m.nodes)) for m in report.near_misses]))
    if report.error:
        parts.append(f"<p><b>rewrite failed, graph left unchanged:</b> {html.escape(report.error)}</p>")
    return "".join(parts)


def render_html(dumps: Sequence[GraphDump], buckets: Optional[Buckets] = None, stats: Optional[Mapping] = None,
                title: str = "") -> str:
    """One page: per graph the site report, then before and after side by side, changes highlighted."""
    body = [f"<h1>xla-lora-dump {html.escape(title)}</h1>",
            '<p class="legend">'
            '<span class="new">new node</span><span class="new kernel">BGMV kernel call</span>'
            '<span class="replaced">replaced by a rewrite</span><span class="nearmiss">near miss, left alone</span>'
            '<span class="removed">removed by normalization</span></p>']
    for d in dumps:
        ch = d.changes()
        body += [f'<h2 id="graph{d.index}">Dynamo graph {d.index}</h2>', _report_html(d.report),
                 '<div class="cols">', _graph_html(d.before, "before", ch, d.index),
                 _graph_html(d.after, "after", ch, d.index), "</div>"]
    if buckets is not None:
        body += [f"<h2>Token buckets</h2><p>{html.escape(repr(buckets))}</p>",
                 _table(["bucket", "serves sizes", "worst-case padding"],
                        [(s, f"{lo}-{s}", f"{w:.0%}") for s, lo, w in buckets.table()])]
    if stats is not None:
        body += ["<h2>Backend stats after one call (meta.stats)</h2>",
                 _table(["stat", "value"], [(k, dict(v) if isinstance(v, Mapping) else v) for k, v in stats.items()])]
    return (f'<!DOCTYPE html><html><head><meta charset="utf-8"><title>xla-lora-dump {html.escape(title)}</title>'
            f"<style>{_CSS}</style></head><body>{''.join(body)}</body></html>\n")


# ---------------------------------------------------------------- dot

_DOT_COLORS = {"new": "#dcf5dc", "new kernel": "#7fd67f", "replaced": "#f9d2d2", "nearmiss": "#fff0bf",
               "removed": "#eeeeee"}


def _dot_str(*lines: str) -> str:
    """A quoted DOT string; several lines are joined with DOT's own line break escape."""
    return '"' + "\\n".join(s.replace("\\", "\\\\").replace('"', '\\"') for s in lines) + '"'


def _dot_cluster(gm: fx.GraphModule, side: str, ch: NodeChanges, index: int) -> List[str]:
    prefix = f"g{index}_{side}_"
    lines = [f"  subgraph cluster_{index}_{side} {{", f"    label={_dot_str(f'graph {index} {side}')};"]
    for node in gm.graph.nodes:
        what = node.op if node.op in ("placeholder", "output") else (
            str(node.target) if node.op == "call_method" else _target_name(node.target))
        attrs = [f"label={_dot_str(node.name, what)}"]
        cls = _node_class(node, side, ch)
        if cls:
            attrs.append(f'style=filled, fillcolor="{_DOT_COLORS[cls]}"')
        lines.append(f"    {_dot_str(prefix + node.name)} [{', '.join(attrs)}];")
        for src in node.all_input_nodes:
            lines.append(f"    {_dot_str(prefix + src.name)} -> {_dot_str(prefix + node.name)};")
    lines.append("  }")
    return lines


def render_dot(dumps: Sequence[GraphDump]) -> str:
    """A Graphviz digraph: one cluster per graph and side, the same colours as the HTML view."""
    lines = ["digraph xla_lora_dump {", "  node [shape=box, fontname=monospace, fontsize=10];"]
    for d in dumps:
        ch = d.changes()
        lines += _dot_cluster(d.before, "before", ch, d.index) + _dot_cluster(d.after, "after", ch, d.index)
    lines.append("}")
    return "\n".join(lines) + "\n"
