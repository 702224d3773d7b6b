"""``make_backend``: the ``torch.compile`` backend that rewrites, buckets and compiles.

Per Dynamo graph: rewrite a copy (``rewrite.py``), read its symbolic shapes
(``bucketing.py``), and return a callable that, per call, checks the token
mapping, pads the inputs to the bucket, feeds the metadata's token indices
and stacked weights as extra graph inputs, runs the one static program
compiled for that bucket by the inner backend, and slices the outputs back.
"""
from __future__ import annotations

import logging
import math
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Union

import torch
import torch.fx as fx

from graph_rewrites import (LORA_INPUT, STACKED_A, STACKED_B, STACKED_BIAS, STACKED_DORA, TOKEN_INDICES, RewriteReport,
                            unrewritten_lora_weights)
from graph_rewrites.annotations import (LAYOUT_KINDS, POOLED_ROW_SLOTS, ROW_SLOTS, SAVED_MODULE_PARAM,
                                        SEGMENT_BLOCK_SLOTS, SEGMENT_KINDS, STACKED_A_T, STACKED_B_T)
from graph_rewrites.fx_values import size_expr
from graph_rewrites.site_inputs import find_token_layout

from . import config, symbolic_layer_norm
from .bucketing import Buckets, GraphShapes, evaluate
from .dump import dump_graphs
from .errors import UnsupportedMappingError
from .generation import attach_backend
from .metadata import NO_LORA, LoRAMetadata
from .rewrite import copy_graph_module, rewrite

log = logging.getLogger(__name__)


def _inner_compiler(inner: Union[str, Callable, None], example_inputs: Sequence) -> Callable:
    if inner is None:
        on_xla = any(isinstance(t, torch.Tensor) and t.device.type == "xla" for t in example_inputs)
        inner = "openxla" if on_xla else "aot_eager"
    if isinstance(inner, str):
        from torch._dynamo import lookup_backend

        return lookup_backend(inner)
    return inner


