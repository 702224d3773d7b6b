"""``make_backend``: the ``torch.compile`` backend that rewrites, buckets and compiles.

Per Dynamo graph: rewrite a copy (``backend/rewrite.py``) and wrap it in a
``CompiledLoRAGraph`` (``backend/compiled_graph.py``), which reads its symbolic
shapes (``shapes/bucketing.py``) and, per call, runs the program for the call's
bucket and kernel.  ``precompile`` warms those programs before serving.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Iterable, List, Optional, Sequence, Union

import torch
import torch.fx as fx

from .. import config
from ..dump import dump_graphs
from ..kernels.table import AUTO, FALLBACK, MIXED
from ..metadata import LoRAMetadata
from ..serving import ModelServing
from ..serving.generate import warm_generate
from ..shapes import Buckets
from .. import runtimes
from .compiled_graph import CompiledLoRAGraph, GraphContext
from .inner_backend import inner_compiler
from .rewrite import rewrite

log = logging.getLogger(__name__)


class LoRABackend:
    """The callable handed to ``torch.compile(backend=...)``."""

    def __init__(self, meta: LoRAMetadata, buckets: Optional[Buckets] = None,
                 inner: Union[str, Callable, None] = None, batch_buckets: Optional[Buckets] = None,
                 settings: Optional[config.Settings] = None, static_shapes: Optional[bool] = None):
        self.meta = meta
        self.settings = settings if settings is not None else config.snapshot()
        self.buckets = buckets if buckets is not None else Buckets.pow2(min=8, max=meta.max_num_tokens)
        # Leading token dims (the batch of a [B, S] model) start at 1: a batch
        # of 2 padded to 8 would cost 4x for nothing.
        self.batch_buckets = batch_buckets if batch_buckets is not None else Buckets.pow2(min=1, max=self.buckets.max)
        self.inner = inner
        self.static_shapes = static_shapes  # None: as the inner backend takes them (static_shapes_for)
        self.graphs: List["CompiledLoRAGraph"] = []
        self.warming_kernel: Optional[str] = None  # precompile: the kernel every call runs while set
        self.context = GraphContext(meta, self.buckets, self.batch_buckets, self.settings,
                                    remake=self.rewrite_and_wrap, warming_kernel=lambda: self.warming_kernel)
        self.serving = ModelServing(self)  # what make_backend installs on the registered model

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence) -> Callable:
        compiled = self.rewrite_and_wrap(gm, example_inputs, self.settings.kernel)
        for pattern, n in compiled.report.counts().items():
            self.meta.count("rewrites", pattern, n)
        if compiled.report.error:
            self.meta.count("fallbacks")
        self.graphs.append(compiled)
        return compiled

    def static_shapes_for(self, example_inputs: Sequence) -> bool:
        """Whether a graph with these inputs goes to its inner backend as one static graph per bucket: as
        ``static_shapes`` says, else as the inner backend needs (runtimes.static_shapes_only: TorchTPU's)."""
        if self.static_shapes is not None:
            return self.static_shapes
        return runtimes.static_shapes_only(self.inner, example_inputs)

    def rewrite_and_wrap(self, gm: fx.GraphModule, example_inputs: Sequence, kernel: str) -> "CompiledLoRAGraph":
        """Rewrite Dynamo's graph with ``kernel`` and wrap it (its programs compile on first call)."""
        new_gm, report = rewrite(gm, example_inputs, self.meta, kernel=kernel, settings=self.settings)
        log.info("graph %d (%s kernel): %s", len(self.graphs), kernel, report.format())
        # Every compile: TORCH_TRACE artifacts always, files only when dump_dir is set.
        dump_graphs(self.settings.dump_dir, gm, new_gm, report)
        compiled = CompiledLoRAGraph(self.context, new_gm, report, len(example_inputs),
                                     inner_compiler(self.inner, example_inputs),
                                     static=self.static_shapes_for(example_inputs))
        if kernel == AUTO and report.sites:
            # For mappings "auto"'s first choice cannot run: the same Dynamo graph rewritten with another
            # kernel, made the first time one comes (Dynamo's graph is never edited, so it can be reread).
            compiled.source = (gm, list(example_inputs))
        return compiled

    def precompile(self, run: Callable[[int], Any], sizes: Optional[Iterable[int]] = None,
                   progress: bool = True, mixed_rows: bool = True, kernels: Optional[Sequence[str]] = None) -> int:
        """Warm every bucket before serving; returns the number of programs compiled.

        ``run(n)`` must call the compiled model once with ``n`` tokens in the
        bucketed dim (e.g. ``lambda n: model(input_ids=ids[:, :n].clone())``: a new tensor, as serving
        passes, not a view, which Dynamo would guard on its base).  It is
        called for 2 and 1 first (Dynamo's first static trace and its size-1
        specialization), then for every bucket size, with every token on the
        base model, once per kernel serving will use: ``kernels`` names them
        ("auto": the row kernel, one adapter per request; "segments": packed
        requests; "sorted": adapters mixed within a request, warmed for rows of
        two tokens or more, where a bucket too small for the sorted kernel
        warms the masked kernel it falls to, so each bucket gets the one
        program such a mapping runs; "masked": the masked kernel everywhere).
        The default is ("auto", "sorted"), or ("auto",) with
        ``mixed_rows=False`` when every request has one adapter, which halves
        the work.
        """
        sizes = list(sizes) if sizes is not None else [2, 1] + list(self.buckets)
        kernels = list(kernels) if kernels is not None else [AUTO] + ([MIXED] if mixed_rows else [])
        before = self.meta.stats["compiles"]
        with self.meta.warming_up(), progress_bar(sizes, "precompile", progress) as bar:
            for n in bar:
                bar.set_postfix_str(f"{n} tokens")
                with torch.no_grad():
                    for kernel in kernels:
                        # A kernel no graph has a rewrite for would only run the same programs again, and
                        # rows of one token cannot mix adapters: no mixed program to warm for them.
                        if kernel != AUTO and not any(g.variant(kernel) is not g for g in self.graphs):
                            continue
                        if kernel in (MIXED, FALLBACK) and n == 1:
                            continue
                        self.warming_kernel = kernel
                        try:
                            run(n)
                        finally:
                            self.warming_kernel = None
        return self.meta.stats["compiles"] - before

    def precompile_generate(self, model, batch_sizes: Iterable[int], prompt_lengths: Iterable[int],
                            max_new_tokens: int, progress: bool = True, **generate_kwargs) -> int:
        """Warm the prompt and decode programs ``model.generate`` will run; returns the programs compiled.

        One short generate per (batch size, prompt length), on a static cache
        of the length a real generate of ``max_new_tokens`` gets (the token
        bucket of prompt + new tokens; an encoder-decoder's caches: the
        decoder's, and the encoder's of the prompt length), every token on the base model.
        ``model`` is the registered model (or its ``torch.compile`` wrapper).
        docs/user-guide.md, "Generation".
        """

        shapes = [(b, s) for b in batch_sizes for s in prompt_lengths]
        before = self.meta.stats["compiles"]
        with self.meta.warming_up(), progress_bar(shapes, "precompile generate", progress) as bar:
            for batch, length in bar:
                bar.set_postfix_str(f"batch {batch}, prompt {length}")
                warm_generate(self.serving.route, model, batch, length, max_new_tokens, **generate_kwargs)
        return self.meta.stats["compiles"] - before


def progress_bar(items, label: str, enabled: bool = True):
    """A tqdm bar over ``items``, silent when ``enabled`` is False."""
    from tqdm.auto import tqdm

    return tqdm(items, desc=label, disable=not enabled, leave=False)


def make_backend(meta: LoRAMetadata, buckets: Optional[Buckets] = None, inner: Union[str, Callable, None] = None,
                 batch_buckets: Optional[Buckets] = None, settings: Optional[config.Settings] = None,
                 static_shapes: Optional[bool] = None) -> LoRABackend:
    """The backend for ``torch.compile(model, backend=make_backend(meta))``.

    ``inner``: the compile backend of each bucket's program (a backend or its
    name); default the device's (runtimes/): "openxla" on torch_xla's
    ``xla``, "tpu" on TorchTPU's ``tpu``, "inductor" on CPU and CUDA.
    ``static_shapes``: True hands ``inner`` one graph per bucket specialised
    to its sizes, for a backend that takes no symbolic shapes; default as the
    inner backend needs (True for TorchTPU's "tpu").

    ``settings``: default ``config.snapshot()``, the module's values now,
    read once.  The registered model (now, and after every later
    ``register_adapters``) gets this backend's eager guard and ``generate``
    route, replacing an earlier backend's.
    """
    runtimes.before_tracing()  # before Dynamo traces (torch_xla: LayerNorm models need it to bucket)
    # torch_xla turns automatic dynamic shapes off when imported, so every new token count would be a new
    # static graph (and past recompile_limit, eager).  torch.compile(dynamic=False) still opts out.
    if not torch._dynamo.config.automatic_dynamic_shapes:
        log.info("turning Dynamo's automatic_dynamic_shapes back on (torch_xla turns it off) for bucketing")
        torch._dynamo.config.automatic_dynamic_shapes = True
    backend = LoRABackend(meta, buckets=buckets, inner=inner, batch_buckets=batch_buckets, settings=settings,
                          static_shapes=static_shapes)
    previous = meta.set_server(backend.serving)
    if previous is not None:
        previous.detach()
    return backend
