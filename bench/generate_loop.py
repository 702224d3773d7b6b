"""The generate loop against the base model's: a batch-1 decode step, full ``generate`` calls, and the programs a
warmed generate compiles.

    python bench/generate_loop.py [--adapters 16] [--batch 1,8,16] [--new 16] [--prompt 128] [--reps 7]
        [--hidden 512|2048|4096] [--layers 4] [--vocab 4096]

The model of ``bench/step_time.py`` (hidden 512, 4 layers, vocab 4096, random
weights, fp32; another ``--hidden`` takes bench/grid.py's layer shape of that width,
2048: TinyLlama-1.1B's) with N PEFT adapters (r=16) on every linear; row i of a batch on
adapter i mod N.  Side by side, interleaved (each ratio within one repetition):

* ``decode step, batch 1``: one ``[1, 1]`` forward on a static cache (bench/_decode_stream.py), this backend
  against the base model compiled with openxla; each step's time split into XLA executing its program
  (torch_xla's ``ExecuteTime`` metric) and the rest, the host's part (Dynamo's guards, the backend's call,
  the transfers).
* ``generate``: a greedy ``generate`` of ``--new`` tokens per batch size, every configuration on a static cache of
  the same bucketed length:

  - ``base, openxla``: HF's ``generate`` on the base model, its forward compiled with openxla: HF builds each
    step's 4-d mask eagerly (every ratio's denominator);
  - ``base, openxla, mask in program``: the same with this package's generate mask (serving/generate_mask.py):
    each step's mask made inside the compiled forward, as this backend's generate does;
  - ``xla_lora``: PEFT's ``generate(adapter_names=...)`` served by this backend, warmed by
    ``precompile_generate``;
  - ``xla_lora, HF's host mask``: the same with the generate mask turned off for the call (HF builds each
    step's mask on the host, as for a model it does not apply to); its tokens are checked equal to ``xla_lora``'s.

``compiles on the first generate after precompile_generate``: XLA programs compiled by this backend's first
real ``generate`` of each batch (0 when precompile_generate warmed everything it runs).  Tokens of the two
base configurations are checked equal, and this backend's against eager PEFT's for batch 1.
"""
from __future__ import annotations

import argparse
import copy
import time
from unittest import mock

import _common  # noqa: F401  (sets PJRT_DEVICE before torch_xla loads)
import torch
from _common import xla_compile_stats, xla_execute_seconds
from _decode_stream import Stream, static_cache
from _timing import emit, median, ratios, summary, time_interleaved
from grid import SHAPES
from step_time import HIDDEN, LAYERS, VOCAB, build_models

