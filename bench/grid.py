"""A shape grid: prefill rows, packed segments, a per-token mix and decode, each beside its floor.

    python bench/grid.py --quick    # hidden 512 / vocab 512 (2 layers) and hidden 2048 / vocab 32000 (1 layer),
                                    # 16 adapters, 7 reps: a few minutes on 2 cores
    python bench/grid.py            # hidden 512, 2048 x vocab 512, 32000 x adapters 1, 4, 16 x tokens 64..2048
    python bench/grid.py --hidden 4096 --layers 1 --vocab 32000 --adapters 16 --tokens 256

One fresh process per (hidden, vocab, layers, adapters) point (bench/_timing.run_child), each
timing every token count of the point.  The model is step_time.build_models at the point's
shape (hidden 512: intermediate 1024, 8 heads, the toy shape; 2048: TinyLlama-1.1B's layer,
intermediate 5632, 32 heads, 4 KV heads; 4096: intermediate 11008, 32 heads), PEFT LoRA r=16 on
every linear of the decoder layers, N adapters.  For T tokens, side by side in one process
(each repetition runs every configuration once, in rotating order; ratios within a repetition):

* ``prefill rows``: ``[16, T/16]`` into a static cache (bench/_decode_stream.Stream), row i on adapter
  i mod N (``set_request_adapters``, the row kernel), over the base model's same prefill;
* ``per-token mix``: the same ``[16, T/16]`` prefill, every token on a random adapter of N, alternating two
  such mappings (``set_token_adapters`` every step: the sorted kernel, where it fits), over the same base;
* ``packed``: ``[1, T]`` holding T/32 requests of 32 tokens, request j on adapter j mod N, alternating two
  such mappings (the segment kernel), over the base model's ``[1, T]`` forward;
* ``decode``: one ``[16, 1]`` step at the next static-cache position, rows as in prefill, over the base
  model's decode step (4 steps per timed call).

Every ratio is printed beside its FLOP floor ``1 + LoRA FLOPs / base FLOPs`` (bench/_flops.py: the
linears, ``lm_head`` over every position, attention over the positions computed), and decode beside its
byte floor too (``decode_byte_floor``: the weights, ``lm_head`` and the KV cache read once, plus the A and
B of the batch's min(16, N) adapters).  Every step ends with ``logits.cpu()``.
"""
from __future__ import annotations

import argparse
import copy
import itertools
import os
import statistics
import sys
import time

import _common  # noqa: F401  (sets PJRT_DEVICE before torch_xla loads)
from _common import markdown_table
from _flops import decode_byte_floor, flop_floor
from _timing import emit, run_child, summary, time_interleaved

RANK, ROWS, SEGMENT, DECODE_STEPS, DECODE_ROOM = 16, 16, 32, 4, 64
# hidden -> (intermediate, heads, kv heads)
SHAPES = {512: (1024, 8, 8), 2048: (5632, 32, 4), 4096: (11008, 32, 32)}
QUICK = [dict(hidden=512, vocab=512, layers=2, adapters=16, tokens="128,512"),
         dict(hidden=2048, vocab=32000, layers=1, adapters=16, tokens="128")]
CASES = ("prefill rows", "per-token mix", "packed", "decode")
BASE_OF = {"prefill rows": "base prefill", "per-token mix": "base prefill", "packed": "base packed",
           "decode": "base decode"}


def floors(hidden, vocab, layers, adapters, tokens, cache_len):
    """Each case's FLOP floor, and decode's byte floor."""
    inter, heads, kv_heads = SHAPES[hidden]
    kv = hidden * kv_heads // heads
    out = {case: flop_floor(hidden, inter, layers, vocab, RANK, context, kv)
           for case, context in (("prefill rows", cache_len), ("per-token mix", cache_len), ("packed", tokens),
                                 ("decode", cache_len))}
    out["decode bytes"] = decode_byte_floor(hidden, inter, layers, vocab, RANK, min(ROWS, adapters), ROWS,
                                            cache_len, kv)
    return out


