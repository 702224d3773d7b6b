"""Step time of one mixed multi-LoRA batch, this backend against the alternatives, side by side.

    python bench/step_time.py --adapters 16 --tokens 64,128,256,512 [--reps 5] [--steps 2]

One process per adapter count (``bench/run.py`` starts them): a Llama-style
model (hidden 512, intermediate 1408, 4 layers, 8 heads, vocab 4096, random
weights, fp32) with N PEFT adapters on every linear of the decoder layers
(``target_modules="all-linear"``, r=16, alpha=32).  The batch is 16 sequences
of T/16 tokens, sequence i on adapter i mod N.  Configurations, each timed in
steady state (compiled and warmed up first; every step ends with
``logits.cpu()``):

* ``base, openxla``: the model with no LoRA, ``torch.compile(backend="openxla")``: the floor.
* ``merged, openxla``: one adapter merged (PEFT ``merge_and_unload``): what a single adapter costs.
* ``xla_lora``: this backend with its default kernel ("auto": the row kernel, since every sequence is
  on one adapter), ``meta.set_token_adapters`` every step, alternating between two mappings (sequence i
  on adapter i mod N, then on i+1 mod N) so each step pays for a new mapping;
  ``xla_lora, masked kernel``: the same, its backend made with ``config.snapshot(kernel="masked")``;
  ``xla_lora, mixed within sequences``: the default backend with a mapping that changes adapter on
  every token (token j of sequence i on adapter (i + j) mod N), which the row kernel cannot run: the
  backend runs another rewrite of the same graph (the sorted kernel's where it fits, else the masked one).
* ``PEFT openxla, per adapter``: PEFT compiled with plain openxla, one call per adapter
  (``set_adapter``) on that adapter's sequences.
* ``PEFT eager mixed (CPU)`` and ``base eager (CPU)``: PEFT's ``adapter_names=`` mixed-batch path and
  the plain model, eager on the CPU (PEFT's mixed path cannot be compiled: it loops over adapters
  with data-dependent masks).

Each repetition runs every configuration once (rotating order); ratios are
taken within a repetition, so load from other jobs on the machine hits both
sides of a ratio.
"""
from __future__ import annotations

import argparse
import copy
import os
import time

import _common  # noqa: F401  (sets PJRT_DEVICE before torch_xla loads)
import torch
from _common import xla_compile_stats
from _timing import emit, ratios, time_interleaved

HIDDEN, INTERMEDIATE, LAYERS, HEADS, VOCAB, RANK, ALPHA, BATCH = 512, 1408, 4, 8, 4096, 16, 32, 16