BASE = "base, openxla"
BASE_MASK = "base, openxla, mask in program"
OURS = "xla_lora"
OURS_HOST_MASK = "xla_lora, HF's host mask"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--adapters", type=int, default=16)
    parser.add_argument("--batch", default="1,8,16")
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new", type=int, default=16)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--steps", type=int, default=8, help="decode steps per configuration per repetition")
    parser.add_argument("--hidden", type=int, default=HIDDEN, choices=sorted({HIDDEN, *SHAPES}))
    parser.add_argument("--layers", type=int, default=LAYERS)
    parser.add_argument("--vocab", type=int, default=VOCAB)
    args = parser.parse_args(argv)

    import torch_xla

    import xla_lora_pass as xlp
    from xla_lora_pass.serving import generate_mask

    # Three batch sizes, prompt and decode graphs, two compiled forwards of the base model: past Dynamo's
    # default limit of 8 per code object, a forward would fall back to eager.
    torch._dynamo.config.recompile_limit = 1024
    torch._dynamo.config.accumulated_recompile_limit = 4096
    dev = torch_xla.device()
    batches = [int(b) for b in args.batch.split(",")]
    # The default width is step_time.py's own model; another width is bench/grid.py's shape of it.
    shape = {} if args.hidden == HIDDEN else dict(zip(("intermediate", "heads", "kv_heads"), SHAPES[args.hidden]))
    base_cpu, peft_cpu, names = build_models(args.adapters, layers=args.layers, hidden=args.hidden,
                                             vocab=args.vocab, **shape)
    served = copy.deepcopy(peft_cpu).to(dev)
    meta = xlp.LoRAMetadata(max_num_tokens=max(batches) * args.prompt)
    meta.register_adapters(served)
    backend = xlp.make_backend(meta)
    base = copy.deepcopy(base_cpu).to(dev)
    base_forward = torch.compile(base.forward, backend="openxla")
    base_mask_forward = torch.compile(generate_mask.forward_setting_step_mask(base.forward), backend="openxla")
    for model in (base, served):
        model.generation_config.eos_token_id = None  # random weights: every row makes `new` tokens
        model.generation_config.pad_token_id = 0
    cache_len = backend.buckets.pad_length(args.prompt + args.new)
    result = dict(adapters=args.adapters, prompt=args.prompt, new_tokens=args.new, cache_len=cache_len,
                  hidden=args.hidden, layers=args.layers, vocab=args.vocab)

    # The batch-1 decode step.
    gen = torch.Generator().manual_seed(0)
    prompt1, step1 = torch.randint(0, args.vocab, (1, args.prompt), generator=gen), torch.randint(0, args.vocab, (1, 1), generator=gen)
    meta.set_request_adapters([names[0]])
    max_len = args.prompt + 4 + args.reps * args.steps
    streams = {BASE: Stream(torch.compile(copy.deepcopy(base_cpu).to(dev), backend="openxla"), prompt1.to(dev),
                            step1.to(dev), max_len),
               OURS: Stream(torch.compile(served, backend=backend), prompt1.to(dev), step1.to(dev), max_len)}

    def decode(name):
        if name == BASE:  # torch_xla's own setting for plain openxla
            with torch._dynamo.config.patch(automatic_dynamic_shapes=False):
                return streams[name].decode()
        return streams[name].decode()

    executing = {name: [] for name in streams}  # XLA's execute time of each timed step: the device's part

    def timed_decode(name):
        start = xla_execute_seconds()
        decode(name)
        executing[name].append(xla_execute_seconds() - start)

    for name in streams:
        for _ in range(3):
            decode(name)
    step_times = time_interleaved({name: (lambda name=name: timed_decode(name)) for name in streams}, args.reps,
                                  args.steps)
    result["decode_step_batch1"] = dict(times=step_times, ratio=ratios(step_times, BASE),
                                        execute_s={name: median(v) for name, v in executing.items()})

    rows_out = []
    for batch in batches:
        gen = torch.Generator().manual_seed(batch)
        prompt = torch.randint(0, args.vocab, (batch, args.prompt), generator=gen).to(dev)
        mask = torch.ones_like(prompt)
        adapter_names = [names[i % len(names)] for i in range(batch)]
        base_cache = static_cache(base, cache_len, batch)

        def run_base(forward, in_program):
            def fn():
                base_cache.reset()  # transformers 5's StaticLayer writes at its own count: reset before reuse
                with contextlib_for(base, forward, in_program), torch.no_grad(), \
                        torch._dynamo.config.patch(automatic_dynamic_shapes=False):
                    return base.generate(input_ids=prompt, attention_mask=mask, max_new_tokens=args.new,
                                         do_sample=False, past_key_values=base_cache).cpu()
            return fn

        def ours():
            with torch.no_grad():
                return served.generate(input_ids=prompt, attention_mask=mask, adapter_names=adapter_names,
                                       max_new_tokens=args.new, do_sample=False).cpu()

        def ours_host_mask():
            with mock.patch.object(generate_mask, "applies_to", lambda module: False):
                return ours()

        fns = {BASE: run_base(base_forward, False), BASE_MASK: run_base(base_mask_forward, True), OURS: ours,
               OURS_HOST_MASK: ours_host_mask}
        start = time.perf_counter()
        backend.precompile_generate(served, [batch], [args.prompt], args.new, progress=False)
        warm_s = time.perf_counter() - start
        c0 = xla_compile_stats()[0]
        first = ours()
        first_compiles = xla_compile_stats()[0] - c0
        tokens = {}
        for name in (BASE, BASE_MASK, OURS_HOST_MASK):  # compile and warm up (twice: the first generate's differ)
            fns[name]()
            tokens[name] = fns[name]()
        if not torch.equal(tokens[BASE], tokens[BASE_MASK]):
            raise AssertionError(f"batch {batch}: the mask in the program changed the base model's tokens")
        if not torch.equal(tokens[OURS_HOST_MASK], first):
            raise AssertionError(f"batch {batch}: HF's host mask changed this backend's tokens")
        if batch == 1:
            names_row = ["__base__" if a is None else a for a in adapter_names]
            with torch.no_grad():
                want = peft_cpu.generate(input_ids=prompt.cpu(), attention_mask=mask.cpu(), adapter_names=names_row,
                                         max_new_tokens=args.new, do_sample=False, eos_token_id=None,
                                         pad_token_id=0)
            if not torch.equal(first, want):
                raise AssertionError(f"batch 1: tokens differ from eager PEFT's\n{first}\n{want}")
        c1 = xla_compile_stats()[0]
        times = time_interleaved(fns, args.reps, 1)
        rows_out.append(dict(batch=batch, times=times, ratio=ratios(times, BASE), precompile_s=warm_s,
                             compiles_first_generate_after_precompile=first_compiles,
                             xla_compiles_while_timed=xla_compile_stats()[0] - c1))
    result["generate"] = rows_out
    emit(result)

    d = result["decode_step_batch1"]
    step_ms = {name: median(t) * 1e3 for name, t in d["times"].items()}
    print(f"Llama hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}; {args.adapters} adapters r=16 on "
          "every linear")
    print(f"decode step, batch 1: base {step_ms[BASE]:.2f} ms, {OURS} / base {summary(d['ratio'][OURS])}; "
          "median ms per step, XLA executing / the rest (the host): " + ", ".join(
              f"{name} {d['execute_s'][name] * 1e3:.2f} / {step_ms[name] - d['execute_s'][name] * 1e3:.2f}"
              for name in step_ms))
    print(f"generate, {args.new} new tokens, prompt {args.prompt}, {args.reps} repetitions (median [min-max] ratio "
          f"to {BASE!r} within a repetition)")
    print(f"| batch | {BASE} ms | {BASE_MASK} | {OURS} | {OURS} / {BASE_MASK} | {OURS} / {OURS_HOST_MASK} | "
          "compiles: first generate after precompile_generate / while timed |")
    print("|---|---|---|---|---|---|---|")
    for row in rows_out:
        r, t = row["ratio"], row["times"]
        vs_mask = [a / b for a, b in zip(t[OURS], t[BASE_MASK])]
        vs_host = [a / b for a, b in zip(t[OURS], t[OURS_HOST_MASK])]
        print(f"| {row['batch']} | {sorted(t[BASE])[args.reps // 2] * 1e3:.1f} | {summary(r[BASE_MASK])} | "
              f"{summary(r[OURS])} | {summary(vs_mask)} | {summary(vs_host)} | "
              f"{row['compiles_first_generate_after_precompile']} / {row['xla_compiles_while_timed']} |")
    return 0


def contextlib_for(model, compiled, in_program: bool):
    """The base model's forward is ``compiled`` for the block; with ``in_program``, through the generate mask."""
    import contextlib

    from xla_lora_pass.serving import generate_mask

    if in_program:
        return generate_mask.masks_in_program(model, compiled)

    @contextlib.contextmanager
    def plain():
        model.forward = compiled
        try:
            yield
        finally:
            del model.forward

    return plain()


if __name__ == "__main__":
    raise SystemExit(main())
