"""Where a small batch's ``generate`` spends its time: HF's eager attention mask, per token.

    python bench/generate_masks.py --adapters 16 --batch 1 --new 32 [--reps 5]

With a static cache, HF's ``prepare_inputs_for_generation`` builds the 4-d
attention mask of every step eagerly, outside the compiled forward
(``create_masks_for_generate``), from the 2-d mask that grows by one column per
token.  On XLA that is a host-side trace of many small ops at every step.  This
script times a full greedy ``generate`` four ways, side by side in one process:

* ``base, openxla`` / ``xla_lora``: as ``bench/decode_step.py`` times them (HF's ``generate`` on the base
  model with its forward compiled with openxla; PEFT's ``generate(adapter_names=...)`` served by this
  backend, which makes each step's mask inside its compiled forward: serving/generate_mask.py), each on a
  static cache of the same bucketed length;
* ``..., compiled masks``: the same, with the model's ``create_masks_for_generate`` replaced for the run by
  one ``torch.compile(backend="openxla")`` of HF's own function, called on the 2-d mask padded with zeros
  to the cache length (what HF's ``prepare_padding_mask`` pads it with), so every step has one shape (for
  ``xla_lora``, in place of its in-program mask: a mask function set on the model is kept).

An experiment: it shows how much of a token's time is the mask, for the base model and this backend
alike (``bench/generate_loop.py`` times this backend's own in-program mask).  The tokens of
each pair are checked equal before timing.
"""
from __future__ import annotations

import argparse
import copy

import _common  # noqa: F401  (sets PJRT_DEVICE before torch_xla loads)
import torch
from _common import xla_compile_stats
from _timing import emit, ratios, summary, time_interleaved
from step_time import VOCAB, build_models

BASE = "base, openxla"


def compiled_masks(cache_len: int):
    """HF's mask function compiled once for the fixed ``[B, cache_len]`` mask; called like the original."""
    import torch.nn.functional as F
    from transformers import masking_utils

    compiled = torch.compile(masking_utils.create_masks_for_generate, backend="openxla", dynamic=False)

    def create_masks_for_generate(*args, **kwargs):
        mask = kwargs.get("attention_mask")
        if mask is not None and mask.ndim == 2 and mask.shape[-1] < cache_len:
            kwargs["attention_mask"] = F.pad(mask, (0, cache_len - mask.shape[-1]))
        return compiled(*args, **kwargs)

    return create_masks_for_generate


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--adapters", type=int, default=16)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args(argv)

    import torch_xla

    import xla_lora_pass as xlp
    from xla_lora_pass.serving.static_cache import static_cache

    dev = torch_xla.device()
    base_cpu, peft_cpu, names = build_models(args.adapters)
    batch, new = args.batch, args.new
    prompt = torch.randint(0, VOCAB, (batch, args.prompt), generator=torch.Generator().manual_seed(batch)).to(dev)
    mask = torch.ones_like(prompt)
    rows = [names[i % len(names)] for i in range(batch)]

    served = copy.deepcopy(peft_cpu).to(dev)
    meta = xlp.LoRAMetadata(max_num_tokens=batch * args.prompt)
    meta.register_adapters(served)
    backend = xlp.make_backend(meta)  # from here on, served.generate runs through it (generation.py)
    base = copy.deepcopy(base_cpu).to(dev)
    base.forward = torch.compile(base.forward, backend="openxla")
    for model in (base, served):
        model.generation_config.eos_token_id = None  # random weights: every row makes `new` tokens
        model.generation_config.pad_token_id = 0
    cache_len = backend.buckets.pad_length(args.prompt + new)
    base_cache = static_cache(base.config, cache_len, batch)
    fast = compiled_masks(cache_len)
    transformer = served.get_base_model()

    def with_masks(model, masks):
        if masks is None:
            model.__dict__.pop("create_masks_for_generate", None)
        else:
            model.create_masks_for_generate = masks  # HF looks it up on the model first

    def run_base(masks):
        def fn():
            with_masks(base, masks)
            base_cache.reset()  # transformers 5's StaticLayer writes at its own count: reset before reuse
            with torch._dynamo.config.patch(automatic_dynamic_shapes=False):
                return base.generate(input_ids=prompt, attention_mask=mask, max_new_tokens=new, do_sample=False,
                                     past_key_values=base_cache).cpu()
        return fn

    def run_served(masks):
        def fn():
            with_masks(transformer, masks)
            return served.generate(input_ids=prompt, attention_mask=mask, adapter_names=rows, max_new_tokens=new,
                                   do_sample=False).cpu()
        return fn

    fns = {BASE: run_base(None), f"{BASE}, compiled masks": run_base(fast),
           "xla_lora": run_served(None), "xla_lora, compiled masks": run_served(fast)}
    with torch.no_grad():
        tokens = {}
        for name, fn in fns.items():  # compile and warm up
            fn()
            tokens[name] = fn()
        for name in (BASE, "xla_lora"):
            if not torch.equal(tokens[name], tokens[f"{name}, compiled masks"]):
                raise AssertionError(f"{name}: the compiled masks changed the tokens")
        before = xla_compile_stats()[0]
        times = time_interleaved(fns, args.reps, 1)
        compiles = xla_compile_stats()[0] - before
    rel = ratios(times, BASE)
    emit(dict(adapters=args.adapters, batch=batch, prompt=args.prompt, new_tokens=new, cache_len=cache_len,
              times=times, ratio=rel, xla_compiles_while_timed=compiles))
    print(f"batch {batch}, {new} new tokens, {args.reps} repetitions, {compiles} XLA compiles while timed")
    print("| configuration | ms per step (median; a step makes one token per row) | time / base |")
    print("|---|---|---|")
    for name, ts in times.items():
        per_step = sorted(ts)[len(ts) // 2] * 1e3 / new
        print(f"| {name} | {per_step:.2f} | {summary(rel[name])} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
