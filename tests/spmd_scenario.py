"""Issue 8 scenario on a 4-device PJRT CPU under SPMD; run in its own process by tests/test_spmd.py.

SPMD must be switched on before any XLA tensor exists, which the pytest
process (single-device runtime) cannot do, so this runs as
``python -m tests.spmd_scenario`` and prints one JSON object on its last
stdout line; the test checks every number in it.

Scenario: a tiny PEFT Llama with LoRA on q/k/v/o/gate/up/down, base weights
sharded Megatron-style over a (1, 4) mesh, the stacked adapter buffers
sharded by ``meta.shard(mesh)``, 3 adapters and the base model mixed per
token.  The reference is eager and unsharded on the host: the base model
plus each token's own adapter delta, added by hooks (PEFT itself can only mix
adapters per sequence, so a per-sequence PEFT run checks the hooks first).
"""
import os

os.environ["PJRT_DEVICE"] = "CPU"
os.environ.setdefault("CPU_NUM_DEVICES", "4")

import json  # noqa: E402
import sys  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch_xla  # noqa: E402
import torch_xla.debug.metrics as met  # noqa: E402
import torch_xla.runtime as xr  # noqa: E402

xr.use_spmd()

import torch_xla.distributed.spmd as xs  # noqa: E402

import xla_lora_pass as xlp  # noqa: E402
from xla_lora_pass.demo_models import (adapter_table, eager_reference, per_sequence_mapping, per_token_reference,
                                       tiny_peft_llama)
from xla_lora_pass.metadata.sharding import MEGATRON_LLAMA, AdapterSharding, megatron_shard_llama, shard_bytes

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ADAPTERS = ["sql", "chat", "code"]
BATCH, SEQ = 4, 6


def xla_compiles() -> int:
    data = met.metric_data("CompileTime")
    return 0 if data is None else int(data[0])


