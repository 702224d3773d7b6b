"""``CompiledLoRAGraph``: one rewritten Dynamo graph, called per step.

Per call: check the token mapping, pick the kernel's rewrite for it
(``graph_for_call``, from the kernel table), pad the inputs to the bucket,
feed the metadata's per-step inputs and stacked weights as extra graph
inputs, run the one static program compiled for that bucket by the inner
backend, and slice the outputs back.
"""
from __future__ import annotations

import dataclasses
import logging
import math
from typing import Callable, Dict, Optional

import torch
import torch.fx as fx

from graph_rewrites import LORA_INPUT, RewriteReport, unrewritten_lora_weights
from graph_rewrites.fx_values import size_expr
from graph_rewrites.site_inputs import find_token_layout

from .. import runtimes
from ..config import Settings
from ..errors import UnsupportedMappingError
from ..kernels.table import AUTO, FALLBACK, FIRST, GraphInputs, choose, kernels_run
from ..metadata import NO_LORA, LoRAMetadata
from ..shapes.bucketing import Buckets, GraphShapes, evaluate
from .program_inputs import ProgramInputs
from .rewrite import copy_graph_module
from .scaling_inputs import ScalingInputs
from .static_programs import compile_static

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class GraphContext:
    """What every compiled graph of one backend shares: the backend's state, without the backend itself."""

    meta: LoRAMetadata
    buckets: Buckets  # the innermost token dim's (and a flat layout's)
    batch_buckets: Buckets  # the leading token dims' (the batch of [B, S])
    settings: Settings
    # (Dynamo's graph, example inputs, kernel) -> that graph rewritten with the kernel and wrapped.
    remake: Callable[[fx.GraphModule, list, str], "CompiledLoRAGraph"]
    # The kernel every call runs while precompile warms one (None otherwise).
    warming_kernel: Callable[[], Optional[str]]


