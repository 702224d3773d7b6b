"""Off XLA: this backend under inductor on the CPU, against the base model and PEFT under plain inductor.

    python bench/inductor.py                       # hidden 512 and 2048 (vocab 32000), 8 adapters, 7 reps
    python bench/inductor.py --shapes 512 --reps 3 # a quick look
    python bench/inductor.py --shapes 512 --opaque-ops  # also the kernels as opaque ops

Runs on any torch this package supports, torch_xla or not (the CPU device).
Per shape, a Llama-style model with 8 PEFT adapters (r=16, every linear of the
decoder layers), a batch of 8 rows, row i on adapter i; configurations, each
compiled and warmed first, timed interleaved (bench/_timing.py), every step
ending with the logits on the host:

* ``base, inductor``: the model without LoRA, ``torch.compile(backend="inductor")``: the floor.
* ``xla_lora, inductor``: this backend (``inner="inductor"``), the row kernel, a new mapping every step
  (alternating between two).
* ``xla_lora, inductor, opaque ops`` (``--opaque-ops``): the same, with inductor given no decomposition of
  the xla_lora ops (``inner=`` a plain ``compile_fx``), so it calls them as opaque ops; the default hands it
  their decompositions (backend/inner_backend.py) and fuses them.
* ``PEFT inductor, mixed``: PEFT's own mixed batch (``adapter_names=``) compiled with inductor, one
  mapping (it is specialised on the list: its compiles over 8 mappings are counted separately).

Printed: each ratio to the base model beside the FLOP floor (bench/_flops.py),
the largest difference from eager PEFT's mixed batch, and the compiles of this
backend and of PEFT under inductor over 8 mappings of the same shape.
"""
from __future__ import annotations

import argparse
import copy
import json
import os

import _common  # noqa: F401
import torch
from _common import markdown_table
from _flops import flop_floor
from _timing import OUT_DIR, median, ratios, summary, time_interleaved

# hidden -> (intermediate, layers, heads, vocab): the toy shape, and TinyLlama-1.1B's layer shapes on 2 layers.
SHAPES = {512: (1408, 4, 8, 4096), 2048: (5632, 2, 16, 32000)}
RANK, ALPHA, ADAPTERS, ROWS = 16, 32, 8, 8


def build(hidden: int, seed: int = 0):
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    intermediate, layers, heads, vocab = SHAPES[hidden]
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
                      max_position_embeddings=2048)
    base = LlamaForCausalLM(cfg).eval()
    names = [f"a{i}" for i in range(ADAPTERS)]
    model = None
    for name in names:
        lcfg = LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules="all-linear", init_lora_weights=False)
        if model is None:
            model = get_peft_model(copy.deepcopy(base), lcfg, adapter_name=name)
        else:
            model.add_adapter(name, lcfg)
    with torch.no_grad():  # keep 8 adapters' deltas in range (timing does not depend on it, the check does)
        for n, p in model.named_parameters():
            if ".lora_B." in n:
                p.mul_(0.1)
    return base, model.eval(), names


def counting_inductor(counter: dict, key: str):
    from torch._inductor.compile_fx import compile_fx

    def backend(gm, example_inputs):
        counter[key] += 1
        return compile_fx(gm, example_inputs)

    return backend


def plain_inductor(gm, example_inputs):
    """Inductor without the xla_lora ops' decompositions: they run as opaque calls."""
    from torch._inductor.compile_fx import compile_fx

    return compile_fx(gm, example_inputs)


def serve(peft_model, seq: int, inner):
    """A copy of the model served by this backend with ``inner``: (its metadata, the compiled model)."""
    import xla_lora_pass as xlp

    model = copy.deepcopy(peft_model)
    meta = xlp.LoRAMetadata(max_num_tokens=ROWS * seq)
    meta.register_adapters(model)
    return meta, torch.compile(model, backend=xlp.make_backend(meta, inner=inner))


