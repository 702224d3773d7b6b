"""Decode and prefill steps with a static KV cache, this backend against the base model, side by side.

    python bench/decode_step.py --adapters 16 --batch 1,8,32 [--reps 5] [--steps 4] [--prompt 128]

One process per adapter count (``bench/run.py`` starts them): the
model of ``bench/step_time.py`` (hidden 512, intermediate 1408, 4 layers,
8 heads, vocab 4096, random weights, fp32) with N PEFT adapters on every
linear of the decoder layers (r=16).  B sequences, sequence i on adapter
i mod N, each with an HF ``StaticCache`` of ``prompt + decode calls`` positions.

* ``prefill``: one ``[B, prompt]`` forward that fills the cache (cache_position 0..prompt-1).
* ``prompt``: the same forward as ``generate``'s prompt step computes it, ``logits_to_keep=1``: the
  logits of each row's last position only (``lm_head(hidden[:, -1:, :])``).
* ``decode``: one ``[B, 1]`` forward at the next cache position, every step one position
  further (the cache is reset and refilled, untimed, before it would run out).

Configurations, each with its own model copy and cache:

* ``base, openxla``: the model with no LoRA, ``torch.compile(backend="openxla")``: every ratio's denominator.
* ``xla_lora``: this backend, default kernel, the mapping set per call (one adapter per row).
* ``xla_lora, masked kernel`` (``--masked``, decode only): the same, its backend made with
  ``config.snapshot(kernel="masked")``.
* ``xla_lora, row kernel from 1 token`` (``--rows``): ``row_kernel_min_tokens=1`` (the default now; the
  setting that compared the two kernels at decode when the default was 2).
* ``PEFT openxla, one adapter`` (``--peft``): the PEFT model compiled with plain ``openxla``, every row on
  adapter 0 (``set_adapter``): what compiling PEFT costs without this backend, for one adapter only.
* ``xla_lora, tensor guards only`` (``--guards``): a diagnostic, not a way to serve: this backend with
  ``torch.compile(options={"guard_filter_fn": ...})`` keeping only Dynamo's tensor guards, which drops
  the guards Dynamo installs on PEFT's module tree (each LoRA layer's per-adapter dicts, once per adapter).
  The difference to ``xla_lora`` is the host time those guards cost per call.  Decode steps only: unsafe
  in general, and shown to be here (without its guard on ``logits_to_keep`` the prompt step reuses the
  prefill's program and returns every position's logits).
* ``xla_lora, no fold_linear_inputs`` (``--no-fold``): the pass that gives a linear whose input
  ``matmul`` cannot fold (the prompt step's last-position ``lm_head``; ``o_proj`` on decode's ``[B, 1, H]``
  attention output) a contiguous input switched off (the backend's ``passes``), as before it existed.

A full greedy ``generate`` of ``--generate`` new tokens (default 32) is timed too, base against
xla_lora (PEFT's ``generate(adapter_names=...)`` on the registered model), as tokens per second.

Each repetition runs every configuration once (rotating order); ratios are
taken within a repetition.  Every step ends with ``logits.cpu()``.  Before
timing, each configuration's decode logits are checked against eager PEFT's
mixed batch (``adapter_names=``) on the same cache contents.
"""
from __future__ import annotations

import argparse
import copy
import os
import time

import _common  # noqa: F401  (sets PJRT_DEVICE before torch_xla loads)
import torch
from _common import xla_compile_stats
from _decode_stream import Stream, eager_decode_reference, static_cache
from _timing import emit, ratios, time_interleaved
from step_time import VOCAB, build_models


PEFT_ONE = "PEFT openxla, one adapter"
PLAIN_OPENXLA = ("base, openxla", PEFT_ONE)
GUARDS = "xla_lora, tensor guards only"