class CompiledLoRAGraph:
    """One rewritten Dynamo graph and its per-bucket programs."""

    def __init__(self, context: GraphContext, gm: fx.GraphModule, report: RewriteReport, num_args: int,
                 inner: Callable, static: bool = False):
        self.context = context
        self.meta = context.meta
        self.gm = gm
        self.report = report
        self.num_args = num_args
        self.inner = inner
        # True: each bucket's program is the graph specialised to its sizes (backend/static_programs.py).
        self.static = static
        self.extra_requests = [n.meta[LORA_INPUT] for n in gm.graph.find_nodes(op="placeholder")
                               if LORA_INPUT in n.meta]
        self._inputs = GraphInputs(self.extra_requests)
        layout = report.token_layout if report.sites else None
        self.shapes = GraphShapes.analyze(gm, num_args, layout)
        self.program_inputs = ProgramInputs(gm, num_args, self.shapes)
        self.scaling_inputs = ScalingInputs(gm, num_args, report)
        if self.shapes.not_bucketable:
            log.info("graph compiled per exact shape: %s", self.shapes.not_bucketable)
        self.leftovers = unrewritten_lora_weights(gm)
        # A graph with no rewritten site still has token dims: those of a LoRA layer left alone.
        self.leftover_layout = _leftover_token_layout(gm) if self.leftovers and not report.sites else None
        self.programs: Dict[tuple, Callable] = {}
        # The kernels of the table this graph runs besides the fallback (kernels.kernels_run).
        self.kernels = kernels_run(self.extra_requests)
        self.source = None  # (Dynamo's graph, example inputs) to rewrite with another kernel ("auto" graphs)
        self._variants: Dict[str, "CompiledLoRAGraph"] = {}

    # ---------------------------------------------------------------- checks
    def _check_mapping(self, token_dims) -> None:
        if self.meta.is_warming_up:
            return  # precompile: every token on the base model, whatever the call's size
        want = math.prod(token_dims) if token_dims is not None else None
        # Before the mapping checks: no mapping can be that long, so its length is not the news.
        if want is not None and want > self.meta.max_num_tokens:
            raise ValueError(
                f"this call has {want} tokens (token dims {list(token_dims)}), more than "
                f"max_num_tokens={self.meta.max_num_tokens}; split the batch or create the LoRAMetadata with a "
                "larger max_num_tokens")
        if self.report.sites and not self.meta.has_mapping:
            raise UnsupportedMappingError(
                "no adapter mapping: call meta.set_request_adapters([...]) (one entry per batch row) or "
                "meta.set_token_adapters([...]) (one per token) before running the compiled model")
        if token_dims is not None:
            self.meta.check_mapping_fits(token_dims)  # refuses a mapping that does not fit this call
        if self.leftovers and self.meta.has_mapping:
            self._check_uniform(self.meta.mapped_slots())

    def _check_uniform(self, values: set) -> None:
        """Layers left alone compute one adapter (None: the base model) for every token: accept only
        ``values`` == that."""
        both = sorted(set(self.leftovers) & {s.site for s in self.report.sites})
        if both:
            raise UnsupportedMappingError(
                f"this compiled graph rewrote LoRA sites {both} but also holds another active adapter's branch "
                f"there, left alone (PEFT adds every active adapter's branch: set_adapter([...])), so no mapping "
                f"is served exactly; activate one adapter (model.set_adapter(name)) before compiling: the "
                f"mapping serves every registered adapter whichever is active")
        active = {ref.adapter for ref in self.leftovers.values()}
        slots = {NO_LORA if a is None else self.meta.slots.index(a) if a in self.meta.slots else None
                 for a in active}
        if len(slots) == 1 and None not in slots and values == slots:
            return
        reasons = {n.site: n.reason for n in self.report.near_misses}
        if self.report.error:  # no pattern ran at all: the failure is the reason
            reasons = dict.fromkeys(self.leftovers, f"the rewrite failed and the graph was compiled unrewritten "
                                                    f"({self.report.error})")
        layers = "; ".join(f"{site} ({_computes(ref.adapter)}): {reasons.get(site, 'not rewritten')}"
                           for site, ref in sorted(self.leftovers.items()))
        raise UnsupportedMappingError(
            f"this compiled graph holds LoRA layers that were not rewritten, which compute the active "
            f"adapter {sorted(a if a is not None else '(base model)' for a in active)} for every token, so it "
            f"only accepts a mapping with every token on that adapter; got slots {sorted(values)}. "
            f"Layers: {layers}")

    # ------------------------------------------------------------------- call
    def __call__(self, *args):
        args = list(args[: self.num_args]) if len(args) > self.num_args else list(args)
        bindings = self.shapes.bind(args)
        token_dims = self.shapes.token_dims(bindings)
        self._check_mapping(token_dims if token_dims is not None else self._leftover_token_dims(bindings))
        padded = self._padded_bindings(bindings)
        padded_dims = self.shapes.token_dims(padded)
        chosen = self.graph_for_call(token_dims, padded_dims)
        if chosen is not self:
            return chosen(*args)
        if self.report.sites:  # the stacks this graph reads follow the model's own LoRA tensors and scalings
            self.scaling_inputs.check(self.meta, args)
            self.meta.sync_model_weights(mapped_only=True)
        key = self.program_inputs.key(padded, args)
        if padded != bindings:  # a device whose writes compile (XLA) pads on the host: only transfers per size
            call_args = self.shapes.pad_args(args, padded, on_host=runtimes.for_inputs(args).compiles_writes)
        else:
            call_args = args
        call_args = self.program_inputs.contiguous(call_args)
        device = _first_device(args)
        extras = self._inputs(self.meta, device, token_dims, padded_dims)
        program = self.programs.get(key)
        if program is None:
            program = self._compile(key, call_args + extras)
        # A bucket is the padded token dims (every size, for a graph with no token layout).
        bucket = tuple(padded_dims) if padded_dims is not None and not self.shapes.not_bucketable else key
        self.meta.count("bucket_hits", bucket)
        if token_dims is not None:
            self.meta.count("real_tokens", n=math.prod(token_dims))
            self.meta.count("padded_tokens", n=math.prod(padded_dims) - math.prod(token_dims))
        outs = program(*call_args, *extras)
        return self.shapes.slice_outputs(outs, bindings) if padded != bindings else outs

    def graph_for_call(self, token_dims, padded_dims) -> "CompiledLoRAGraph":
        """The per-call kernel choice: the cheapest rewrite of this graph that is exact for the mapping.

        Rows shorter than the setting ``row_kernel_min_tokens`` (1 by default,
        so none): the fallback kernel.  Otherwise the first kernel of the
        table whose rewrite runs it and whose ``fits`` accepts the mapping
        (``kernels.table.choose``; the table's docstring tells the order).  A
        graph rewritten with a fixed kernel, or with no site, always runs
        itself.
        """
        if self.source is None or padded_dims is None:
            return self
        if padded_dims[-1] < self.context.settings.row_kernel_min_tokens:
            return self.variant(FALLBACK)  # rows below the row kernel's minimum length
        def requests_of(name):
            return self.variant(name).extra_requests

        warming = self.context.warming_kernel()
        if warming == AUTO:
            return self
        if warming is not None:
            # What a call from that kernel on runs: a bucket the kernel does not fit warms the one it falls to.
            return self.variant(
                choose(self.meta, requests_of, token_dims, padded_dims, self.context.settings, start=warming))
        if self.meta.is_warming_up:
            return self  # warming without a named kernel (precompile_generate) warms "auto"'s own programs
        return self.variant(choose(self.meta, requests_of, token_dims, padded_dims, self.context.settings))

    def variant(self, kernel: str) -> "CompiledLoRAGraph":
        """This graph rewritten with ``kernel`` ("auto" and the kernel "auto" rewrites with: itself), built once,
        on first need.

        An "auto" graph that runs no kernel but the fallback already is the
        fallback's rewrite; a rewrite with a kernel that applies to no site is
        the fallback's.
        """
        if kernel in (AUTO, FIRST) or self.source is None or (kernel == FALLBACK and not self.kernels):
            return self
        if kernel not in self._variants:
            gm, example_inputs = self.source
            log.info("rewriting the graph with the %s kernel too, for this call's mapping", kernel)
            built = self.context.remake(gm, example_inputs, kernel)
            if kernel != FALLBACK and kernel not in built.kernels:
                built = self.variant(FALLBACK)
            self._variants[kernel] = built
        return self._variants[kernel]

    @property
    def variants(self) -> Dict[str, "CompiledLoRAGraph"]:
        """The rewrites of this graph with other kernels made so far, by kernel name."""
        return dict(self._variants)

    def _leftover_token_dims(self, bindings) -> Optional[tuple]:
        """This call's token dims read off a LoRA layer left alone (None if unknown); for the checks only."""
        if self.leftover_layout is None:
            return None
        free = set().union(*(d.free_symbols for d in self.leftover_layout if not isinstance(d, int)))
        if not free <= set(bindings):
            return None
        return tuple(evaluate(d, bindings) for d in self.leftover_layout)

    def _padded_bindings(self, bindings):
        if self.shapes.not_bucketable:
            return dict(bindings)
        padded = dict(bindings)
        layout = self.shapes.token_layout
        innermost = layout[-1] if layout else None
        for sym in self.shapes.padded_symbols:
            policy = self.context.buckets if (layout is None or sym == innermost) else self.context.batch_buckets
            padded[sym] = policy.pad(bindings[sym])
        if layout is not None:
            total = math.prod(int(d) if isinstance(d, int) else padded[d] for d in layout)
            if total > self.meta.max_num_tokens:
                raise ValueError(f"{total} padded tokens (real: "
                                 f"{math.prod(int(d) if isinstance(d, int) else bindings[d] for d in layout)}) "
                                 f"exceed max_num_tokens={self.meta.max_num_tokens}")
        return padded

    def _compile(self, key, example_args) -> Callable:
        log.info("compiling program for bucket %s", key)
        gm = self.program_inputs.program_graph(self.gm, example_args)
        if self.static:  # an inner backend that takes no symbolic sizes: the graph at this bucket's sizes
            program = compile_static(gm, self.inner, example_args)
        else:
            program = self.inner(gm if gm is not self.gm else copy_graph_module(gm), list(example_args))
        self.programs[key] = program
        self.meta.count("compiles")
        return program


def _computes(adapter: Optional[str]) -> str:
    return "the base model" if adapter is None else f"adapter {adapter!r}"


def _leftover_token_layout(gm: fx.GraphModule) -> Optional[tuple]:
    """Token dims of the LoRA layers left in a graph, as size expressions (None if none found).

    Lets a fallback graph refuse a mapping of the wrong length or too many
    tokens as a rewritten one does.
    """
    dims = find_token_layout(gm)
    if dims is None:
        return None
    return tuple(size_expr(d) for d in dims)


def _first_device(args) -> torch.device:
    for a in args:
        if isinstance(a, torch.Tensor):
            return a.device
    return torch.device("cpu")
