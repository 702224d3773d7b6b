"""Step time of one mixed batch with and without a DoRA adapter, side by side in one process.

    python bench/dora.py [--tokens 128,256] [--adapters 4] [--reps 5] [--steps 3] [--layers 4] [--clock wall]

Two copies of one Llama-style model (``step_time.build_models``: hidden 512,
4 layers, all-linear PEFT adapters, r=16): in ``lora`` every adapter is plain
LoRA; in ``with DoRA`` the last adapter is DoRA (same rank, magnitudes
perturbed so its scale is not 1).  Both run the same batch: 16 sequences,
sequence i on adapter i mod (N + 1), the extra one on the base model, with the
backend's default kernel.  Every repetition times both (rotating order) and
the ratio is taken within it.  Prints a markdown table; the machine's load
average is printed with it (other jobs share the cores).  ``--clock cpu``
times the process's CPU time (all its threads) instead of wall time: other
jobs on the cores inflate it less, so it compares the work of the two
batches on a loaded machine, not their step time.
"""
from __future__ import annotations

import argparse
import os
import time

import _common  # noqa: F401  (sets PJRT_DEVICE before torch_xla loads)
import torch
from _common import markdown_table
from _timing import median, ratios, summary, time_interleaved
from step_time import BATCH, build_models


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def _with_dora(peft_model, name: str):
    """The same model with adapter ``name`` rebuilt as DoRA (its A/B kept), magnitudes perturbed."""
    from peft import LoraConfig

    state = {k: v.clone() for k, v in peft_model.state_dict().items() if f".{name}." in k}
    cfg = LoraConfig(**{**peft_model.peft_config[name].to_dict(), "use_dora": True})
    peft_model.delete_adapter(name)
    peft_model.add_adapter(name, cfg)
    peft_model.load_state_dict(state, strict=False)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for module in peft_model.modules():
            dora = getattr(module, "lora_magnitude_vector", {})
            if name in dora:
                dora[name].update_layer(base_layer=module.get_base_layer(), lora_A=module.lora_A[name].weight,
                                        lora_B=module.lora_B[name].weight, scaling=module.scaling[name])
                dora[name].weight.mul_(0.5 + torch.rand(dora[name].weight.shape, generator=g))
    return peft_model


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="128,256")
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    args = parser.parse_args(argv)

    import torch_xla

    import xla_lora_pass as xlp

    device = torch_xla.device()
    _, lora_model, names = build_models(args.adapters, layers=args.layers)
    _, other, _ = build_models(args.adapters, layers=args.layers)
    dora_model = _with_dora(other, names[-1])
    dora_model.set_adapter(names[0])
    rows = [names[i % (len(names) + 1)] if i % (len(names) + 1) < len(names) else None for i in range(BATCH)]
    compiled = {}
    for label, model in (("lora", lora_model), ("with DoRA", dora_model)):
        model.to(device)
        meta = xlp.LoRAMetadata(max_num_tokens=max(int(t) for t in args.tokens.split(",")))
        meta.register_adapters(model)
        compiled[label] = (meta, torch.compile(model, backend=xlp.make_backend(meta)))
    table = []
    for tokens in (int(t) for t in args.tokens.split(",")):
        seq = tokens // BATCH
        ids = torch.randint(0, 4096, (BATCH, seq), generator=torch.Generator().manual_seed(1)).to(device)
        mapping = [r for r in rows for _ in range(seq)]

        def step(label):
            meta, fn = compiled[label]
            meta.set_token_adapters(mapping)
            with torch.no_grad():
                fn(input_ids=ids).logits.cpu()

        fns = {label: (lambda label=label: step(label)) for label in compiled}
        for fn in fns.values():  # compile and warm up
            fn()
            fn()
        times = time_interleaved(fns, args.reps, args.steps, CLOCKS[args.clock])
        ratio = ratios(times, "lora")["with DoRA"]
        table.append([tokens, f"{median(times['lora']) * 1e3:.1f}", f"{median(times['with DoRA']) * 1e3:.1f}",
                      summary(ratio, "{:.3f}")])
        print(f"  {tokens} tokens done", flush=True)
    load = os.getloadavg()
    print(f"\nDoRA step {args.clock} time, {args.adapters} adapters (the last one DoRA or plain LoRA) + base rows, "
          f"{args.layers} layers, {args.reps} reps x {args.steps} steps; load average {load[0]:.1f} "
          f"({os.cpu_count()} cores)\n")
    print(markdown_table(["tokens", "lora ms", "with DoRA ms", "with DoRA / lora, median [min-max]"], table))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