class LoRABackend:
    """The callable handed to ``torch.compile(backend=...)``."""

    def __init__(self, meta: LoRAMetadata, buckets: Optional[Buckets] = None,
                 inner: Union[str, Callable, None] = None, batch_buckets: Optional[Buckets] = None):
        self.meta = meta
        self.buckets = buckets if buckets is not None else Buckets.pow2(min=8, max=meta.max_num_tokens)
        # Leading token dims (the batch of a [B, S] model) start at 1: a batch
        # of 2 padded to 8 would cost 4x for nothing.
        self.batch_buckets = batch_buckets if batch_buckets is not None else Buckets.pow2(min=1, max=self.buckets.max)
        self.inner = inner
        self.graphs: List["CompiledLoRAGraph"] = []
        self.warming_kernel: Optional[str] = None  # precompile: the kernel every call runs while set

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence) -> Callable:
        compiled = self.rewrite_and_wrap(gm, example_inputs, config.kernel)
        for pattern, n in compiled.report.counts().items():
            self.meta._count("rewrites", pattern, n)
        if compiled.report.error:
            self.meta._count("fallbacks")
        self.graphs.append(compiled)
        return compiled

    def rewrite_and_wrap(self, gm: fx.GraphModule, example_inputs: Sequence, kernel: str) -> "CompiledLoRAGraph":
        """Rewrite Dynamo's graph with ``kernel`` and wrap it (its programs compile on first call)."""
        new_gm, report = rewrite(gm, example_inputs, self.meta, kernel=kernel)
        log.info("graph %d (%s kernel): %s", len(self.graphs), kernel, report.format())
        # Every compile: TORCH_TRACE artifacts always, files only when dump_dir is set.
        dump_graphs(config.dump_dir, gm, new_gm, report)
        compiled = CompiledLoRAGraph(self, new_gm, report, len(example_inputs),
                                     _inner_compiler(self.inner, example_inputs))
        if kernel == "auto" and report.sites:
            # For mappings "auto"'s first choice cannot run: the same Dynamo graph rewritten with another
            # kernel, made the first time one comes (Dynamo's graph is never edited, so it can be reread).
            compiled.source = (gm, list(example_inputs))
        return compiled

    def precompile(self, run: Callable[[int], Any], sizes: Optional[Iterable[int]] = None,
                   progress: bool = True, mixed_rows: bool = True, kernels: Optional[Sequence[str]] = None) -> int:
        """Warm every bucket before serving; returns the number of programs compiled.

        ``run(n)`` must call the compiled model once with ``n`` tokens in the
        bucketed dim (e.g. ``lambda n: model(input_ids=ids[:, :n])``).  It is
        called for 2 and 1 first (Dynamo's first static trace and its size-1
        specialization), then for every bucket size, with every token on the
        base model, once per kernel serving will use: ``kernels`` names them
        ("auto": the row kernel, one adapter per request; "segments": packed
        requests; "masked": adapters mixed within a request, warmed for rows of
        two tokens or more).  The default is ("auto", "masked"), or ("auto",)
        with ``mixed_rows=False`` when every request has one adapter, which
        halves the work.
        """
        sizes = list(sizes) if sizes is not None else [2, 1] + list(self.buckets)
        kernels = list(kernels) if kernels is not None else ["auto"] + (["masked"] if mixed_rows else [])
        before = self.meta.stats["compiles"]
        with self.meta.warming_up(), progress_bar(sizes, "precompile", progress) as bar:
            for n in bar:
                bar.set_postfix_str(f"{n} tokens")
                with torch.no_grad():
                    for kernel in kernels:
                        # A kernel no graph has a rewrite for would only run the same programs again, and
                        # rows of one token cannot mix adapters: no masked program to warm for them.
                        if kernel != "auto" and not any(g.variant(kernel) is not g for g in self.graphs):
                            continue
                        if kernel == "masked" and n == 1:
                            continue
                        self.warming_kernel = kernel
                        try:
                            run(n)
                        finally:
                            self.warming_kernel = None
        return self.meta.stats["compiles"] - before

    def precompile_generate(self, model, batch_sizes: Iterable[int], prompt_lengths: Iterable[int],
                            max_new_tokens: int, progress: bool = True) -> int:
        """Warm the prompt and decode programs ``model.generate`` will run; returns the programs compiled.

        One short generate per (batch size, prompt length), on a static cache
        of the length a real generate of ``max_new_tokens`` gets (the token
        bucket of prompt + new tokens), every token on the base model.
        ``model`` is the registered model (or its ``torch.compile`` wrapper).
        docs/user-guide.md, "Generation".
        """
        from .generation import warm_generate

        shapes = [(b, s) for b in batch_sizes for s in prompt_lengths]
        before = self.meta.stats["compiles"]
        with self.meta.warming_up(), progress_bar(shapes, "precompile generate", progress) as bar:
            for batch, length in bar:
                bar.set_postfix_str(f"batch {batch}, prompt {length}")
                warm_generate(self, model, batch, length, max_new_tokens)
        return self.meta.stats["compiles"] - before


def progress_bar(items, label: str, enabled: bool = True):
    """A tqdm bar over ``items``, silent when ``enabled`` is False."""
    from tqdm.auto import tqdm

    return tqdm(items, desc=label, disable=not enabled, leave=False)


