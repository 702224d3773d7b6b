"""Compiles and wall time for one stream of token counts, side by side in one run.

    python bench/recompiles.py [--max-tokens 512] [--layers 1]

The stream is every token count from 1 to --max-tokens in one random order,
run on a tiny PEFT Llama with 3 adapters (B = 1, so the sequence is the token
dim), by: plain ``openxla`` (torch_xla's default: Dynamo's automatic dynamic
shapes off), ``openxla`` with ``dynamic=True``, and this backend under each
bucket policy.  XLA compile counts and compile seconds come from torch_xla's
metrics; ratios are against plain openxla in the same run.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time

import _common  # noqa: F401  (sets PJRT_DEVICE before torch_xla loads)
import torch
from _common import markdown_table, xla_compile_stats


def run_stream(name, make_compiled, lengths, ids, device, meta=None, adapters=None):
    torch._dynamo.reset()
    compiled, model = make_compiled()
    c0, s0 = xla_compile_stats()
    start = time.perf_counter()
    for step, n in enumerate(lengths):
        if meta is not None:
            meta.set_token_adapters([adapters[step % len(adapters)]] * n)
        with torch.no_grad():
            compiled(input_ids=ids[:, :n].to(device)).logits.cpu()
    wall = time.perf_counter() - start
    c1, s1 = xla_compile_stats()
    programs = meta.stats["compiles"] if meta is not None else "-"
    model.cpu()
    return dict(name=name, xla_compiles=c1 - c0, compile_s=s1 - s0, wall_s=wall, programs=programs)


CONFIGS = ["openxla", "openxla dynamic=True", "xla_lora pow2", "xla_lora pow2_then_gap"]


def run_one(config: str, args) -> dict:
    """One row, in this process (the caller gives each row a fresh process: XLA caches programs)."""
    import torch_xla

    import xla_lora_pass as xlp
    from xla_lora_pass.demo_models import tiny_peft_llama

    device = torch_xla.device()
    lengths = list(range(1, args.max_tokens + 1))
    random.Random(args.seed).shuffle(lengths)
    ids = torch.randint(0, 128, (1, args.max_tokens), generator=torch.Generator().manual_seed(args.seed))
    model, names = tiny_peft_llama(num_hidden_layers=args.layers)
    model.to(device)

    if config.startswith("openxla"):
        dynamic = True if "dynamic" in config else None

        def make():
            return torch.compile(model, backend="openxla", dynamic=dynamic), model

        # torch_xla's own setting for plain openxla: automatic dynamic shapes off.
        with torch._dynamo.config.patch(automatic_dynamic_shapes=False):
            row = run_stream(config, make, lengths, ids, device)
    else:
        buckets = (xlp.Buckets.pow2(8, args.max_tokens) if config.endswith("pow2")
                   else xlp.Buckets.pow2_then_gap(8, args.gap, args.max_tokens))
        meta = xlp.LoRAMetadata(max_num_tokens=args.max_tokens)
        meta.register_adapters(model)

        def make():
            return torch.compile(model, backend=xlp.make_backend(meta, buckets=buckets)), model

        row = run_stream(f"{config} {list(buckets)}", make, lengths, ids, device, meta=meta,
                         adapters=names + [None])
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--gap", type=int, default=128, help="pow2_then_gap's gap")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", choices=CONFIGS, help=argparse.SUPPRESS)  # one row, printed as JSON
    args = parser.parse_args(argv)

    if args.only:
        print("ROW " + json.dumps(run_one(args.only, args)))
        return 0

    rows = []
    for config in CONFIGS:
        cmd = [sys.executable, os.path.abspath(__file__), "--only", config, "--max-tokens", str(args.max_tokens),
               "--layers", str(args.layers), "--gap", str(args.gap), "--seed", str(args.seed)]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True)
        rows.append(json.loads(next(line for line in out.stdout.splitlines() if line.startswith("ROW "))[4:]))
        print(f"done: {config}", file=sys.stderr)

    base = rows[0]
    table = [[r["name"], r["programs"], r["xla_compiles"], r["compile_s"], r["compile_s"] / base["compile_s"],
              r["wall_s"], r["wall_s"] / base["wall_s"]] for r in rows]
    print(f"Stream: every token count 1..{args.max_tokens} once, random order (seed {args.seed}); tiny PEFT "
          f"Llama, {args.layers} layer(s), 3 adapters; XLA on the CPU; each row in a fresh process.\n")
    print(markdown_table(["backend", "backend programs", "XLA compiles", "XLA compile s",
                          "compile s / openxla", "wall s", "wall / openxla"], table))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
