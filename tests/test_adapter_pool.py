"""256 saved PEFT adapters served through 8 slots: exact, no compile after warm-up, one adapter's bytes a swap."""
import copy

import pytest
import torch

import xla_lora_pass as xlp
from xla_lora_pass.metadata.pool import SlotCapacityError
from xla_lora_pass.demo_models import eager_reference, tiny_peft_llama

from .xla_utils import device_compiles

NUM_ADAPTERS, SLOTS, ROWS, STREAM = 256, 8, 4, 200
ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    """256 adapters saved with PEFT's save_pretrained, a Llama to serve holding only the first, and the eager
    reference: PEFT's own mixed batch on a copy that loads each batch's adapters from their directories."""
    served, _ = tiny_peft_llama(targets=ALL_LINEAR, adapters=(("ad000", 4, 8),))
    template, _ = tiny_peft_llama(targets=ALL_LINEAR, adapters=(("default", 4, 8),))
    root = tmp_path_factory.mktemp("adapters")
    names = [f"ad{i:03d}" for i in range(NUM_ADAPTERS)]
    served.save_pretrained(str(root), selected_adapters=["ad000"])  # into root/ad000
    gen = torch.Generator().manual_seed(0)
    lora = [p for n, p in template.named_parameters() if ".lora_A." in n or ".lora_B." in n]
    for i, name in enumerate(names[1:], start=1):
        with torch.no_grad():
            for p in lora:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
        # Every scaling differs across neighbours (alpha), so a slot mixing up two adapters would show.
        template.peft_config["default"].lora_alpha = 4 + i % 7
        template.save_pretrained(str(root / name))
    return dict(served=served, reference=copy.deepcopy(served), dirs={n: root / n for n in names}, names=names,
                adapter_bytes=sum(p.numel() * p.element_size() for p in lora))


def pool_reference(pool, ids, rows, keep=32):
    """PEFT's own mixed batch, on a copy that loads each batch's adapters from their directories with
    PeftModel.load_adapter (keeping the ``keep`` most recently used, so the popular ones load once)."""
    model, recent = pool["reference"], pool.setdefault("recent", [])
    for name in dict.fromkeys(r for r in rows if r is not None):
        if name not in model.peft_config:
            model.load_adapter(str(pool["dirs"][name]), adapter_name=name)
        if name in recent:
            recent.remove(name)
        recent.append(name)
    for name in [n for n in recent[:-keep] if n not in rows and n != "ad000"]:
        model.delete_adapter(name)
        recent.remove(name)
    return eager_reference(model, ids, rows)


def zipf_rows(gen, names, k):
    """``k`` rows over ``names`` with Zipf(1.1) popularity (the head adapters recur, the tail swaps)."""
    weights = torch.tensor([1.0 / (i + 1) ** 1.1 for i in range(len(names))])
    picks = torch.multinomial(weights, k, replacement=True, generator=gen).tolist()
    return [names[i] for i in picks]


def _outbound(device):
    """Bytes torch_xla has sent to the device so far (None off XLA, where no transfer is counted)."""
    if device.type != "xla":
        return None
    import torch_xla.debug.metrics as met

    data = met.metric_data("OutboundData")
    return data[1] if data else 0.0