def _time_generate(args, configs, base_cpu, prompt, rows, dev):
    """Tokens per second of a full greedy ``generate`` of ``args.generate`` tokens, base against xla_lora.

    xla_lora: PEFT's ``generate(adapter_names=...)`` on the registered model, which the backend serves
    (a static cache of the bucketed length).  Base: HF's ``generate`` with the model's forward compiled
    with openxla and a static cache of that same length, so both attend over the same cache.
    """
    cfg = configs["xla_lora"]
    batch, new = prompt.shape[0], args.generate
    cache_len = cfg["backend"].buckets.pad_length(prompt.shape[1] + new)
    base = copy.deepcopy(base_cpu).to(dev)
    base.forward = torch.compile(base.forward, backend="openxla")
    for model in (base, cfg["raw"]):
        model.generation_config.eos_token_id = None  # random weights: never stop early, every row makes `new`
        model.generation_config.pad_token_id = 0
    mask = torch.ones_like(prompt)
    names = ["__base__" if a is None else a for a in rows]
    # One cache, reset before each generate, as serving reuses one: Dynamo guards the identity of the cache's
    # tensors, so a new cache per generate traced the base forward twice per generate (and, past Dynamo's
    # recompile limit, ran it eagerly): 3.7 base tokens/s at batch 1 against xla_lora's 92.
    base_cache = static_cache(base, cache_len, batch)

    @torch.no_grad()
    def gen_base():
        base_cache.reset()
        with torch._dynamo.config.patch(automatic_dynamic_shapes=False):
            out = base.generate(input_ids=prompt, attention_mask=mask, max_new_tokens=new, do_sample=False,
                                past_key_values=base_cache)
        assert out.shape[1] == prompt.shape[1] + new
        return out.cpu()

    @torch.no_grad()
    def gen_ours():
        out = cfg["raw"].generate(input_ids=prompt, attention_mask=mask, adapter_names=names, max_new_tokens=new,
                                  do_sample=False)
        assert out.shape[1] == prompt.shape[1] + new
        return out.cpu()

    fns = {"base, openxla": gen_base, "xla_lora": gen_ours}
    for fn in fns.values():  # compile and warm up
        fn()
        fn()
    c0 = xla_compile_stats()[0]
    times = time_interleaved(fns, args.generate_reps, 1)
    return dict(new_tokens=new, cache_len=cache_len, times=times, ratio=ratios(times, "base, openxla"),
                tokens_per_s={k: batch * new / sorted(v)[len(v) // 2] for k, v in times.items()},
                xla_compiles_while_timed=xla_compile_stats()[0] - c0)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--adapters", type=int, default=16)
    parser.add_argument("--batch", default="1,8,32")
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--steps", type=int, default=4, help="decode steps per configuration per repetition")
    parser.add_argument("--prefill-steps", type=int, default=1, help="prefills per configuration per repetition")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--no-prefill", action="store_true", help="time decode steps only")
    parser.add_argument("--masked", action="store_true", help="also time the masked kernel")
    parser.add_argument("--rows", action="store_true", help="also time the row kernel on rows of one token")
    parser.add_argument("--peft", action="store_true", help="also time PEFT compiled with openxla, one adapter")
    parser.add_argument("--guards", action="store_true",
                        help="also time this backend with Dynamo's tensor guards only (a diagnostic)")
    parser.add_argument("--no-fold", action="store_true",
                        help="also time every step with the fold_linear_inputs pass off")
    parser.add_argument("--generate", type=int, default=32, help="new tokens of the timed generate (0: none)")
    parser.add_argument("--generate-reps", type=int, default=3)
    args = parser.parse_args(argv)

    import torch_xla

    import xla_lora_pass as xlp

    torch._dynamo.config.recompile_limit = 1024
    torch._dynamo.config.accumulated_recompile_limit = 4096
    dev = torch_xla.device()
    batches = [int(b) for b in args.batch.split(",")]
    n = args.adapters
    base_cpu, peft_cpu, names = build_models(n)
    decode_calls = args.warmup + 2 + args.reps * args.steps
    max_len = args.prompt + decode_calls

    def lora_config(compile_options=None, **settings):
        model = copy.deepcopy(peft_cpu).to(dev)
        meta = xlp.LoRAMetadata(max_num_tokens=max(batches) * args.prompt)
        meta.register_adapters(model)
        backend = xlp.make_backend(meta, settings=xlp.config.snapshot(**settings))  # this backend's own
        return dict(model=torch.compile(model, backend=backend, options=compile_options), meta=meta,
                    raw=model, backend=backend)

    configs = {"base, openxla": dict(model=torch.compile(copy.deepcopy(base_cpu).to(dev), backend="openxla"))}
    configs["xla_lora"] = lora_config()
    if args.peft:
        peft_one = copy.deepcopy(peft_cpu).to(dev)
        peft_one.set_adapter(names[0])
        configs[PEFT_ONE] = dict(model=torch.compile(peft_one, backend="openxla"))
    if args.guards:
        configs[GUARDS] = lora_config(
            compile_options={"guard_filter_fn": lambda entries: [e.guard_type == "TENSOR_MATCH" for e in entries]})
    if args.masked:
        configs["xla_lora, masked kernel"] = lora_config(kernel="masked")
    if args.rows:
        configs["xla_lora, row kernel from 1 token"] = lora_config(row_kernel_min_tokens=1)
    no_fold = "xla_lora, no fold_linear_inputs"
    if args.no_fold:
        configs[no_fold] = lora_config(passes={**xlp.config.passes, "fold_linear_inputs": False})

    results = []
    for batch in batches:
        gen = torch.Generator().manual_seed(batch)
        prompt = torch.randint(0, VOCAB, (batch, args.prompt), generator=gen)
        step_ids = torch.randint(0, VOCAB, (batch, 1), generator=gen)
        rows = [names[i % n] for i in range(batch)]
        streams = {}
        for name, cfg in configs.items():
            if "meta" in cfg:
                cfg["meta"].set_request_adapters(rows)  # one adapter per row, for prefill and every decode step
            streams[name] = Stream(cfg["model"], prompt.to(dev), step_ids.to(dev), max_len)

        def run(name, phase):
            if name in PLAIN_OPENXLA:  # torch_xla's own setting for plain openxla
                with torch._dynamo.config.patch(automatic_dynamic_shapes=False):
                    return getattr(streams[name], phase)()
            return getattr(streams[name], phase)()

        warm, errors = {}, {}
        want = eager_decode_reference(peft_cpu, prompt, step_ids, rows, max_len)
        want_one = (eager_decode_reference(peft_cpu, prompt, step_ids, [names[0]] * batch, max_len)
                    if args.peft else None)
        for name in configs:
            c0, s0 = xla_compile_stats()
            start = time.perf_counter()
            # Twice: the first call finds the cache not yet allocated (a graph of its own), later ones a reset one.
            run(name, "prefill")
            run(name, "prefill")
            got = run(name, "decode")  # the first decode step after the prompt, as in the reference
            warm[name] = dict(first_s=time.perf_counter() - start, xla_compiles=xla_compile_stats()[0] - c0,
                              xla_compile_s=xla_compile_stats()[1] - s0)
            if name != "base, openxla":
                ref = want_one if name == PEFT_ONE else want
                errors[name] = float((got - ref).abs().max() / ref.abs().max())
                assert errors[name] < 1e-3, f"{name}: decode logits differ from eager PEFT by {errors[name]}"
            for _ in range(args.warmup):
                run(name, "decode")
        c0 = xla_compile_stats()[0]
        decode = time_interleaved({name: (lambda name=name: run(name, "decode")) for name in configs},
                                  args.reps, args.steps)
        prefill = prompt_step = None
        if not args.no_prefill:
            # Prefill: the default kernel only (the masked kernel at [B, S] is bench/step_time.py's subject).
            prefilled = [name for name in ("base, openxla", "xla_lora", PEFT_ONE, no_fold) if name in configs]
            c1 = xla_compile_stats()[0]
            for name in prefilled:  # the prompt step is a graph of its own: compile it, and check it
                last = run(name, "prefill")[:, -1:]
                run(name, "prompt")
                got = run(name, "prompt")
                prompt_err = float((got - last).abs().max() / last.abs().max())
                assert prompt_err < 1e-4, f"{name}: the prompt step's logits differ from its prefill's by {prompt_err}"
            c0 += xla_compile_stats()[0] - c1
            prefill = time_interleaved({name: (lambda name=name: run(name, "prefill")) for name in prefilled},
                                       args.reps, args.prefill_steps)
            prompt_step = time_interleaved({name: (lambda name=name: run(name, "prompt")) for name in prefilled},
                                           args.reps, args.prefill_steps)
        compiles_timed = xla_compile_stats()[0] - c0
        generate = _time_generate(args, configs, base_cpu, prompt.to(dev), rows, dev) if args.generate else None
        row = dict(adapters=n, batch=batch, prompt=args.prompt, decode=decode, prefill=prefill,
                   decode_ratio=ratios(decode, "base, openxla"),
                   prefill_ratio=ratios(prefill, "base, openxla") if prefill else None,
                   prompt_step=prompt_step, prompt_ratio=ratios(prompt_step, "base, openxla") if prompt_step else None,
                   generate=generate, warm=warm, max_rel_err=errors, xla_compiles_while_timed=compiles_timed,
                   xla_flags=os.environ.get("XLA_FLAGS", ""))
        results.append(row)
        med = {k: sorted(v)[len(v) // 2] for k, v in row["decode_ratio"].items()}
        pmed = {k: sorted(v)[len(v) // 2] for k, v in (row["prefill_ratio"] or {}).items()}
        qmed = {k: sorted(v)[len(v) // 2] for k, v in (row["prompt_ratio"] or {}).items()}
        print(f"adapters={n} batch={batch}: decode " + ", ".join(f"{k}={v:.3f}" for k, v in med.items())
              + (" | prefill " + ", ".join(f"{k}={v:.3f}" for k, v in pmed.items()) if pmed else "")
              + (" | prompt step " + ", ".join(f"{k}={v:.3f}" for k, v in qmed.items()) if qmed else "")
              + f" | base decode {sorted(decode['base, openxla'])[args.reps // 2] * 1e3:.1f} ms"
              + f" | compiles while timed {compiles_timed}"
              + (" | generate tokens/s " + ", ".join(f"{k}={v:.1f}" for k, v in generate["tokens_per_s"].items())
                 if generate else ""), flush=True)
    emit(dict(adapters=n, results=results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
