"""``rewrite(gm, example_inputs, meta)``: the pass alone, on a copy of the graph.

It ties the pure-FX pattern library to the metadata: placeholders whose
example tensor is a registered LoRA parameter (found by identity) are
annotated with a ``LoRAWeightRef`` before the passes run.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import List, Optional, Sequence, Tuple

import torch
import torch.fx as fx

import graph_rewrites
from graph_rewrites.dynamo_sources import keep_source_names, node_source_name
from graph_rewrites import (BASE_WEIGHT, LORA_WEIGHT, SAVED_PARAM, LoRAWeightRef, NearMiss, RewriteContext,
                            RewriteReport, SavedParamRef)

from .. import config
from ..errors import UnsupportedAdapterError
from ..kernels import table as kernel_table  # its import registers torch.ops.xla_lora before any pass runs
from ..adapters.formats.peft import lora_param_from_source
from ..metadata.lora_metadata import LoRAMetadata
from ..shapes.writes import mark_static_inputs
from .scaling_inputs import SCALING_INPUT, scaling_input_pair, scaling_ref

log = logging.getLogger(__name__)


def capture_graphs(fn, *args, **kwargs) -> List[Tuple[fx.GraphModule, list]]:
    """Every (GraphModule, example_inputs) Dynamo hands a backend for one call ``fn(*args, **kwargs)``.

    For tools and golden tests that run the pass alone (see ``compile_once``).
    """
    graphs = []

    def record(gm, example_inputs):
        graphs.append((gm, list(example_inputs)))
        return gm.forward

    compile_once(fn, record, *args, **kwargs)
    return graphs


def compile_once(fn, backend, *args, **kwargs) -> None:
    """Call ``torch.compile(fn, backend=backend)`` once, without grad, from a fresh Dynamo.

    Reset on both sides: a cached graph, or one past the recompile limit,
    would never reach ``backend``.
    """
    torch._dynamo.reset()
    try:
        with torch.no_grad():
            torch.compile(fn, backend=backend)(*args, **kwargs)
    finally:
        torch._dynamo.reset()


def copy_graph_module(gm: fx.GraphModule) -> fx.GraphModule:
    """A new GraphModule over a copied graph.

    Dynamo reads its own placeholders' ``meta["grapharg"]`` after the backend
    returns, so its graph must never be edited in place.
    """
    graph = fx.Graph()
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    keep_source_names(gm.graph, graph)  # the copy has no grapharg: tools and golden files read the names
    return fx.GraphModule(gm, graph)


def _unregistered_ref(node: fx.Node) -> Optional[LoRAWeightRef]:
    """A PEFT LoRA weight the metadata does not know, recognised by its Dynamo source name.

    Left unmarked it would compute its adapter for every token behind the
    mapping guard's back; marked, it is a near miss and the guard sees it.
    """
    name = node_source_name(node)
    hit = lora_param_from_source(name) if name is not None else None
    if hit is None:
        return None
    site, adapter, role = hit
    return LoRAWeightRef(site=site, adapter=adapter, role=role, kind="unknown", in_features=0, out_features=0,
                         scaling=float("nan"), num_slots=0, stacked_rank=0, dtype=torch.float32,
                         unsupported=UNREGISTERED)


def _excluded_ref(meta: LoRAMetadata, tensor) -> Optional[LoRAWeightRef]:
    """A tensor of an adapter excluded at register_adapters (a type the package does not serve), made active
    since: its layer adds it to every token, so the layer is marked left alone and the uniform-mapping guard
    refuses every mapping (the adapter has no slot for a mapping to be uniform on)."""
    hit = meta.excluded_weight(tensor)
    if hit is None:
        return None
    layer, adapter, reason = hit
    return LoRAWeightRef(site=layer, adapter=adapter, role="excluded", kind="unknown", in_features=0,
                         out_features=0, scaling=float("nan"), num_slots=0, stacked_rank=0, dtype=torch.float32,
                         unsupported=reason)


UNREGISTERED = ("a LoRA weight this LoRAMetadata does not know: call meta.register_adapters(model) with "
                "this model")


def annotate_lora_weights(gm: fx.GraphModule, example_inputs: Sequence, meta: LoRAMetadata) -> int:
    """Mark each placeholder whose example tensor is a LoRA parameter (registered or not), the base weight
    of one or more registered sites, or a tensor of a saved module (PEFT modules_to_save); all found by identity.
    And a registered adapter's float scaling Dynamo made an input (by source name, ``scaling_inputs.py``)."""
    found = 0
    meta.refresh_param_index()
    for node, tensor in zip(gm.graph.find_nodes(op="placeholder"), example_inputs):
        roles = meta.weight_ref(tensor)
        if roles.bases:  # several sites when the weight is tied: lora_attach tells them apart by their ops
            node.meta[BASE_WEIGHT] = tuple(_site_ref(meta, site, None, "base") for site in roles.bases)
        if roles.saved is not None:
            module, adapter, name = roles.saved
            spec = meta.saved_modules[module]
            node.meta[SAVED_PARAM] = SavedParamRef(module, adapter, name, spec.module_key, spec.adapters,
                                                   tuple(meta.slots))
        pair = scaling_input_pair(meta, node, tensor) if roles.lora is None else None
        if pair is not None:  # newer Dynamo's input for a PEFT float scaling
            node.meta[SCALING_INPUT] = pair
            node.meta[LORA_WEIGHT] = _scaling_input_ref(meta, pair, tensor)
            found += 1
            continue
        if roles.lora is None:
            ref = _excluded_ref(meta, tensor) or _unregistered_ref(node)
            if ref is not None:
                node.meta[LORA_WEIGHT] = ref
                found += 1
            continue
        node.meta[LORA_WEIGHT] = _site_ref(meta, *roles.lora)
        found += 1
    return found