def run_shape(hidden: int, seq: int, reps: int, steps: int, opaque: bool = False) -> dict:
    intermediate, layers, _, vocab = SHAPES[hidden]
    # As a fresh process: Dynamo's automatic-dynamic state of the shared HF/PEFT code would otherwise carry
    # over from the previous shape (floats made graph inputs, see the user guide's known limits).
    torch._dynamo.reset()
    base, peft_model, names = build(hidden)
    ids = torch.randint(0, vocab, (ROWS, seq), generator=torch.Generator().manual_seed(hidden))
    rows = [names[i % ADAPTERS] for i in range(ROWS)]
    mappings = [[names[(i + k) % ADAPTERS] for i in range(ROWS)] for k in range(8)]
    compiles = {"peft": 0}

    meta, ours = serve(peft_model, seq, "inductor")
    c_base = torch.compile(base, backend="inductor")
    c_peft = torch.compile(copy.deepcopy(peft_model), backend=counting_inductor(compiles, "peft"))
    turn = [0]

    @torch.no_grad()
    def step_base():
        return c_base(input_ids=ids).logits.float()

    @torch.no_grad()
    def step_ours(fixed=None):
        turn[0] += 1
        meta.set_request_adapters(fixed if fixed is not None else mappings[turn[0] % 2])
        return ours(input_ids=ids).logits.float()

    @torch.no_grad()
    def step_peft(adapter_names=rows):
        return c_peft(input_ids=ids, adapter_names=adapter_names).logits.float()

    with torch.no_grad():
        want = peft_model(input_ids=ids, adapter_names=rows).logits
    # Compiles over 8 mappings of one shape, after the first call: this backend's programs, then PEFT's graphs.
    # This backend's are counted before PEFT's model is first compiled: the two compiled copies share PEFT's
    # and HF's code objects, and PEFT's first trace (its adapter_names hooks) makes Dynamo retrace this
    # backend's graph once more (1 program then, 0 counted this way).
    err = {"xla_lora": float((step_ours(rows) - want).abs().max())}
    ours_before = meta.stats["compiles"]
    for m in mappings:
        step_ours(m)
    counts = {"xla_lora": meta.stats["compiles"] - ours_before}
    err["PEFT inductor"] = float((step_peft() - want).abs().max())
    peft_before = compiles["peft"]
    for m in mappings:
        step_peft(m)
    counts["PEFT inductor"] = compiles["peft"] - peft_before

    fns = {"base, inductor": step_base, "xla_lora, inductor": step_ours, "PEFT inductor, mixed": step_peft}
    if opaque:
        meta_o, ours_o = serve(peft_model, seq, plain_inductor)
        turn_o = [0]

        @torch.no_grad()
        def step_opaque(fixed=None):
            turn_o[0] += 1
            meta_o.set_request_adapters(fixed if fixed is not None else mappings[turn_o[0] % 2])
            return ours_o(input_ids=ids).logits.float()

        err["xla_lora opaque"] = float((step_opaque(rows) - want).abs().max())
        counts["xla_lora opaque"] = "-"
        fns["xla_lora, inductor, opaque ops"] = step_opaque
    for fn in fns.values():
        fn()
    times = time_interleaved(fns, reps, steps)
    return dict(hidden=hidden, intermediate=intermediate, layers=layers, vocab=vocab, tokens=ROWS * seq,
                times=times, ratios=ratios(times, "base, inductor"), max_abs_err=err, compiles_8_mappings=counts,
                floor=flop_floor(hidden, intermediate, layers, vocab, RANK, context=seq))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="512,2048", help="hidden sizes, from " + ",".join(map(str, SHAPES)))
    parser.add_argument("--seq", type=int, default=32, help="tokens per row (8 rows)")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--opaque-ops", action="store_true",
                        help="also time this backend with the xla_lora ops opaque to inductor (no decompositions)")
    args = parser.parse_args(argv)
    torch._dynamo.config.recompile_limit = 64  # PEFT's mixed batch: one graph per adapter_names list
    torch._dynamo.config.accumulated_recompile_limit = 1024

    results = [run_shape(int(h), args.seq, args.reps, args.steps, args.opaque_ops) for h in args.shapes.split(",")]
    table = []
    for r in results:
        shape = f"hidden {r['hidden']}, vocab {r['vocab']}, {r['layers']} layers, {r['tokens']} tokens"
        base_ms = median(r["times"]["base, inductor"]) * 1e3
        for name, values in r["ratios"].items():
            if name == "base, inductor":
                continue
            key = name.split(",")[0] + (" opaque" if name.endswith("opaque ops") else "")
            table.append([shape, name, summary(values), f"{r['floor']:.3f}", f"{base_ms:.1f}",
                          f"{r['max_abs_err'][key]:.1e}", r["compiles_8_mappings"][key]])
    print(f"\ntorch {torch.__version__}, CPU, {ADAPTERS} adapters r={RANK}, one per row; median [min-max] over "
          f"{args.reps} interleaved repetitions\n")
    print(markdown_table(["shape", "config", "time / base", "FLOP floor", "base ms", "max abs err vs PEFT eager",
                          "compiles over 8 mappings"], table))
    os.makedirs(OUT_DIR, exist_ok=True)
    with open(os.path.join(OUT_DIR, "inductor.json"), "w") as f:
        json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