class CompiledLoRAGraph:
    """One rewritten Dynamo graph and its per-bucket programs."""

    def __init__(self, backend: LoRABackend, gm: fx.GraphModule, report: RewriteReport, num_args: int,
                 inner: Callable):
        self.backend = backend
        self.meta = backend.meta
        self.gm = gm
        self.report = report
        self.num_args = num_args
        self.inner = inner
        self.extra_requests = [n.meta[LORA_INPUT] for n in gm.graph.find_nodes(op="placeholder")
                               if LORA_INPUT in n.meta]
        layout = report.token_layout if report.sites else None
        self.shapes = GraphShapes.analyze(gm, num_args, layout)
        if self.shapes.not_bucketable:
            log.info("graph compiled per exact shape: %s", self.shapes.not_bucketable)
        self.leftovers = unrewritten_lora_weights(gm)
        # A graph with no rewritten site still has token dims: those of a LoRA layer left alone.
        self.leftover_layout = _leftover_token_layout(gm) if self.leftovers and not report.sites else None
        self.programs: Dict[tuple, Callable] = {}
        self.uses_rows = any(r.kind == ROW_SLOTS for r in self.extra_requests)
        # (tokens, slots) per block of the segment kernel's layout, when this graph runs it.
        self.segment_blocks = next((r.blocks for r in self.extra_requests if r.kind == SEGMENT_BLOCK_SLOTS), None)
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
            self.meta.token_mapping(token_dims)  # refuses a mapping that does not fit this call
        if self.leftovers and self.meta.has_mapping:
            self._check_uniform(self.meta.mapped_slots())

    def _check_uniform(self, values: set) -> None:
        """Layers left alone compute one adapter (None: the base model) for every token: accept only
        ``values`` == that."""
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
        key = self._program_key(padded)
        call_args = self.shapes.pad_args(args, padded) if padded != bindings else args
        device = _first_device(args)
        extras = self._extra_inputs(device, token_dims, padded_dims)
        program = self.programs.get(key)
        if program is None:
            program = self._compile(key, call_args + extras)
        # A bucket is the padded token dims (every size, for a graph with no token layout).
        bucket = tuple(padded_dims) if padded_dims is not None and not self.shapes.not_bucketable else key
        self.meta._count("bucket_hits", bucket)
        if token_dims is not None:
            self.meta._count("real_tokens", n=math.prod(token_dims))
            self.meta._count("padded_tokens", n=math.prod(padded_dims) - math.prod(token_dims))
        outs = program(*call_args, *extras)
        return self.shapes.slice_outputs(outs, bindings) if padded != bindings else outs

    def graph_for_call(self, token_dims, padded_dims) -> "CompiledLoRAGraph":
        """The per-call kernel choice: the cheapest rewrite of this graph that is exact for the mapping.

        Rows shorter than ``config.row_kernel_min_tokens`` (1 by default, so
        none): the masked kernel.  One adapter per row of the token grid
        (decoding's rows of one token always are): the row kernel (this
        graph, as "auto" rewrote it); else every block of consecutive tokens on at most
        ``config.segment_slots_per_block`` slots (requests packed as segments):
        the segment kernel; anything else: the masked kernel.  Results never
        depend on the choice, only cost does.  A graph rewritten with a fixed
        kernel, or with no site, always runs itself.
        """
        if self.source is None or padded_dims is None:
            return self
        if padded_dims[-1] < config.row_kernel_min_tokens:
            return self.variant("masked")  # rows below the row kernel's minimum length
        if self.backend.warming_kernel is not None:
            return self.variant(self.backend.warming_kernel)
        if self.meta.is_warming_up or (self.uses_rows and self.meta.rows_uniform(token_dims)):
            return self  # warming without a named kernel (precompile_generate) warms "auto"'s own programs
        segments = self.variant("segments")
        if segments.segment_blocks is not None and self.meta.segments_fit(token_dims, padded_dims,
                                                                           *segments.segment_blocks):
            return segments
        return self.variant("masked")

    def variant(self, kernel: str) -> "CompiledLoRAGraph":
        """This graph rewritten with ``kernel`` ("auto": itself), built once, on first need.

        An "auto" graph without the row kernel already runs the masked kernel;
        a segment rewrite with no site on the token layout is the masked one.
        """
        if kernel == "auto" or self.source is None or (kernel == "masked" and not self.uses_rows):
            return self
        if kernel not in self._variants:
            gm, example_inputs = self.source
            log.info("rewriting the graph with the %s kernel too, for this call's mapping", kernel)
            built = self.backend.rewrite_and_wrap(gm, example_inputs, kernel)
            if kernel == "segments" and built.segment_blocks is None:
                built = self.variant("masked")
            self._variants[kernel] = built
        return self._variants[kernel]

    @property
    def variants(self) -> Dict[str, "CompiledLoRAGraph"]:
        """The rewrites of this graph with other kernels made so far, by kernel name."""
        return dict(self._variants)

    def masked_variant(self) -> "CompiledLoRAGraph":
        """This graph rewritten with the masked kernel (built once, on first need)."""
        return self.variant("masked")

    def _leftover_token_dims(self, bindings) -> Optional[tuple]:
        """This call's token dims read off a LoRA layer left alone (None if unknown); for the checks only."""
        if self.leftover_layout is None:
            return None
        free = set().union(*(d.free_symbols for d in self.leftover_layout if not isinstance(d, int)))
        if not free <= set(bindings):
            return None
        return tuple(evaluate(d, bindings) for d in self.leftover_layout)

    def _program_key(self, padded) -> tuple:
        """One program per key: every size symbol's value (padded for token dims, real for the others).

        A program is specialised on every size of its inputs, not only the
        token dims: a KV-cache or encoder length that changes under the same
        token dims must get its own program, never reuse another's.
        """
        return tuple((str(s), padded[s]) for s in sorted(padded, key=str))

    def _padded_bindings(self, bindings):
        if self.shapes.not_bucketable:
            return dict(bindings)
        padded = dict(bindings)
        layout = self.shapes.token_layout
        innermost = layout[-1] if layout else None
        for sym in self.shapes.padded_symbols:
            policy = self.backend.buckets if (layout is None or sym == innermost) else self.backend.batch_buckets
            padded[sym] = policy.pad(bindings[sym])
        if layout is not None:
            total = math.prod(int(d) if isinstance(d, int) else padded[d] for d in layout)
            if total > self.meta.max_num_tokens:
                raise ValueError(f"{total} padded tokens (real: "
                                 f"{math.prod(int(d) if isinstance(d, int) else bindings[d] for d in layout)}) "
                                 f"exceed max_num_tokens={self.meta.max_num_tokens}")
        return padded

    def _extra_inputs(self, device, token_dims, padded_dims) -> List[torch.Tensor]:
        return lora_graph_inputs(self.meta, self.extra_requests, device, token_dims, padded_dims)

    def _compile(self, key, example_args) -> Callable:
        log.info("compiling program for bucket %s", key)
        program = self.inner(copy_graph_module(self.gm), list(example_args))
        self.programs[key] = program
        self.meta._count("compiles")
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


