"""``python -m xla_lora_pass.demo``: three adapters and the base model in one batch.

A tiny Llama from a transformers config, 3 PEFT adapters (q_proj, v_proj)
with non-zero random weights, one batch whose rows use adapters sql, chat, code and
the base model, compiled with the xla_lora backend on torch_xla's XLA device
(on the CPU unless ``PJRT_DEVICE`` says otherwise), or on the CPU with
inductor where torch_xla is not installed, checked against eager PEFT; then
PEFT's ``generate(adapter_names=...)`` on the compiled model, each row's
tokens printed next to eager PEFT's.
"""
from __future__ import annotations

import os
import time

os.environ.setdefault("PJRT_DEVICE", "CPU")  # before torch_xla loads: no accelerator needed

import torch  # noqa: E402


def xla_compiles(on_xla: bool):
    """XLA's own compile count so far (None off XLA)."""
    if not on_xla:
        return None
    import torch_xla.debug.metrics as met

    return met.metric_data("CompileTime")[0]


def pick_device():
    """torch_xla's device where torch_xla is installed (XLA:CPU unless ``PJRT_DEVICE`` says), else the CPU."""
    from xla_lora_pass import runtimes

    try:
        import torch_xla  # noqa: F401
    except ImportError:
        return runtimes.open_device("cpu")
    return runtimes.open_device("xla")


def main() -> int:
    import xla_lora_pass as xlp
    from xla_lora_pass import runtimes
    from xla_lora_pass.demo_models import eager_reference, per_sequence_mapping, tiny_peft_llama

    model, names = tiny_peft_llama()
    rows = ["sql", "chat", "code", None]
    seq_len = 12
    ids = torch.randint(0, 128, (len(rows), seq_len), generator=torch.Generator().manual_seed(1))
    reference = eager_reference(model, ids, rows)
    adapter_names = ["__base__" if r is None else r for r in rows]
    prompt = ids[:, :6]
    with torch.no_grad():  # before make_backend: from then on the model's generate runs through the backend
        peft_tokens = model.generate(input_ids=prompt, max_new_tokens=8, do_sample=False, pad_token_id=0,
                                     adapter_names=adapter_names)[:, prompt.shape[1]:]

    device = pick_device()
    on_xla = device.type == "xla"
    model.to(device)
    meta = xlp.LoRAMetadata(max_num_tokens=1024)
    slots = meta.register_adapters(model)
    compiled = torch.compile(model, backend=xlp.make_backend(meta))
    meta.set_token_adapters(per_sequence_mapping(rows, seq_len))

    start = time.perf_counter()
    with torch.no_grad():
        logits = compiled(input_ids=ids.to(device)).logits.cpu()
    first = time.perf_counter() - start
    compiles_after_first = xla_compiles(on_xla)

    # A new mapping: rows rotate adapters.  Indices are graph inputs: no recompile.
    rotated = rows[1:] + rows[:1]
    meta.set_token_adapters(per_sequence_mapping(rotated, seq_len))
    model.cpu()
    reference2 = eager_reference(model, ids, rotated)
    model.to(device)
    with torch.no_grad():
        logits2 = compiled(input_ids=ids.to(device)).logits.cpu()
    compiles_after_remap = xla_compiles(on_xla)

    # PEFT's own generate call on the compiled model: every step runs the rewritten programs.
    with torch.no_grad():
        tokens = compiled.generate(input_ids=prompt.to(device), max_new_tokens=8, do_sample=False, pad_token_id=0,
                                   adapter_names=adapter_names).cpu()[:, prompt.shape[1]:]

    stats = meta.stats
    print(f"slots:                {slots}")
    print(f"rows use adapters:    {rows} (then {rotated})")
    print(f"sites rewritten:      {dict(stats['rewrites'])}")
    print(f"device, inner backend: {device}, {runtimes.for_device(device).inner_backend}")
    print(f"backend compiles:     {stats['compiles']}")
    if on_xla:
        print(f"XLA compiles:         {compiles_after_first} after the first call, "
              f"{compiles_after_remap} after the remap")
    print(f"first call:           {first:.2f} s")
    diff = max((logits - reference).abs().max().item(), (logits2 - reference2).abs().max().item())
    print(f"max |logits - eager PEFT|: {diff:.3g}")
    print("generate, 8 new tokens:  row adapter  compiled tokens / eager PEFT tokens")
    for row, name in enumerate(adapter_names):
        same = "same" if torch.equal(tokens[row], peft_tokens[row]) else "DIFFERENT"
        print(f"  {row}  {name:9s} {tokens[row].tolist()} / {peft_tokens[row].tolist()}  {same}")
    ok = diff < 1e-4 and torch.equal(tokens, peft_tokens)
    print("OK" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
