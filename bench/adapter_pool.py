"""An adapter pool under a Zipf stream: 256 saved adapters through 8 or 32 slots, against all resident.

    python bench/adapter_pool.py [--adapters 256] [--batches 60] [--reps 3] [--host-cache N]
        [--host-cache-bytes B]
        [--hidden 256] [--intermediate 512] [--layers 2] [--vocab 512]

One process holds served copies of one Llama (all-linear LoRA, r=16; by
default a tiny one, hidden 256): 8 slots and 32 slots (each also with the next batch's adapters
prefetched while a batch runs), and 256 slots with every adapter loaded before the
stream (no swap); adapters read stay on the host with their swaps prepared,
at most ``--host-cache`` of them holding at most ``--host-cache-bytes``
(``LoRAMetadata(host_cache=, host_cache_bytes=)``: the package's defaults, no
count and 2 GiB, unless given).  The same Zipf(1.1) stream of batches (8 requests of 32
tokens, each on its own adapter) runs through each, in rotating order within
every repetition; a step is ``set_request_adapters`` (the swaps) plus the
compiled call.  Printed: step time / all-resident step (median [min-max]
over repetitions), swaps per step, milliseconds per swapped adapter, and
adapter bytes sent to the device per step (``meta.stats["bytes_to_device"]``,
checked against torch_xla's ``OutboundData``); then a swap of an adapter
already read (prefetched and staged) against the same swap with its writes
traced on every call, and against copying its bytes to the device.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import _common  # noqa: F401  (PJRT_DEVICE=CPU)
import xla_lora_pass  # noqa: F401  (before the first torch_xla.device(): XLA:CPU's scheduler flag)
from _common import markdown_table, xla_compile_stats
from _timing import summary

ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def save_adapters(root, n: int, rank: int, seed: int = 0, shape=None):
    """``n`` adapters saved with PEFT's save_pretrained (random weights, alphas that differ), for a Llama of
    ``shape`` (default ``MODEL``)."""
    import torch
    from xla_lora_pass.demo_models import tiny_peft_llama

    template, _ = tiny_peft_llama(targets=ALL_LINEAR, adapters=(("default", rank, rank),), **(shape or MODEL))
    gen = torch.Generator().manual_seed(seed)
    lora = [p for name, p in template.named_parameters() if ".lora_A." in name or ".lora_B." in name]
    for i in range(n):
        with torch.no_grad():
            for p in lora:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
        template.peft_config["default"].lora_alpha = rank + i % 7
        template.save_pretrained(f"{root}/ad{i:03d}")
    return [f"ad{i:03d}" for i in range(n)], sum(p.numel() * p.element_size() for p in lora)


MODEL = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, vocab_size=512)


def served(root, names, slots: int, resident: bool, device, shape=None, host_cache: dict = None):
    """A compiled model (a Llama of ``shape``, default ``MODEL``) whose metadata knows every adapter by directory
    (loaded up front if ``resident``) and keeps them read on the host within ``host_cache`` (the keywords
    ``host_cache`` and ``host_cache_bytes`` of ``LoRAMetadata``; its defaults where absent)."""
    import torch
    import xla_lora_pass as xlp
    from xla_lora_pass.demo_models import tiny_peft_llama

    model, _ = tiny_peft_llama(targets=ALL_LINEAR, adapters=((names[0], RANK, RANK),), **(shape or MODEL))
    model = model.to(device)
    meta = xlp.LoRAMetadata(max_num_tokens=512, max_slots=slots, **(host_cache or {}))
    meta.register_adapters(model)
    for name in names[1:]:
        meta.add_adapter(name, f"{root}/{name}")
        if resident:
            meta.load_adapter(name, f"{root}/{name}")
    compiled = torch.compile(model, backend=xlp.make_backend(meta))
    return meta, compiled


RANK, ROWS, SEQ = 16, 8, 32


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--adapters", type=int, default=256)
    parser.add_argument("--batches", type=int, default=60, help="batches per configuration per repetition")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=MODEL["hidden_size"])
    parser.add_argument("--intermediate", type=int, default=MODEL["intermediate_size"])
    parser.add_argument("--layers", type=int, default=MODEL["num_hidden_layers"])
    parser.add_argument("--vocab", type=int, default=MODEL["vocab_size"])
    parser.add_argument("--host-cache", type=int, default=None,
                        help="adapters kept read on the host at most (LoRAMetadata(host_cache=)); default: no count")
    parser.add_argument("--host-cache-bytes", type=int, default=None,
                        help="their bytes at most (LoRAMetadata(host_cache_bytes=)); default: the package's 2 GiB")
    args = parser.parse_args()
    shape = dict(hidden_size=args.hidden, intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                 vocab_size=args.vocab)

    import torch
    import torch_xla
    import torch_xla.debug.metrics as met

    device = torch_xla.device()
    root = tempfile.mkdtemp(prefix="adapter_pool_")
    names, adapter_bytes = save_adapters(root, args.adapters, RANK, shape=shape)
    configs = {"8 slots": (8, False), "8 slots, next batch prefetched": (8, False), "32 slots": (32, False),
               "32 slots, next batch prefetched": (32, False),
               f"{args.adapters} slots, all resident": (args.adapters, True)}
    host_cache = {k: v for k, v in (("host_cache", args.host_cache), ("host_cache_bytes", args.host_cache_bytes))
                  if v is not None}
    served_by = {label: served(root, names, *cfg, device, shape, host_cache) for label, cfg in configs.items()}
    weights = torch.tensor([1.0 / (i + 1) ** 1.1 for i in range(len(names))])
    gen = torch.Generator().manual_seed(0)
    stream = [([names[i] for i in torch.multinomial(weights, ROWS, replacement=True, generator=gen).tolist()],
               torch.randint(0, args.vocab, (ROWS, SEQ), generator=gen)) for _ in range(args.batches)]

    def run(label, batches):
        meta, compiled = served_by[label]
        swap_s = 0.0
        start = time.perf_counter()
        for i, (rows, ids) in enumerate(batches):
            t = time.perf_counter()
            meta.set_request_adapters(rows)
            swap_s += time.perf_counter() - t
            if "prefetched" in label and i + 1 < len(batches):
                meta.prefetch(batches[i + 1][0])  # read while this batch runs
            with torch.no_grad():
                compiled(input_ids=ids.to(device)).logits.cpu()
        return (time.perf_counter() - start) / len(batches), swap_s

    for label in configs:  # warm-up: programs compiled, every slot filled once
        run(label, stream[:10])
    compiles_before = xla_compile_stats()[0]
    step = {label: [] for label in configs}
    totals = {label: dict(loads=0, swap_s=0.0, bytes=0, outbound=0.0) for label in configs}
    for rep in range(args.reps):
        order = list(configs)[rep % len(configs):] + list(configs)[:rep % len(configs)]
        for label in order:
            meta = served_by[label][0]
            before, out_before = meta.stats, met.metric_data("OutboundData")[1]
            seconds, swap_s = run(label, stream)
            step[label].append(seconds)
            totals[label]["loads"] += meta.stats["loads"] - before["loads"]
            totals[label]["swap_s"] += swap_s
            totals[label]["bytes"] += meta.stats["bytes_to_device"] - before["bytes_to_device"]
            totals[label]["outbound"] += met.metric_data("OutboundData")[1] - out_before
    base = list(configs)[-1]
    steps = args.batches * args.reps
    rows = []
    for label in configs:
        t = totals[label]
        ratio = [s / b for s, b in zip(step[label], step[base])]
        rows.append([label, f"{statistics.median(step[label]) * 1e3:.1f}", summary(ratio),
                     f"{t['loads'] / steps:.2f}",
                     f"{t['swap_s'] / t['loads'] * 1e3:.2f}" if t["loads"] else "-",
                     f"{t['bytes'] / steps / 1e3:.0f}", f"{t['outbound'] / steps / 1e3:.0f}"])
    print(f"\nLlama hidden {args.hidden}, intermediate {args.intermediate}, {args.layers} layers, vocab {args.vocab}; "
          f"{args.adapters} adapters (all-linear r={RANK}, {adapter_bytes / 1e6:.2f} MB each), Zipf(1.1) stream of "
          f"{ROWS} requests x {SEQ} tokens, {args.reps} reps x {args.batches} batches; host cache "
          f"{host_cache or 'the package default (no count, 2 GiB)'}; XLA compiles during the "
          f"timed stream: {xla_compile_stats()[0] - compiles_before}\n")
    print(markdown_table(["configuration", "step ms (median)", "step / all resident", "swaps / step", "ms / swap",
                          "adapter kB to device / step", "all kB to device / step (OutboundData)"], rows))
    print(f"\nkB to device per swapped adapter / one adapter's {adapter_bytes / 1e3:.0f} kB: " + ", ".join(
        f"{label}: {t['bytes'] / t['loads'] / adapter_bytes:.3f}" for label, t in totals.items() if t["loads"]))
    twins = {label: traced_twin(root, names, served_by[label][0].num_slots, device, shape, stream)
             for label in ("8 slots", "32 slots")}
    print("\n" + swap_write_table(served_by, twins, names, adapter_bytes, device))


def traced_twin(root, names, slots: int, device, shape, stream):
    """The same served model whose swaps trace their writes on every call (the generic
    ``Runtime.write_program``: ops, then a sync), not the program compiled once that XLA's runtime makes:
    made and warmed with the runtime's method replaced, so every swap program it keeps is the traced one."""
    from unittest import mock

    import torch
    from xla_lora_pass import runtimes

    with mock.patch.object(type(runtimes.for_device(device)), "write_program", runtimes.Runtime.write_program):
        meta, compiled = served(root, names, slots, False, device, shape)
        for rows, ids in stream[:10]:
            meta.set_request_adapters(rows)
            with torch.no_grad():
                compiled(input_ids=ids.to(device)).logits.cpu()
    return meta