def build_models(num_adapters: int, layers: int = LAYERS, seed: int = 0, hidden: int = HIDDEN,
                 intermediate: int = INTERMEDIATE, vocab: int = VOCAB, heads: int = HEADS, kv_heads: int = None):
    """(base model without LoRA, PEFT model with ``num_adapters`` all-linear adapters, adapter names), on the CPU.

    The shape defaults are this benchmark's model; bench/grid.py passes others (``kv_heads``: default ``heads``)."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                      num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=heads if kv_heads is None else kv_heads,
                      max_position_embeddings=2048)
    base = LlamaForCausalLM(cfg).eval()
    peft_model = None
    names = [f"a{i}" for i in range(num_adapters)]
    for name in names:
        lcfg = LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules="all-linear", init_lora_weights=False)
        if peft_model is None:
            peft_model = get_peft_model(copy.deepcopy(base), lcfg, adapter_name=name)
        else:
            peft_model.add_adapter(name, lcfg)
    # init_lora_weights=False draws B ~ U(-1/sqrt(r), 1/sqrt(r)): scale it down so 16 adapters keep
    # the activations in range (the timing does not depend on it; the logits check does).
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if ".lora_B." in n:
                p.mul_(0.1)
    peft_model.set_adapter(names[0])
    return base, peft_model.eval(), names


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--adapters", type=int, default=16)
    parser.add_argument("--tokens", default="64,128,256,512")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--steps", type=int, default=2, help="steps per configuration per repetition")
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args(argv)

    import torch_xla

    import xla_lora_pass as xlp
    from xla_lora_pass.demo_models import per_sequence_mapping

    torch._dynamo.config.recompile_limit = 1024  # PEFT per adapter: one graph per (adapter, shape)
    torch._dynamo.config.accumulated_recompile_limit = 4096
    dev = torch_xla.device()
    tokens = [int(t) for t in args.tokens.split(",")]
    n = args.adapters
    base_cpu, peft_cpu, names = build_models(n)

    base_xla = copy.deepcopy(base_cpu).to(dev)
    merged = copy.deepcopy(peft_cpu)
    merged.set_adapter(names[0])
    merged_xla = merged.merge_and_unload().to(dev)
    ours_model = copy.deepcopy(peft_cpu).to(dev)
    loop_model = copy.deepcopy(peft_cpu).to(dev)

    meta = xlp.LoRAMetadata(max_num_tokens=max(tokens))
    meta.register_adapters(ours_model)
    ours = torch.compile(ours_model, backend=xlp.make_backend(meta))
    # The same backend with the masked kernel (the settings are the backend's own, fixed when it is made).
    masked_model = copy.deepcopy(peft_cpu).to(dev)
    meta_masked = xlp.LoRAMetadata(max_num_tokens=max(tokens))
    meta_masked.register_adapters(masked_model)
    ours_masked = torch.compile(masked_model, backend=xlp.make_backend(
        meta_masked, settings=xlp.config.snapshot(kernel="masked")))
    c_base = torch.compile(base_xla, backend="openxla")
    c_merged = torch.compile(merged_xla, backend="openxla")
    c_loop = torch.compile(loop_model, backend="openxla")

    def static(fn):  # torch_xla's own setting for plain openxla: automatic dynamic shapes off
        def call():
            with torch._dynamo.config.patch(automatic_dynamic_shapes=False):
                fn()
        return call

    results = []
    for t in tokens:
        seq = t // BATCH
        ids = torch.randint(0, VOCAB, (BATCH, seq), generator=torch.Generator().manual_seed(t))
        ids_dev = ids.to(dev)
        row_adapters = [names[i % n] for i in range(BATCH)]
        mapping = per_sequence_mapping(row_adapters, seq)
        # A second per-sequence mapping to alternate with (no step reuses the previous step's), and a
        # per-token one that mixes adapters inside every sequence.
        mappings = [mapping, per_sequence_mapping([names[(i + 1) % n] for i in range(BATCH)], seq)]
        per_token = [names[(i + j) % n] for i in range(BATCH) for j in range(seq)]
        turn = [0]
        groups = [(a, torch.tensor([i for i, r in enumerate(row_adapters) if r == a])) for a in names]
        groups = [(a, ids[rows].to(dev)) for a, rows in groups if len(rows)]

        @torch.no_grad()
        def step_base():
            c_base(input_ids=ids_dev).logits.cpu()

        @torch.no_grad()
        def step_merged():
            c_merged(input_ids=ids_dev).logits.cpu()

        @torch.no_grad()
        def step_ours(fixed=None):
            turn[0] += 1
            meta.set_token_adapters(fixed if fixed is not None else mappings[turn[0] % 2])
            return ours(input_ids=ids_dev).logits.cpu()

        @torch.no_grad()
        def step_ours_per_token():
            meta.set_token_adapters(per_token)
            return ours(input_ids=ids_dev).logits.cpu()

        @torch.no_grad()
        def step_ours_masked(fixed=None):
            turn[0] += 1
            meta_masked.set_token_adapters(fixed if fixed is not None else mappings[turn[0] % 2])
            return ours_masked(input_ids=ids_dev).logits.cpu()

        @torch.no_grad()
        def step_loop():
            outs = []
            for a, g_ids in groups:
                loop_model.set_adapter(a)
                outs.append(c_loop(input_ids=g_ids).logits)
            return [o.cpu() for o in outs]

        @torch.no_grad()
        def step_eager_mixed():
            return peft_cpu(input_ids=ids, adapter_names=row_adapters).logits

        @torch.no_grad()
        def step_eager_base():
            base_cpu(input_ids=ids).logits

        fns = {
            "base, openxla": static(step_base),
            "merged 1 adapter, openxla": static(step_merged),
            "xla_lora": step_ours,
            "xla_lora, masked kernel": step_ours_masked,
            "xla_lora, mixed within sequences": step_ours_per_token,
            "PEFT openxla, per adapter": static(step_loop),
            "base eager (CPU)": step_eager_base,
            "PEFT eager mixed (CPU)": step_eager_mixed,
        }
        warm = {}
        for name, fn in fns.items():
            c0, s0 = xla_compile_stats()
            start = time.perf_counter()
            fn()
            warm[name] = dict(first_s=time.perf_counter() - start, xla_compiles=xla_compile_stats()[0] - c0,
                              xla_compile_s=xla_compile_stats()[1] - s0)
            for _ in range(args.warmup):
                fn()
        # The rewritten mixed batch matches PEFT's own mixed batch.
        got = step_ours(mapping)
        want = step_eager_mixed()
        err = float((got - want).abs().max() / want.abs().max())
        assert err < 1e-3, f"xla_lora logits differ from PEFT eager mixed: relative max error {err}"
        got_masked = step_ours_masked(mapping)
        err_masked = float((got_masked - want).abs().max() / want.abs().max())
        assert err_masked < 1e-3, f"the masked kernel's logits differ from PEFT eager mixed: {err_masked}"

        times = time_interleaved(fns, args.reps, args.steps)
        rat_xla = ratios(times, "base, openxla")
        rat_eager = ratios(times, "base eager (CPU)")
        results.append(dict(adapters=n, tokens=t, times=times, ratio_vs_base=rat_xla, ratio_vs_eager=rat_eager,
                            warm=warm, max_rel_err=max(err, err_masked),
                            stats=dict(compiles=meta.stats["compiles"]), xla_flags=os.environ.get("XLA_FLAGS", "")))
        print(f"adapters={n} tokens={t}: " + ", ".join(
            f"{k}={sorted(v)[len(v) // 2]:.3f}" for k, v in rat_xla.items()), flush=True)
    emit(dict(adapters=n, results=results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
