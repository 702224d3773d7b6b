"""Adapters of ranks 2, 4 and 8 through a few slots on XLA: every batch exact against PEFT, nothing compiled after
warm-up, and each swap sends the adapter's own rows (a rank-2 adapter at a site of rank 8: 2 rows, not 8)."""
import collections
import copy

import pytest
import torch

import xla_lora_pass as xlp
from xla_lora_pass.demo_models import tiny_peft_llama

from .test_adapter_pool import ALL_LINEAR, pool_reference, zipf_rows
from .xla_utils import xla_compiles

NUM_ADAPTERS, SLOTS, ROWS, STREAM = 48, 4, 4, 60
RANKS = (8, 2, 4)  # adapter i has rank RANKS[i % 3]; ad000, the model's own, makes every site's stacked rank 8


@pytest.fixture(scope="module")
def ranked(tmp_path_factory):
    """48 adapters saved with PEFT's save_pretrained (ranks 8, 2, 4 in turn, random weights, alphas differing
    across neighbours), the Llama to serve holding only ad000, its eager twin, and each rank's own bytes."""
    served, _ = tiny_peft_llama(targets=ALL_LINEAR, adapters=(("ad000", 8, 16),))
    root = tmp_path_factory.mktemp("ranked")
    served.save_pretrained(str(root), selected_adapters=["ad000"])
    names = [f"ad{i:03d}" for i in range(NUM_ADAPTERS)]
    gen = torch.Generator().manual_seed(0)
    own_bytes = {}
    for rank in RANKS:
        template, _ = tiny_peft_llama(targets=ALL_LINEAR, adapters=(("default", rank, 2 * rank),))
        lora = [p for n, p in template.named_parameters() if ".lora_A." in n or ".lora_B." in n]
        own_bytes[rank] = sum(p.numel() * p.element_size() for p in lora)
        for i in range(1, NUM_ADAPTERS):  # ad000 is the served model's own
            if RANKS[i % 3] != rank:
                continue
            with torch.no_grad():
                for p in lora:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
            template.peft_config["default"].lora_alpha = 2 + i % 7
            template.save_pretrained(str(root / names[i]))
    return dict(served=served, reference=copy.deepcopy(served), dirs={n: root / n for n in names}, names=names,
                rank={n: RANKS[i % 3] for i, n in enumerate(names)}, own_bytes=own_bytes)


def _outbound() -> float:
    import torch_xla.debug.metrics as met

    data = met.metric_data("OutboundData")
    return data[1] if data else 0.0


def test_a_zipf_stream_of_ranks_2_4_8_sends_each_adapters_own_bytes(ranked, xla_device):
    torch._dynamo.reset()
    served = ranked["served"].to(xla_device)
    meta = xlp.LoRAMetadata(max_num_tokens=64, max_slots=SLOTS)
    assert meta.register_adapters(served) == ["ad000"]
    assert {meta.site_rank(s) for s in meta.sites} == {8}
    for name in ranked["names"][1:]:
        meta.add_adapter(name, ranked["dirs"][name])
    compiled = torch.compile(served, backend=xlp.make_backend(meta))
    meta.set_request_adapters(["ad000"] * ROWS)
    # Warm-up: one call per prompt length the stream uses, each its own program; the first length again, as
    # its first call ran Dynamo's static trace and the later ones run the dynamic graph.
    for seq in (5, 6, 7, 8, 5):
        with torch.no_grad():
            compiled(input_ids=torch.zeros(ROWS, seq, dtype=torch.long, device=xla_device)).logits.cpu()
    warm = xla_compiles()
    gen = torch.Generator().manual_seed(0)
    worst, compiles, swaps, ratios = 0.0, [], [], collections.defaultdict(list)  # ratios: swaps of one rank
    for step in range(STREAM):
        rows = zipf_rows(gen, ranked["names"], ROWS)
        if step % 5 == 0:
            rows[1] = None
        ids = torch.randint(0, 128, (ROWS, int(torch.randint(5, 9, (1,), generator=gen))), generator=gen)
        slots, counted, sent = meta.slots, meta.stats["bytes_to_device"], _outbound()
        meta.set_request_adapters(rows)
        loaded = [n for n in meta.slots if n is not None and n not in slots]
        own = sum(ranked["own_bytes"][ranked["rank"][n]] for n in loaded)
        if loaded:
            assert meta.stats["bytes_to_device"] - counted == own, (step, loaded)
            swaps.append((_outbound() - sent) / own)
            ranks = {ranked["rank"][n] for n in loaded}
            if len(ranks) == 1:
                ratios[ranks.pop()].append(swaps[-1])
        with torch.no_grad():
            out = compiled(input_ids=ids.to(xla_device)).logits.cpu()
        worst = max(worst, (out - pool_reference(ranked, ids, rows)).abs().max().item())
        compiles.append(xla_compiles())
    served.cpu()
    assert worst < 1e-4
    assert compiles == [warm] * STREAM, (warm, compiles)
    assert set(ratios) == set(RANKS), dict(ratios)  # each rank swapped in alone at least once
    assert max(swaps) <= 1.1, (swaps, dict(ratios))
    stats = meta.stats
    by_rank = ", ".join(f"{r}: {min(v):.3f}-{max(v):.3f} ({len(v)} swaps)" for r, v in sorted(ratios.items()))
    print(f"\n{STREAM} batches: max abs error {worst:.2e}, loads {stats['loads']}, evictions {stats['evictions']}, "
          f"XLA compiles {warm} after warm-up, {compiles[-1]} at the end; sent / own bytes per swap "
          f"{min(swaps):.3f}-{max(swaps):.3f}, by rank {by_rank}")