def swap_write_table(served_by, twins, names, adapter_bytes: int, device, swaps: int = 16) -> str:
    """Per slot count: a swap of an adapter already read and staged on the host (``prefetch(wait=True)``),
    against the same swap with its writes traced on every call (``twins``: ``traced_twin``), and against
    copying the same bytes to the device, interleaved swap by swap: once as one host tensor (``.to(device)``)
    and once as the swap sends them (one call, ``Runtime.send``); each timed until the device is done
    (``wait_device_ops``)."""
    import torch
    import torch_xla.core.xla_model as xm
    from xla_lora_pass import runtimes

    def timed(fn):
        xm.wait_device_ops()
        start = time.perf_counter()
        fn()
        xm.wait_device_ops()
        return time.perf_counter() - start

    def swap_on(meta, name):
        meta.prefetch([name], wait=True)  # read, checked and staged on the host: the swap alone is timed
        return timed(lambda: meta.set_request_adapters([name] * ROWS))

    host = torch.randn(adapter_bytes // 4)
    rows = []
    for label, twin in twins.items():
        meta = served_by[label][0]
        swap, traced, whole, sent = [], [], [], []
        for name in [n for n in names if n not in meta.slots and n not in twin.slots][-swaps:]:
            swap.append(swap_on(meta, name))
            traced.append(swap_on(twin, name))
            whole.append(timed(lambda: host.to(device)))
            sent.append(timed(lambda: runtimes.for_device(device).send([host], device)))
        rows.append([label, meta.num_slots, f"{statistics.median(swap) * 1e3:.2f}",
                     f"{statistics.median(traced) * 1e3:.2f}", summary([a / b for a, b in zip(swap, traced)]),
                     f"{statistics.median(whole) * 1e3:.2f}", summary([a / b for a, b in zip(swap, whole)]),
                     f"{statistics.median(sent) * 1e3:.2f}", summary([a / b for a, b in zip(swap, sent)])])
    return markdown_table(["configuration", "slots", "ms / swap, staged (median)", "ms / swap, write traced per call",
                           "swap / traced", "ms / copy as one tensor", "swap / copy as one tensor",
                           "ms / copy in 64 kB pieces", "swap / copy in pieces"], rows)


if __name__ == "__main__":
    main()
