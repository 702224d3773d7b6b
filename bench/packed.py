"""Packed batches: requests as contiguous segments of one token row, against the base model, side by side.

    python bench/packed.py --adapters 16 [--tokens 512,2048] [--segments 8,32,128] [--layers 2] [--reps 5]

A Llama-style model (hidden 512, intermediate 1408, 8 heads, vocab 4096,
random weights, fp32; ``--layers`` decoder layers) with N PEFT adapters on
every linear of the decoder layers (r=16), as in ``bench/step_time.py``.  The
batch is ONE row of T tokens (``input_ids`` ``[1, T]``, how long prompts and
servers pack requests); configurations, each timed in steady state (compiled
and warmed up first, every step ends with ``logits.cpu()``):

* ``base``: the model with no LoRA, ``torch.compile(backend="openxla")``: every ratio's denominator.
* ``segments of L``: this backend with T/L requests of L tokens, request j on adapter j mod N,
  ``meta.set_token_adapters`` every step (alternating two such mappings, so every step builds its
  layout on the host).  The backend picks the kernel per call: the segment kernel when every block of
  ``config.segment_block_tokens`` tokens uses at most ``config.segment_slots_per_block`` adapters, else
  the sorted kernel (the table says which ran).
* ``random per-token mix``: every token on a random adapter of N: the sorted kernel.
* ``random per-token mix, masked kernel``: the same mappings through a second copy of the model whose
  backend is made with ``config.snapshot(kernel="masked")`` (what "auto" ran before the sorted kernel),
  side by side.

Before timing, each configuration's logits are checked against a per-token
eager reference on the CPU (``demo_models.per_token_reference``: the base model
plus each token's own adapter delta, plain matmuls); the largest absolute
difference is printed.  Each repetition runs every configuration once, in a
rotating order; ratios are taken within a repetition.
"""
from __future__ import annotations

import argparse
import copy
import os

import _common  # noqa: F401  (sets PJRT_DEVICE before torch_xla loads)
import torch
from _common import markdown_table
from _timing import ratios, summary, time_interleaved
from step_time import VOCAB, build_models


MASKED_MIX = "random per-token mix, masked kernel"


def segment_mapping(names, tokens: int, length: int, shift: int = 0) -> list:
    """Request j (tokens [j*length, (j+1)*length)) on adapter (j + shift) mod N."""
    return [names[(t // length + shift) % len(names)] for t in range(tokens)]


def random_mapping(names, tokens: int, seed: int) -> list:
    g = torch.Generator().manual_seed(seed)
    return [names[int(i)] for i in torch.randint(0, len(names), (tokens,), generator=g)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--adapters", type=int, default=16)
    parser.add_argument("--tokens", default="512,2048")
    parser.add_argument("--segments", default="8,32,128")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3, help="steps per configuration per repetition")
    parser.add_argument("--no-check", action="store_true", help="skip the per-token eager reference")
    parser.add_argument("--no-masked", action="store_true", help="skip the masked kernel's random-mix row")
    args = parser.parse_args(argv)

    import torch_xla

    import xla_lora_pass as xlp
    from xla_lora_pass.demo_models import per_token_reference

    dev = torch_xla.device()
    tokens = [int(t) for t in args.tokens.split(",")]
    lengths = [int(s) for s in args.segments.split(",") if s]
    base_cpu, peft_cpu, names = build_models(args.adapters, layers=args.layers)
    c_base = torch.compile(copy.deepcopy(base_cpu).to(dev), backend="openxla")
    model = copy.deepcopy(peft_cpu).to(dev)
    meta = xlp.LoRAMetadata(max_num_tokens=max(tokens))
    meta.register_adapters(model)
    backend = xlp.make_backend(meta)
    ours = torch.compile(model, backend=backend)
    if not args.no_masked:
        masked_meta = xlp.LoRAMetadata(max_num_tokens=max(tokens))
        masked_model = copy.deepcopy(peft_cpu).to(dev)
        masked_meta.register_adapters(masked_model)
        masked = torch.compile(masked_model, backend=xlp.make_backend(
            masked_meta, settings=xlp.config.snapshot(kernel="masked")))

    print(f"load (uptime): {os.getloadavg()}", flush=True)
    for t in tokens:
        ids = torch.randint(0, VOCAB, (1, t), generator=torch.Generator().manual_seed(t))
        ids_dev = ids.to(dev)
        configs = {f"segments of {n}": [segment_mapping(names, t, n), segment_mapping(names, t, n, shift=1)]
                   for n in lengths}
        configs["random per-token mix"] = [random_mapping(names, t, 1), random_mapping(names, t, 2)]

        def static(fn):  # torch_xla's own setting for plain openxla: automatic dynamic shapes off
            def call():
                with torch._dynamo.config.patch(automatic_dynamic_shapes=False):
                    fn()
            return call

        @torch.no_grad()
        def step_base():
            c_base(input_ids=ids_dev).logits.cpu()

        def step(mappings, model=ours, meta=meta):
            turn = [0]

            @torch.no_grad()
            def call(mapping=None):
                turn[0] += 1
                meta.set_token_adapters(mapping if mapping is not None else mappings[turn[0] % 2])
                return model(input_ids=ids_dev).logits.cpu()
            return call

        fns = {"base": static(step_base)}
        fns.update({name: step(maps) for name, maps in configs.items()})
        if not args.no_masked:
            configs[MASKED_MIX] = configs["random per-token mix"]
            fns[MASKED_MIX] = step(configs[MASKED_MIX], masked, masked_meta)
        kernels, errors = {}, {}
        for name, fn in fns.items():
            for _ in range(3):
                fn()
            if name == MASKED_MIX:
                kernels[name] = "masked"
            elif name in configs:
                graph = next(g for g in reversed(backend.graphs) if g.source is not None)
                meta.set_token_adapters(configs[name][0])
                kernels[name] = _kernel_name(backend, graph, t)
            if name in configs:
                if not args.no_check:
                    got = fn(configs[name][0])
                    want = per_token_reference(peft_cpu, ids, configs[name][0])
                    errors[name] = float((got - want).abs().max())
        times = time_interleaved(fns, args.reps, args.steps)
        rat = ratios(times, "base")
        rows = [[name, kernels.get(name, "-"), f"{sorted(ts)[len(ts) // 2] * 1e3:.1f}", summary(rat[name]),
                 f"{errors[name]:.1e}" if name in errors else "-"] for name, ts in times.items()]
        table = (f"**{args.adapters} adapters, {t} tokens in one row** ({args.layers} layers; "
                 f"{args.reps} repetitions x {args.steps} steps; load {os.getloadavg()[0]:.1f}):\n\n"
                 + markdown_table(["configuration", "kernel", "ms / step (median)", "time / base, median [min-max]",
                                   "max abs diff vs per-token eager"], rows))
        print(table + "\n", flush=True)
    return 0


def _kernel_name(backend, graph, tokens: int) -> str:
    """The kernel ``backend`` picks for the current mapping of a [1, tokens] call of ``graph``."""
    padded = (1, backend.buckets.pad(tokens))
    from xla_lora_pass.kernels.table import FALLBACK

    return next(iter(graph.graph_for_call((1, tokens), padded).kernels), FALLBACK)


if __name__ == "__main__":
    raise SystemExit(main())