def lora_graph_inputs(meta: LoRAMetadata, requests, device, token_dims, padded_dims) -> List[torch.Tensor]:
    """The tensors for a rewritten graph's added placeholders, in their order."""
    extras = []
    for req in requests:
        if req.kind == TOKEN_INDICES:
            extras.append(meta.token_indices(device, token_dims, padded_dims))
        elif req.kind == ROW_SLOTS:
            extras.append(meta.row_slots(device, token_dims, padded_dims))
        elif req.kind == POOLED_ROW_SLOTS:
            extras.append(meta.row_slots(device, token_dims, padded_dims, pooled=True))
        elif req.kind == SAVED_MODULE_PARAM:
            extras.append(meta.saved_tensor(req.site, *req.param, device))
        elif req.kind == STACKED_A:
            extras.append(meta.stacked_a(req.site, device))
        elif req.kind == STACKED_A_T:
            extras.append(meta.stacked_a(req.site, device, transposed=True))
        elif req.kind == STACKED_B_T:
            extras.append(meta.stacked_b(req.site, device, transposed=True))
        elif req.kind == STACKED_B:
            extras.append(meta.stacked_b(req.site, device))
        elif req.kind == STACKED_BIAS:
            extras.append(meta.stacked_bias(req.site, device))
        elif req.kind == STACKED_DORA:
            extras.append(meta.stacked_dora(req.site, device))
        elif req.kind in LAYOUT_KINDS:
            extras.append(meta.block_layout(device, token_dims, padded_dims)[LAYOUT_KINDS.index(req.kind)])
        elif req.kind in SEGMENT_KINDS:
            extras.append(meta.segment_layout(device, token_dims, padded_dims, *req.blocks)[SEGMENT_KINDS.index(req.kind)])
        else:
            raise AssertionError(f"unknown graph input request {req}")
    return extras


def _first_device(args) -> torch.device:
    for a in args:
        if isinstance(a, torch.Tensor):
            return a.device
    return torch.device("cpu")


def make_backend(meta: LoRAMetadata, buckets: Optional[Buckets] = None, inner: Union[str, Callable, None] = None,
                 batch_buckets: Optional[Buckets] = None) -> LoRABackend:
    """The backend for ``torch.compile(model, backend=make_backend(meta))``."""
    symbolic_layer_norm.install()  # before Dynamo traces: LayerNorm models need it to bucket
    # torch_xla turns automatic dynamic shapes off when imported, so every new token count would be a new
    # static graph (and past recompile_limit, eager).  torch.compile(dynamic=False) still opts out.
    if not torch._dynamo.config.automatic_dynamic_shapes:
        log.info("turning Dynamo's automatic_dynamic_shapes back on (torch_xla turns it off) for bucketing")
        torch._dynamo.config.automatic_dynamic_shapes = True
    from .xla_cpu_flags import CPU_SCHEDULER_STATUS
    if CPU_SCHEDULER_STATUS.startswith("too late"):
        log.warning("XLA:CPU started before xla_lora_pass was imported, so it keeps its breadth-first scheduler, "
                    "measured 1.4x slower on LoRA graphs here: import xla_lora_pass before the first "
                    "torch_xla.device(), or set XLA_FLAGS=--xla_cpu_enable_concurrency_optimized_scheduler=false")
    backend = LoRABackend(meta, buckets=buckets, inner=inner, batch_buckets=batch_buckets)
    attach_backend(meta, backend)  # the registered model's generate runs through it (generation.py)
    return backend
