"""The pass's own time against graph size, and its share of compile time.

    python bench/pass_time.py --layers 8 [--reps 5]

One process per layer count (``bench/run.py`` starts them), the step-time
model (hidden 512, all-linear LoRA r=16, 4 adapters) with L decoder layers:

* ``rewrite_s``: ``xla_lora_pass.rewrite`` alone on the graphs Dynamo captures
  (``xla_lora_pass.capture_graphs``), median of --reps runs;
* then the model compiled with this backend and run once on 128 tokens:
  ``rewrite_in_backend_s`` (the same pass, timed inside the real compile),
  ``xla_compile_s`` (torch_xla's CompileTime metric) and ``first_call_s``
  (Dynamo tracing + pass + XLA compile + one step, wall).
"""
from __future__ import annotations

import argparse
import statistics
import time

import _common  # noqa: F401  (sets PJRT_DEVICE before torch_xla loads)
import torch
from _common import xla_compile_stats
from _timing import emit
from step_time import BATCH, VOCAB, build_models

from xla_lora_pass import capture_graphs


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args(argv)

    import torch_xla

    import xla_lora_pass as xlp
    import xla_lora_pass.backend.lora_backend as backend_mod
    from xla_lora_pass.demo_models import per_sequence_mapping

    dev = torch_xla.device()
    _, model, names = build_models(args.adapters, layers=args.layers)
    model.to(dev)
    meta = xlp.LoRAMetadata(max_num_tokens=args.tokens)
    meta.register_adapters(model)
    seq = args.tokens // BATCH
    ids = torch.randint(0, VOCAB, (BATCH, seq), generator=torch.Generator().manual_seed(0)).to(dev)
    mapping = per_sequence_mapping([names[i % len(names)] for i in range(BATCH)], seq)
    meta.set_token_adapters(mapping)

    # 1. The pass alone on the captured graphs.
    start = time.perf_counter()
    graphs = capture_graphs(model, input_ids=ids)
    capture_s = time.perf_counter() - start
    nodes = sum(len(gm.graph.nodes) for gm, _ in graphs)
    runs, sites = [], 0
    for _ in range(args.reps):
        start = time.perf_counter()
        for gm, example_inputs in graphs:
            _, report = xlp.rewrite(gm, example_inputs, meta)
        runs.append(time.perf_counter() - start)
    sites = sum(report.counts().values()) if len(graphs) == 1 else None
    del graphs

    # 2. The same pass inside a real compile: backend.rewrite wrapped with a timer.
    inside = []
    orig = backend_mod.rewrite

    def timed_rewrite(*a, **kw):
        t0 = time.perf_counter()
        try:
            return orig(*a, **kw)
        finally:
            inside.append(time.perf_counter() - t0)

    backend_mod.rewrite = timed_rewrite
    compiled = torch.compile(model, backend=xlp.make_backend(meta))
    c0, s0 = xla_compile_stats()
    start = time.perf_counter()
    with torch.no_grad():
        compiled(input_ids=ids).logits.cpu()
    first_call_s = time.perf_counter() - start
    c1, s1 = xla_compile_stats()
    backend_mod.rewrite = orig
    emit(dict(layers=args.layers, graphs=1 if sites is not None else None, fx_nodes=nodes, sites=sites,
              rewrite_s=statistics.median(runs), rewrite_runs=runs, capture_s=capture_s,
              rewrite_in_backend_s=sum(inside), xla_compiles=c1 - c0, xla_compile_s=s1 - s0,
              first_call_s=first_call_s, backend_rewrites=dict(meta.stats["rewrites"])))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