def _site_ref(meta: LoRAMetadata, site_name: str, adapter: Optional[str], role: str) -> LoRAWeightRef:
    """What the patterns need to know of a registered site, for one of its weights."""
    site = meta.sites[site_name]
    any_w = next(iter(site.adapters.values()))
    scaling = site.adapters[adapter].scaling if adapter is not None else float("nan")
    return LoRAWeightRef(
        site=site_name, adapter=adapter, role=role, kind=site.kind,
        in_features=site.in_features, out_features=site.out_features, scaling=scaling,
        num_slots=meta.num_slots, stacked_rank=meta.site_rank(site_name), dtype=any_w.lora_a.dtype,
        unsupported=site.unsupported, lora_bias=any(w.bias is not None for w in site.adapters.values()),
        dora=site.has_dora, module_key=str(id(site.module)) if site.module is not None else None,
    )


def _scaling_input_ref(meta: LoRAMetadata, pair, tensor) -> LoRAWeightRef:
    """A float scaling input's ref.  Its value is the model's float now: stacked first if it changed (Dynamo
    traces anew when a float it had baked in changes, and the new graph may make it an input)."""
    try:
        meta.follow_scalings({pair: float(tensor)})
    except UnsupportedAdapterError as exc:
        return dataclasses.replace(_site_ref(meta, *pair, "scaling"), unsupported=str(exc))
    return scaling_ref(_site_ref(meta, *pair, "scaling"), tensor)


def _report_leftovers(gm: fx.GraphModule, report: RewriteReport) -> None:
    """Every LoRA layer still computing eagerly gets a near-miss entry with a reason."""
    explained = {n.site for n in report.near_misses}
    for site, ref in graph_rewrites.unrewritten_lora_weights(gm).items():
        if site not in explained:
            reason = getattr(ref, "unsupported", None) or "no pattern matched the computation around its LoRA weights"
            if getattr(ref, "dora", False) and not getattr(ref, "unsupported", None):
                reason += (" (a DoRA layer: a graph break inside its forward leaves this graph only part of it; "
                           "torch 2.14's Dynamo breaks on PEFT's str.startswith there)")
            report.near_misses.append(NearMiss(site, None, reason))


def rewrite(gm: fx.GraphModule, example_inputs: Sequence, meta: LoRAMetadata, kernel: Optional[str] = None,
            settings: Optional[config.Settings] = None) -> Tuple[fx.GraphModule, RewriteReport]:
    """Rewrite every LoRA site of a copy of ``gm``; return the copy and the report.

    ``settings``: a backend's (default: ``config.snapshot()``, the module's
    values now); ``kernel``: one of ``kernels.table.CHOICES`` (default
    ``settings.kernel``).
    """
    settings = settings if settings is not None else config.snapshot()
    spec = kernel_table.rewrite_kernel(settings.kernel if kernel is None else kernel, settings)
    # Annotated once; the passes edit a copy, and the annotated graph is what comes back when nothing was
    # rewritten (exactly as Dynamo traced it, not the normalized form) or when a pass failed.
    annotated = copy_graph_module(gm)
    annotate_lora_weights(annotated, example_inputs, meta)
    mark_static_inputs(annotated, example_inputs)  # held across calls: the padding hazard must know
    new_gm = copy_graph_module(annotated)
    ctx = RewriteContext(max_num_tokens=meta.max_num_tokens, report=RewriteReport(), kernel=spec,
                         kernels=kernel_table.bound_specs(settings), num_slots=meta.num_slots)
    try:
        graph_rewrites.run_passes(new_gm, ctx, settings.passes)
        if not ctx.report.sites:
            new_gm = annotated
    except Exception as exc:  # an unexpected graph must never cost a result
        if not settings.fallback_on_error:
            raise
        log.warning("LoRA rewrite failed, compiling the graph unrewritten: %s", exc, exc_info=True)
        new_gm = annotated
        ctx.report = RewriteReport(error=f"{type(exc).__name__}: {exc}")
    _report_leftovers(new_gm, ctx.report)
    return new_gm, ctx.report


__all__ = ["rewrite", "capture_graphs", "compile_once", "copy_graph_module", "annotate_lora_weights"]