def child(args) -> int:
    import torch
    import torch_xla

    import xla_lora_pass as xlp
    from _decode_stream import Stream
    from packed import random_mapping, segment_mapping
    from step_time import build_models

    # Dynamo guards on each static cache's identity: one graph per stream and token count (as decode_step.py).
    torch._dynamo.config.recompile_limit = 1024
    torch._dynamo.config.accumulated_recompile_limit = 4096
    dev = torch_xla.device()
    inter, heads, kv_heads = SHAPES[args.hidden]
    tokens = [int(t) for t in args.tokens.split(",")]
    n = args.adapters
    base_cpu, peft_cpu, names = build_models(n, layers=args.layers, hidden=args.hidden, intermediate=inter,
                                             vocab=args.vocab, heads=heads, kv_heads=kv_heads)
    base = torch.compile(copy.deepcopy(base_cpu).to(dev), backend="openxla")

    def lora():
        model = copy.deepcopy(peft_cpu).to(dev)
        meta = xlp.LoRAMetadata(max_num_tokens=max(tokens))
        meta.register_adapters(model)
        return torch.compile(model, backend=xlp.make_backend(meta)), meta

    rows_model, rows_meta = lora()  # request mapping: prefill rows and decode
    mix_model, mix_meta = lora()  # token mappings, set every step: the per-token mix and packed
    del peft_cpu, base_cpu
    row_adapters = [names[i % n] for i in range(ROWS)]
    rows_meta.set_request_adapters(row_adapters)

    def static(fn):  # torch_xla's own setting for plain openxla: automatic dynamic shapes off
        def call():
            with torch._dynamo.config.patch(automatic_dynamic_shapes=False):
                fn()
        return call

    def alternating(meta, mappings, fn):
        turn = [0]

        def call():
            turn[0] += 1
            meta.set_token_adapters(mappings[turn[0] % 2])
            fn()
        return call

    def decoding(stream):
        def call():
            for _ in range(DECODE_STEPS):
                stream.decode()
        return call

    results = []
    for t in tokens:
        gen = torch.Generator().manual_seed(t)
        prompt = torch.randint(0, args.vocab, (ROWS, t // ROWS), generator=gen).to(dev)
        step_ids = torch.randint(0, args.vocab, (ROWS, 1), generator=gen).to(dev)
        packed_ids = torch.randint(0, args.vocab, (1, t), generator=gen).to(dev)
        max_len = t // ROWS + DECODE_ROOM
        streams = {name: Stream(model, prompt, step_ids, max_len)
                   for name, model in (("base", base), ("rows", rows_model), ("mix", mix_model))}
        mixes = [random_mapping(names, t, 1), random_mapping(names, t, 2)]
        packs = [segment_mapping(names, t, SEGMENT), segment_mapping(names, t, SEGMENT, shift=1)]

        @torch.no_grad()
        def packed_step(model):
            model(input_ids=packed_ids).logits.cpu()

        fns = {
            "base prefill": static(streams["base"].prefill),
            "prefill rows": streams["rows"].prefill,
            "per-token mix": alternating(mix_meta, mixes, streams["mix"].prefill),
            "base packed": static(lambda: packed_step(base)),
            "packed": alternating(mix_meta, packs, lambda: packed_step(mix_model)),
            "base decode": static(decoding(streams["base"])),
            "decode": decoding(streams["rows"]),
        }
        warm = {}
        for name, fn in fns.items():  # compile and warm up
            start = time.perf_counter()
            for _ in range(3):
                fn()
            warm[name] = time.perf_counter() - start
        load = os.getloadavg()
        times = time_interleaved(fns, args.reps, 1)
        rat = {case: [c / b for c, b in zip(times[case], times[BASE_OF[case]])] for case in CASES}
        row = dict(hidden=args.hidden, vocab=args.vocab, layers=args.layers, adapters=n, tokens=t, times=times,
                   ratios=rat, floors=floors(args.hidden, args.vocab, args.layers, n, t, max_len), warm_s=warm,
                   load_before=load, load_after=os.getloadavg())
        results.append(row)
        print(f"hidden={args.hidden} vocab={args.vocab} adapters={n} tokens={t}: " + ", ".join(
            f"{k}={statistics.median(v):.3f}" for k, v in rat.items()), file=sys.stderr, flush=True)
    emit(dict(results=results))
    return 0


def table(rows) -> str:
    body = []
    for r in rows:
        f = r["floors"]
        base_ms = {k: statistics.median(r["times"][k]) * 1e3 for k in ("base prefill", "base packed", "base decode")}
        body.append([r["hidden"], r["vocab"], r["layers"], r["adapters"], r["tokens"],
                     f"{base_ms['base prefill']:.1f}", summary(r["ratios"]["prefill rows"]),
                     summary(r["ratios"]["per-token mix"]), f"{f['prefill rows']:.3f}",
                     f"{base_ms['base packed']:.1f}", summary(r["ratios"]["packed"]), f"{f['packed']:.3f}",
                     f"{base_ms['base decode'] / DECODE_STEPS:.1f}", summary(r["ratios"]["decode"]),
                     f"{f['decode']:.3f}", f"{f['decode bytes']:.3f}",
                     f"{r['load_before'][0]:.1f} / {r['load_after'][0]:.1f}"])
    return markdown_table(["hidden", "vocab", "layers", "adapters", "tokens", "base prefill ms",
                           "**prefill rows**", "**per-token mix**", "FLOP floor", "base packed ms", "**packed**",
                           "FLOP floor", "base decode ms", "**decode, batch 16**", "FLOP floor", "byte floor",
                           "load (1 min) before / after"], body)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the points of QUICK only")
    parser.add_argument("--hidden", default="512,2048", help=f"comma list, of {sorted(SHAPES)}")
    parser.add_argument("--vocab", default="512,32000")
    parser.add_argument("--layers", type=int, help="decoder layers (default: 2 at hidden 512, 1 above)")
    parser.add_argument("--adapters", default="1,4,16")
    parser.add_argument("--tokens", default="64,256,2048", help="comma list, multiples of 32")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        args.hidden, args.vocab, args.adapters = int(args.hidden), int(args.vocab), int(args.adapters)
        return child(args)
    if args.quick:
        points = QUICK
    else:
        points = [dict(hidden=h, vocab=v, layers=args.layers or (2 if h <= 512 else 1), adapters=n, tokens=args.tokens)
                  for h, v, n in itertools.product([int(h) for h in args.hidden.split(",")],
                                                    [int(v) for v in args.vocab.split(",")],
                                                    [int(n) for n in args.adapters.split(",")])]
    start = time.perf_counter()
    rows = []
    for p in points:
        flags = ["--child", "--reps", str(args.reps)] + [a for k, v in p.items() for a in (f"--{k}", str(v))]
        rows += run_child("grid.py", flags, f"hidden {p['hidden']}, vocab {p['vocab']}, {p['adapters']} adapters")[
            "results"]
    cmd = "python bench/grid.py " + " ".join(argv if argv is not None else sys.argv[1:])
    total = time.perf_counter() - start
    print(f"# `{cmd.strip()}`\n\n{os.cpu_count()}-core CPU, XLA on the CPU, fp32, r={RANK}; {args.reps} repetitions, "
          f"ratios to the base model within each, median [min-max]; total {total:.0f} s.\n\n" + table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
