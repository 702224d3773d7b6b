"""``xla-lora-dump MODULE:FACTORY``: a model's Dynamo graphs before and after the rewrite.

The factory returns ``(model, example_inputs)``; the tool registers the
model's adapters with a fresh ``LoRAMetadata``, captures every graph Dynamo
makes for one call with a recording backend, runs ``xla_lora_pass.rewrite`` on
each, and renders text, HTML or DOT.  ``--backend`` compiles through
``make_backend`` instead and adds ``meta.stats``.  Prints live here, in the
CLI, and nowhere in the passes.
"""
from __future__ import annotations

import argparse
import importlib
import logging
import math
import os
import sys
import tempfile
import webbrowser
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.fx as fx

from graph_rewrites import RewriteReport

from .. import runtimes
from ..shapes.bucketing import Buckets
from ..metadata.lora_metadata import LoRAMetadata
from ..backend.rewrite import capture_graphs as capture
from ..backend.rewrite import compile_once
from .views import GraphDump, render_dot, render_html, render_text

# ------------------------------------------------------------ the CLI

DEFAULT_FACTORY = "xla_lora_pass.demo_models:demo_llama"


class DumpError(Exception):
    """A problem with what the user asked the dump tool for (bad factory, bad bucket spec)."""


def load_factory(spec: str) -> Callable:
    """The callable named by ``MODULE:FACTORY``."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise DumpError(f"expected MODULE:FACTORY (e.g. {DEFAULT_FACTORY}), got {spec!r}")
    # As ``python -m`` does, and as a console script does not: find modules of the current directory.
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise DumpError(f"cannot import {module_name!r} (from {spec!r}): {exc}") from exc
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise DumpError(f"{module_name} has no callable {attr!r}")
    return factory


def call_factory(factory: Callable) -> Tuple[torch.nn.Module, tuple, dict]:
    """``(model, args, kwargs)`` from a factory returning ``(model, dict | tuple | tensor)``."""
    result = factory()
    if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], torch.nn.Module)):
        raise DumpError(f"{getattr(factory, '__name__', factory)}() must return (model, example_inputs), "
                        f"got {type(result).__name__}")
    model, inputs = result
    if isinstance(inputs, dict):
        return model, (), dict(inputs)
    if isinstance(inputs, torch.Tensor):
        return model, (inputs,), {}
    if isinstance(inputs, (tuple, list)):
        return model, tuple(inputs), {}
    raise DumpError(f"example inputs must be a dict of keyword arguments, a tuple or a tensor, "
                    f"got {type(inputs).__name__}")


def capture_graphs(model, args: Sequence, kwargs: Dict) -> List[Tuple[fx.GraphModule, list]]:
    """Every (GraphModule, example_inputs) Dynamo hands a backend for one call of ``model``."""
    return capture(model, *args, **kwargs)


def dump_model(model, args: Sequence, kwargs: Dict, meta: LoRAMetadata) -> List[GraphDump]:
    """Capture ``model``'s graphs and rewrite each with ``meta``: the pass alone, nothing compiled."""
    from ..backend.rewrite import rewrite

    return [GraphDump(i, gm, *rewrite(gm, example_inputs, meta))
            for i, (gm, example_inputs) in enumerate(capture_graphs(model, args, kwargs))]


def _uniform_mapping(meta: LoRAMetadata, report: RewriteReport) -> None:
    """Every token on the adapter the graph has active: a mapping every graph accepts, near misses included."""
    layout = report.token_layout or (report.sites[0].x_shape[:-1] if report.sites else None)
    if not report.sites or layout is None:
        return
    tokens = math.prod(int(d) for d in layout)
    meta.set_token_adapters([report.sites[0].adapter] * tokens)


def dump_through_backend(model, args: Sequence, kwargs: Dict, meta: LoRAMetadata, buckets: Buckets,
                         inner=None) -> List[GraphDump]:
    """Compile ``model`` with ``make_backend`` and call it once; ``meta.stats`` then counts the compiles."""
    from ..backend.lora_backend import make_backend

    backend = make_backend(meta, buckets=buckets, inner=inner)
    seen = []

    def recording(gm, example_inputs):
        compiled = backend(gm, example_inputs)
        seen.append((gm, compiled))
        # The mapping must match this call's token count, known only now.
        _uniform_mapping(meta, compiled.report)
        return compiled

    compile_once(model, recording, *args, **kwargs)
    return [GraphDump(i, gm, compiled.gm, compiled.report) for i, (gm, compiled) in enumerate(seen)]


