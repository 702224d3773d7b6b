"""1-device vs 4-device (SPMD, Megatron-sharded) step time of the same multi-LoRA batch.

    python bench/spmd.py [--rounds 2] [--steps 15]

Each configuration runs in its own process (SPMD must be switched on before
any XLA tensor exists), ``--rounds`` times in rotating order; a process
compiles, warms up, then times ``--steps`` steps (``set_token_adapters`` +
the compiled call + ``logits.cpu()``) and reports the median step.  The table
gives the median over rounds, and each configuration's ratio to the 1-device
run of the same model.

The 4 "devices" are PJRT CPU clients sharing the machine's cores, so this
measures what SPMD partitioning costs (collectives, smaller per-device
matmuls, per-device launch), not a speed-up.

Configurations:

* ``base 1 dev`` / ``base 4 dev``: the model with no LoRA, openxla; base weights Megatron-sharded on 4.
* ``lora 1 dev``: this backend, 8 adapters mixed per sequence, single-device runtime.
* ``lora 4 dev, adapters sharded``: SPMD, base Megatron-sharded, ``meta.shard(mesh)``.
* ``lora 4 dev, adapters replicated``: the same without ``meta.shard`` (stacked buffers on every device whole).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
HIDDEN, INTERMEDIATE, LAYERS, HEADS, VOCAB, RANK, ALPHA, ADAPTERS = 256, 512, 2, 8, 1024, 16, 32, 8
BATCH, SEQ = 4, 64
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

CONFIGS = {
    "base 1 dev": dict(devices=1, lora=False),
    "base 4 dev": dict(devices=4, lora=False),
    "lora 1 dev": dict(devices=1, lora=True),
    "lora 4 dev, adapters sharded": dict(devices=4, lora=True, shard_adapters=True),
    "lora 4 dev, adapters replicated": dict(devices=4, lora=True, shard_adapters=False),
}


def child(name: str, steps: int) -> dict:
    cfg = CONFIGS[name]
    os.environ["PJRT_DEVICE"] = "CPU"
    os.environ["CPU_NUM_DEVICES"] = str(cfg["devices"])
    import numpy as np
    import torch
    import torch_xla
    import torch_xla.runtime as xr

    if cfg["devices"] > 1:
        xr.use_spmd()
    import torch_xla.distributed.spmd as xs
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    import xla_lora_pass as xlp
    from xla_lora_pass.demo_models import per_sequence_mapping
    from xla_lora_pass.metadata.sharding import megatron_shard_llama, shard_bytes

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
                                         num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                                         num_key_value_heads=HEADS, max_position_embeddings=512)).eval()
    names = [f"a{i}" for i in range(ADAPTERS)]
    if cfg["lora"]:
        for i, a in enumerate(names):
            lcfg = LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=TARGETS, init_lora_weights=False)
            model = get_peft_model(model, lcfg, adapter_name=a) if i == 0 else model
            if i:
                model.add_adapter(a, lcfg)
        with torch.no_grad():  # keep 8 adapters' deltas in range
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.mul_(0.1)
        model.set_adapter(names[0])
        model.eval()
    device = torch_xla.device()
    model.to(device)
    out = {"config": name, "devices": xr.global_runtime_device_count()}
    mesh = None
    if cfg["devices"] > 1:
        mesh = xs.Mesh(np.arange(cfg["devices"]), (1, cfg["devices"]), ("data", "model"))
        out["base_sharded"] = len(megatron_shard_llama(model, mesh))
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    mapping = per_sequence_mapping([names[i % ADAPTERS] for i in range(BATCH)], SEQ)
    if cfg["lora"]:
        meta = xlp.LoRAMetadata(max_num_tokens=BATCH * SEQ)
        meta.register_adapters(model)
        if cfg.get("shard_adapters"):
            meta.shard(mesh)
        compiled = torch.compile(model, backend=xlp.make_backend(meta))
    else:
        meta = None
        compiled = torch.compile(model, backend="openxla")

    def step():
        if meta is not None:
            meta.set_token_adapters(mapping)
        with torch.no_grad():
            return compiled(input_ids=ids.to(device)).logits.cpu()

    t0 = time.perf_counter()
    logits = step()
    out["first_call_s"] = time.perf_counter() - t0
    for _ in range(3):
        step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    out["step_ms"] = 1e3 * statistics.median(times)
    out["logits_sample"] = logits[:, -1, :8].flatten().tolist()
    if meta is not None:
        tensors = {id(t): t for site in meta.sites for t in meta.stacked_weights(site, device)}
        per_dev = [shard_bytes(t) for t in tensors.values()]
        out["adapter_bytes_per_device"] = sum(p for p, _ in per_dev)
        out["adapter_bytes_whole"] = sum(w for _, w in per_dev)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--child")
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.steps)))
        return
    sys.path.insert(0, HERE)
    from _common import markdown_table

    runs = {name: [] for name in CONFIGS}
    order = list(CONFIGS)
    for r in range(args.rounds):
        for name in order[r % len(order):] + order[: r % len(order)]:
            env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES=str(CONFIGS[name]["devices"]))
            proc = subprocess.run([sys.executable, __file__, "--child", name, "--steps", str(args.steps)],
                                  env=env, capture_output=True, text=True)
            if proc.returncode != 0:
                raise SystemExit(f"{name} failed:\n{proc.stderr[-4000:]}")
            res = json.loads(proc.stdout.strip().splitlines()[-1])
            runs[name].append(res)
            print(f"round {r}: {name}: {res['step_ms']:.2f} ms/step", file=sys.stderr)
    med = {name: statistics.median(x["step_ms"] for x in rs) for name, rs in runs.items()}
    # Same batch, same weights: every LoRA configuration gives the same logits, every base one too.
    for group in ("base", "lora"):
        samples = [runs[n][0]["logits_sample"] for n in CONFIGS if n.startswith(group)]
        diff = max(abs(a - b) for s in samples[1:] for a, b in zip(s, samples[0]))
        print(f"{group}: max |logits diff| across device counts = {diff:.2e}", file=sys.stderr)
    rows = []
    for name in CONFIGS:
        one = med["lora 1 dev" if name.startswith("lora") else "base 1 dev"]
        last = runs[name][-1]
        mem = (f"{last['adapter_bytes_per_device'] / 2**20:.2f} / {last['adapter_bytes_whole'] / 2**20:.2f}"
               if "adapter_bytes_whole" in last else "-")
        base_here = med[f"base {CONFIGS[name]['devices']} dev"]
        spread = sorted(x["step_ms"] for x in runs[name])
        rows.append((name, f"{med[name]:.2f}", f"{spread[0]:.1f}-{spread[-1]:.1f}", f"{med[name] / one:.2f}x",
                     f"{med[name] / base_here:.2f}x", mem))
    print(f"model: Llama hidden {HIDDEN}, intermediate {INTERMEDIATE}, {LAYERS} layers, {ADAPTERS} adapters r={RANK} "
          f"on q/k/v/o/gate/up/down; batch {BATCH}x{SEQ} tokens, one adapter per sequence; median of "
          f"{args.rounds} processes x {args.steps} steps\n")
    print(markdown_table(["config", "ms / step", "range over rounds", "vs same kind on 1 dev",
                          "vs base on same devices", "adapter MiB per device / whole"], rows))


if __name__ == "__main__":
    main()