def test_a_zipf_stream_over_256_adapters_through_8_slots(pool, device, inner):
    torch._dynamo.reset()
    served = pool["served"].to(device)
    meta = xlp.LoRAMetadata(max_num_tokens=64, max_slots=SLOTS)
    assert meta.register_adapters(served) == ["ad000"]
    for name in pool["names"][1:]:  # ad000 stays the model's own: an eviction keeps a host copy of it
        meta.add_adapter(name, pool["dirs"][name])
    compiled = torch.compile(served, backend=xlp.make_backend(meta, inner=inner))
    gen = torch.Generator().manual_seed(0)
    one_adapter = pool["adapter_bytes"]
    worst, compiles_after_warmup, swap_ratios = 0.0, None, []
    for step in range(STREAM):
        rows = zipf_rows(gen, pool["names"], ROWS)
        if step % 5 == 0:
            rows[1] = None  # some rows on the base model
        seq = int(torch.randint(5, 9, (1,), generator=gen))  # one bucket (8): no new program
        ids = torch.randint(0, 128, (ROWS, seq), generator=gen)
        before = meta.stats
        sent = _outbound(device)
        meta.set_request_adapters(rows)
        loads = meta.stats["loads"] - before["loads"]
        if loads and step > 0:  # from the second step: the first call sends every stack whole
            if sent is not None:  # what XLA really sent, beside what the pool says it sent
                swap_ratios.append((_outbound(device) - sent) / (loads * one_adapter))
            assert meta.stats["bytes_to_device"] - before["bytes_to_device"] == loads * one_adapter
        with torch.no_grad():
            out = compiled(input_ids=ids.to(device)).logits.cpu()
        worst = max(worst, (out - pool_reference(pool, ids, rows)).abs().max().item())
        if step == 9:
            compiles_after_warmup = device_compiles(device, meta)
    assert worst < 1e-4
    assert device_compiles(device, meta) == compiles_after_warmup
    stats = meta.stats
    assert stats["evictions"] > 50 and stats["slot_hits"] > 50
    assert device.type != "xla" or max(swap_ratios) <= 1.1, swap_ratios
    print(f"\n{STREAM} batches: max abs error {worst:.2e}, loads {stats['loads']}, evictions {stats['evictions']}, "
          f"hits {stats['slot_hits']}, swap bytes / adapter bytes max {max(swap_ratios, default=0.0):.3f}")

    # Nine adapters on eight slots: refused before any slot changes; the next good batch compiles nothing.
    slots_before = meta.slots
    with pytest.raises(SlotCapacityError, match=r"needs 9 adapters .* it needs 9 slots"):
        meta.set_request_adapters(pool["names"][100:109])
    assert meta.slots == slots_before
    compiles = device_compiles(device, meta)
    rows = pool["names"][200:204]
    ids = torch.randint(0, 128, (ROWS, 8), generator=gen)
    meta.set_request_adapters(rows)
    with torch.no_grad():
        out = compiled(input_ids=ids.to(device)).logits.cpu()
    assert (out - pool_reference(pool, ids, rows)).abs().max().item() < 1e-4
    assert device_compiles(device, meta) == compiles
    served.cpu()


def test_pinned_and_unloaded_adapters(pool):
    """Eager CPU: a pinned adapter survives a stream that would evict it; an unloaded one comes back exact."""
    torch._dynamo.reset()
    served, _ = tiny_peft_llama(targets=ALL_LINEAR, adapters=(("ad000", 4, 8),))  # the served model's twin
    meta = xlp.LoRAMetadata(max_num_tokens=64, max_slots=2)
    meta.register_adapters(served)
    for name in ("ad001", "ad002", "ad003"):
        meta.add_adapter(name, pool["dirs"][name])
    meta.pin("ad000")
    meta.set_request_adapters(["ad001"])
    meta.set_request_adapters(["ad002"])
    assert meta.slots == ["ad000", "ad002"]
    with pytest.raises(SlotCapacityError, match=r"kept by \['ad000'\]"):
        meta.set_request_adapters(["ad001", "ad003"])
    with pytest.raises(ValueError, match="the current mapping uses it"):
        meta.unload_adapter("ad002")
    meta.set_request_adapters([None])
    assert meta.unload_adapter("ad002") == 1 and meta.slots == ["ad000", None]
    assert float(meta.host_stacks(next(iter(meta.sites)))[0][1].abs().sum()) == 0.0
    meta.unpin("ad000")
    meta.set_request_adapters(["ad003", "ad002"])  # ad000 (the model's own) is evicted and kept as a host copy
    meta.set_request_adapters(["ad000", "ad002"])
    compiled = torch.compile(served, backend=xlp.make_backend(meta, inner="aot_eager"))
    ids = torch.randint(0, 128, (2, 6), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = compiled(input_ids=ids).logits
    assert (out - pool_reference(pool, ids, ["ad000", "ad002"])).abs().max().item() < 1e-4


def test_a_refused_mapping_never_leaves_the_old_one_on_swapped_slots(pool):
    """A bad entry is refused before any swap (old mapping and slots kept); a mapping refused after its
    swaps (too many rows) drops the old mapping, whose slot numbers may now mean other adapters."""
    served, _ = tiny_peft_llama(targets=ALL_LINEAR, adapters=(("ad000", 4, 8),))
    meta = xlp.LoRAMetadata(max_num_tokens=4, max_slots=2)
    meta.register_adapters(served)
    for name in ("ad001", "ad002", "ad003"):
        meta.add_adapter(name, pool["dirs"][name])
    meta.set_request_adapters(["ad000", "ad001"])
    with pytest.raises(TypeError, match="row 2: expected str, int or None"):
        meta.set_request_adapters(["ad002", "ad003", 1.5])
    assert meta.slots == ["ad000", "ad001"] and meta.request_adapters().tolist() == [0, 1]
    with pytest.raises(ValueError, match="5 rows exceed max_num_tokens=4"):
        meta.set_request_adapters(["ad002", "ad003", None, None, None])
    assert meta.slots == ["ad002", "ad003"] and not meta.has_mapping