def parse_buckets(spec: Optional[str], max_num_tokens: int) -> Buckets:
    """``pow2:MIN:MAX``, ``pow2_then_gap:MIN:GAP:MAX`` or ``8,16,64``; None: the backend's default."""
    if spec is None:
        return Buckets.pow2(min=8, max=max_num_tokens)
    kind, _, rest = spec.partition(":")
    try:
        numbers = [int(x) for x in rest.split(":")] if rest else []
        if kind == "pow2" and len(numbers) == 2:
            return Buckets.pow2(min=numbers[0], max=numbers[1])
        if kind == "pow2_then_gap" and len(numbers) == 3:
            return Buckets.pow2_then_gap(min=numbers[0], gap=numbers[1], max=numbers[2])
        if not rest:
            return Buckets([int(x) for x in kind.split(",")])
    except ValueError as exc:
        raise DumpError(f"bad --buckets {spec!r}: {exc}") from exc
    raise DumpError(f"bad --buckets {spec!r}: expected pow2:MIN:MAX, pow2_then_gap:MIN:GAP:MAX or 8,16,64")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="xla-lora-dump",
        description="Show the Dynamo graphs of a model before and after the LoRA rewrite, with a report of "
                    "every LoRA site rewritten and every near miss.")
    p.add_argument("factory", nargs="?", default=DEFAULT_FACTORY,
                   help=f"MODULE:FACTORY returning (model, example inputs); default {DEFAULT_FACTORY}; "
                        "also xla_lora_pass.demo_models:demo_llama_with_near_misses (near misses)")
    p.add_argument("--format", choices=("text", "html", "dot"), default="text")
    p.add_argument("-o", "--output", help="write here instead of stdout")
    p.add_argument("--open", action="store_true", help="open the HTML view in a browser (--format html)")
    p.add_argument("--backend", action="store_true",
                   help="compile through make_backend and run once; adds meta.stats (compile count, bucket hits)")
    p.add_argument("--buckets", help="pow2:MIN:MAX, pow2_then_gap:MIN:GAP:MAX or 8,16,64 "
                                     "(default pow2:8:MAX_NUM_TOKENS, as make_backend)")
    p.add_argument("--max-num-tokens", type=int, default=8192, help="LoRAMetadata(max_num_tokens=...)")
    p.add_argument("--device", default="cpu",
                   help="where the model runs: cpu, cuda, xla (torch_xla; PJRT_DEVICE=CPU unless set) or tpu "
                        "(TorchTPU)")
    p.add_argument("--inner", help="inner backend for --backend (default: the device's: openxla on xla, tpu on "
                                   "tpu, inductor otherwise)")
    p.add_argument("--no-graphs", action="store_true", help="text format: the report and tables only")
    p.add_argument("-v", "--verbose", action="store_true", help="log the pass at INFO level")
    return p


def _to_device(value, device):
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):
        return {k: _to_device(v, device) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return type(value)(_to_device(v, device) for v in value)
    return value


def render(fmt: str, dumps: Sequence[GraphDump], buckets: Buckets, stats, title: str, graphs: bool = True) -> str:
    """The chosen view as a string."""
    if fmt == "html":
        return render_html(dumps, buckets, stats, title)
    if fmt == "dot":
        return render_dot(dumps)
    return render_text(dumps, buckets, stats, title, graphs=graphs)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    opts = parser.parse_args(argv)
    if opts.open and opts.format != "html":
        parser.error("--open needs --format html")
    logging.basicConfig(level=logging.INFO if opts.verbose else logging.WARNING)
    try:
        buckets = parse_buckets(opts.buckets, opts.max_num_tokens)
        model, args, kwargs = call_factory(load_factory(opts.factory))
    except DumpError as exc:
        parser.error(str(exc))
    if opts.device != "cpu":
        if opts.device == "xla":
            os.environ.setdefault("PJRT_DEVICE", "CPU")  # before torch_xla loads: no accelerator needed
        device = runtimes.open_device(opts.device)
        model, args, kwargs = model.to(device), _to_device(args, device), _to_device(kwargs, device)
    meta = LoRAMetadata(max_num_tokens=opts.max_num_tokens)
    meta.register_adapters(model)
    if opts.backend:
        dumps = dump_through_backend(model, args, kwargs, meta, buckets, inner=opts.inner)
    else:
        dumps = dump_model(model, args, kwargs, meta)
    stats = meta.stats if opts.backend else None
    text = render(opts.format, dumps, buckets, stats, opts.factory, graphs=not opts.no_graphs)
    path = opts.output
    if path is None and opts.open:
        fd, path = tempfile.mkstemp(prefix="xla-lora-dump-", suffix=".html")
        os.close(fd)
    if path is None:
        sys.stdout.write(text)
    else:
        Path(path).write_text(text)
        print(f"wrote {path}")
    if opts.open:
        webbrowser.open(Path(path).resolve().as_uri())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