def _check_copies(meta):
    """Every device copy (plain, transposed, a fused group's A) equals what the host stacks hold."""
    for (site, role, _), copy_ in meta.device_copies().items():
        names = site if isinstance(site, tuple) else (site,)
        if role in ("dora", "bias"):
            continue  # checked by the DoRA test below
        host = (torch.cat([meta.host_stacks(n)[0] for n in names], 1) if role.startswith("A")
                else meta.host_stacks(site)[1])
        assert torch.equal(copy_.cpu(), host.transpose(1, 2) if role.endswith("_T") else host), (site, role)


def test_every_device_copy_equals_the_host_after_swaps_of_any_rank(ranked, xla_device):
    """Ranks 2, 4, 8, then 2 over a 4 and unloads (all zeros): plain and transposed copies and a fused group's
    concatenated A stay equal to the host stacks; each swap sends the adapter's own bytes (and its q, k, v rows
    of A once more, for the fused group's own stack); nothing compiles."""
    served, _ = tiny_peft_llama(targets=ALL_LINEAR, adapters=(("ad000", 8, 16),))
    meta = xlp.LoRAMetadata(max_num_tokens=16, max_slots=2)
    meta.register_adapters(served)
    qkv = tuple(s for s in meta.sites if ".layers.0.self_attn." in s and s.split(".")[-1] in ("q_proj", "k_proj",
                                                                                                "v_proj"))
    assert len(qkv) == 3
    for transposed in (False, True):
        meta.stacked_a(qkv, xla_device, transposed=transposed)
        for site in meta.sites:
            meta.stacked_a(site, xla_device, transposed=transposed)
            meta.stacked_b(site, xla_device, transposed=transposed)
    _check_copies(meta)
    compiles = xla_compiles()
    for name in ("ad001", "ad002", "ad003", "ad004"):  # ranks 2, 4, 8, 2: slots 1, 0, 1, 0
        before = meta.stats["bytes_to_device"]
        meta.load_adapter(name, ranked["dirs"][name])
        rank = ranked["rank"][name]
        fused = sum(rank * meta.host_stacks(s)[0].shape[2] * 4 for s in qkv)
        assert meta.stats["bytes_to_device"] - before == ranked["own_bytes"][rank] + fused, name
        _check_copies(meta)
    before = meta.stats["bytes_to_device"]
    meta.unload_adapter("ad003")
    meta.unload_adapter("ad004")
    assert meta.slots == [None, None] and meta.stats["bytes_to_device"] == before  # zeros made on the device
    _check_copies(meta)
    assert xla_compiles() == compiles


def test_dora_rows_are_sent_whole_or_made_zero_on_the_device(tmp_path, xla_device):
    """A DoRA adapter's [2, out] rows cross whole; a plain adapter's zero rows and an unload send nothing."""
    from peft import LoraConfig

    from .test_dora import perturb_magnitudes

    model, _ = tiny_peft_llama(num_hidden_layers=1, adapters=(("plain", 2, 4),))
    dora = LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"], use_dora=True, init_lora_weights=False)
    model.add_adapter("dora", dora)
    perturb_magnitudes(model)
    model.save_pretrained(str(tmp_path), selected_adapters=["plain", "dora"])
    meta = xlp.LoRAMetadata(max_num_tokens=16, max_slots=2)
    assert meta.register_adapters(model) == ["plain", "dora"]
    copies = {site: meta.stacked_dora(site, xla_device) for site in meta.sites}
    compiles, before = xla_compiles(), meta.stats["bytes_to_device"]
    meta.unload_adapter("plain")
    meta.unload_adapter("dora")
    assert meta.stats["bytes_to_device"] == before
    for name, slot in (("dora", 0), ("plain", 1)):  # each into the other's old slot
        before = meta.stats["bytes_to_device"]
        assert meta.load_adapter(name, tmp_path / name) == slot
        dora_rows = sum(2 * s.out_features * 4 for s in meta.sites.values())  # the only device copies, fp32
        assert meta.stats["bytes_to_device"] - before == (dora_rows if name == "dora" else 0), name
    for site, copy_ in copies.items():
        host = meta.stacked_dora(site, "cpu")
        assert copy_ is meta.stacked_dora(site, xla_device) and torch.equal(copy_.cpu(), host), site
        assert host[0].abs().sum() > 0 and host[1].abs().sum() == 0  # dora now in slot 0, plain in slot 1
    assert xla_compiles() == compiles