def main():
    out = {"devices": xr.global_runtime_device_count(), "spmd": xr.is_spmd()}
    torch.manual_seed(0)
    host_model, _ = tiny_peft_llama(targets=TARGETS)
    table = adapter_table(host_model)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 128, (BATCH, SEQ), generator=gen)
    ids_long = torch.randint(0, 128, (BATCH, 16), generator=gen)

    # The hook reference agrees with PEFT's own per-sequence mixing.
    rows = ["sql", "chat", "code", None]
    out["hook_vs_peft"] = (per_token_reference(host_model, ids, per_sequence_mapping(rows, SEQ), table)
                           - eager_reference(host_model, ids, rows)).abs().max().item()

    model, _ = tiny_peft_llama(targets=TARGETS)  # same seed: the same weights
    device = torch_xla.device()
    model.to(device)
    mesh = xs.Mesh(np.arange(4), (1, 4), ("data", "model"))
    base_layouts = megatron_shard_llama(model, mesh, "model")
    out["base_sharded"] = len(base_layouts)

    meta = xlp.LoRAMetadata(max_num_tokens=256, max_slots=4)
    meta.register_adapters(model)
    sharding = meta.shard(mesh)  # layouts read off the base weights' sharding specs
    out["layouts"] = sharding.layouts()
    out["layouts_match_megatron_rule"] = out["layouts"] == {s: MEGATRON_LLAMA[s.rsplit(".", 1)[-1]]
                                                              for s in meta.sites}
    # The explicit per-name rule gives the same layouts as reading the base weights.
    out["explicit_rule_same"] = AdapterSharding(meta, mesh, MEGATRON_LLAMA).layouts() == out["layouts"]
    backend = xlp.make_backend(meta, buckets=xlp.Buckets.pow2(min=8, max=16))
    compiled = torch.compile(model, backend=backend)
    # Bucketing as on one device: warm every bucket (first trace, size 1, 8, 16), then serve.
    out["precompiled"] = backend.precompile(lambda n: compiled(input_ids=ids_long[:, :n].to(device)),
                                            progress=False)

    def run(input_ids, mapping):
        meta.set_token_adapters(mapping)
        with torch.no_grad():
            got = compiled(input_ids=input_ids.to(device)).logits.cpu()
        want = per_token_reference(host_model, input_ids, mapping, table)
        return (got - want).abs().max().item()

    rng = np.random.default_rng(0)
    choices = ADAPTERS + [None]

    def mixed(n):  # 3 adapters and the base model, per token
        return [choices[i] for i in rng.integers(0, 4, n)]

    first = mixed(BATCH * SEQ)
    out["mixed_per_token_diff"] = run(ids, first)
    out["adapters_in_mixed"] = sorted({m for m in first if m is not None})
    out["rewrites"] = dict(meta.stats["rewrites"])

    # Serving sizes inside the warmed buckets: no new program; XLA compiles only the tiny
    # pad/slice programs of sizes not seen before (as on one device).
    before, before_meta = xla_compiles(), meta.stats["compiles"]
    sizes = (5, 11, 16, 8, 3)
    out["bucket_diffs"] = [run(ids_long[:, :n], mixed(BATCH * n)) for n in sizes]
    out["bucket_sizes"] = list(sizes)
    out["bucket_new_programs"] = meta.stats["compiles"] - before_meta
    out["bucket_xla_compiles"] = xla_compiles() - before
    out["bucket_hits"] = {str(k): v for k, v in meta.stats["bucket_hits"].items()}

    # Sharding specs of the buffers the compiled graph was fed (cached device copies).
    specs = {}
    for site in meta.sites:
        a, b = meta.stacked_weights(site, device)
        specs[site] = {"A": torch_xla._XLAC._get_xla_sharding_spec(a),
                       "B": torch_xla._XLAC._get_xla_sharding_spec(b),
                       "A_shape": list(a.shape), "B_shape": list(b.shape)}
    out["specs"] = specs
    fused = [k[0] for k in meta.device_copies() if isinstance(k[0], tuple)]
    out["fused_specs"] = {"+".join(k): torch_xla._XLAC._get_xla_sharding_spec(meta.stacked_weights(k, device)[0])
                          for k in fused}
    index_tensors = meta.step_tensors(device)
    out["index_specs"] = sorted({torch_xla._XLAC._get_xla_sharding_spec(t) for t in index_tensors})

    # Memory: bytes on one device of each site's stacked A and B, sharded vs whole; and of every
    # stacked buffer the graph takes (the fused q+k+v / gate+up A copies too).
    def per_device(tensors):
        pairs = [shard_bytes(t) for t in tensors]
        return sum(p for p, _ in pairs), sum(w for _, w in pairs)

    site_tensors = [t for site in meta.sites for t in meta.stacked_weights(site, device)]
    graph_tensors = {id(t): t for t in meta.device_copies().values()}
    sp, sw = per_device(site_tensors)
    gp, gw = per_device(graph_tensors.values())
    out["bytes"] = {"site_stacks_per_device": sp, "site_stacks_whole": sw,
                    "graph_inputs_per_device": gp, "graph_inputs_whole": gw}

    # Remap at a token shape already served: not one XLA compile.
    before = xla_compiles()
    out["remap_diff"] = run(ids, mixed(BATCH * SEQ))
    out["remap_rows_diff"] = run(ids, per_sequence_mapping(["code", None, "chat", "sql"], SEQ))
    out["remap_xla_compiles"] = xla_compiles() - before

    # Reload: a new adapter into the free slot on a column- and a row-parallel site, then remap.
    gen = torch.Generator().manual_seed(7)
    layer = "base_model.model.model.layers.1"
    fresh = {}
    for site, (i, o) in ((f"{layer}.self_attn.q_proj", (32, 32)), (f"{layer}.mlp.down_proj", (64, 32))):
        fresh[f"{site}.lora_A.weight"] = torch.randn(3, i, generator=gen)
        fresh[f"{site}.lora_B.weight"] = torch.randn(o, 3, generator=gen)
    before = xla_compiles()
    out["fresh_slot"] = meta.load_adapter("fresh", fresh, scaling=1.5)
    for site in (f"{layer}.self_attn.q_proj", f"{layer}.mlp.down_proj"):
        table[site]["fresh"] = (fresh[f"{site}.lora_A.weight"], fresh[f"{site}.lora_B.weight"], 1.5)
    with_fresh = [choices[i] if i < 4 else "fresh" for i in rng.integers(0, 5, BATCH * SEQ)]
    out["reload_diff"] = run(ids, with_fresh)
    out["reload_uses_fresh"] = with_fresh.count("fresh")
    out["reload_xla_compiles"] = xla_compiles() - before
    down = meta.stacked_weights(f"{layer}.mlp.down_proj", device)
    out["reload_specs"] = [torch_xla._XLAC._get_xla_sharding_spec(t) for t in down]
    out["compiles_total"] = meta.stats["compiles"]

    # both=True: every stack split (A of column sites on in, B of row sites on out), same results.
    meta.shard(mesh, both=True)
    out["both_diff"] = run(ids, mixed(BATCH * SEQ))
    both_specs = {site: [torch_xla._XLAC._get_xla_sharding_spec(t) for t in meta.stacked_weights(site, device)]
                  for site in meta.sites}
    out["both_all_split"] = all("devices=" in spec for specs_ in both_specs.values() for spec in specs_)
    bp, bw = per_device([t for site in meta.sites for t in meta.stacked_weights(site, device)])
    out["both_bytes"] = {"site_stacks_per_device": bp, "site_stacks_whole": bw}
    print(json.dumps(out))


if __name__ == "__main__":
    sys.exit(main())
