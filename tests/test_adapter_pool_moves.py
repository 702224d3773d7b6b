"""Every move of the adapter pool (a mapping, load_adapter, pin, prefetch, unload_adapter) spares the adapters that
may not leave their slot: a pin never lands on the current mapping's slots, and prefetch never re-reads a
resident adapter's directory."""
import copy

import numpy as np
import pytest
import torch

import xla_lora_pass as xlp
from xla_lora_pass.demo_models import eager_reference, tiny_peft_llama
from xla_lora_pass.metadata import host_stacks
from xla_lora_pass.metadata.pool import SlotCapacityError

ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A Llama serving only "sql" (rank 4), its eager twin holding "sql", "chat" (rank 2) and "code" (rank 8), and
    chat and code saved by PEFT."""
    model, _ = tiny_peft_llama(targets=ALL_LINEAR, adapters=(("sql", 4, 8), ("chat", 2, 3), ("code", 8, 5)))
    root = tmp_path_factory.mktemp("moves")
    model.save_pretrained(str(root), selected_adapters=["chat", "code"])  # root/chat, root/code
    reference = copy.deepcopy(model)
    model.delete_adapter("chat")
    model.delete_adapter("code")
    return dict(served=model, reference=reference, dirs={n: root / n for n in ("chat", "code")})


def _serving(saved, slots=2):
    meta = xlp.LoRAMetadata(max_num_tokens=64, max_slots=slots, max_rank=8)
    assert meta.register_adapters(saved["served"]) == ["sql"]
    for name, path in saved["dirs"].items():
        meta.add_adapter(name, path)
    return meta, torch.compile(saved["served"], backend=xlp.make_backend(meta, inner="aot_eager"))


def _error(saved, compiled, rows):
    ids = torch.randint(0, 128, (len(rows), 6), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        out = compiled(input_ids=ids).logits
    return (out - eager_reference(saved["reference"], ids, rows)).abs().max().item()


def test_pin_spares_the_adapters_the_current_mapping_uses(saved):
    """Two slots hold the mapping's sql and chat: pinning code is refused with nothing changed (before, code
    took sql's slot under the mapping and the next call was off by 0.5); once the mapping frees a slot, the pin
    goes there."""
    torch._dynamo.reset()
    meta, compiled = _serving(saved)
    meta.set_request_adapters(["sql", "chat"])
    assert _error(saved, compiled, ["sql", "chat"]) < 1e-4
    before = meta.stats
    with pytest.raises(SlotCapacityError, match=r"pin\('code'\): .* kept by \['chat', 'sql'\] \(used by the current "
                                                r"mapping\)"):
        meta.pin("code")
    assert meta.slots == ["sql", "chat"] and meta.request_adapters().tolist() == [0, 1]
    assert meta.stats["loads"] == before["loads"] and meta.stats["bytes_to_device"] == before["bytes_to_device"]
    assert _error(saved, compiled, ["sql", "chat"]) < 1e-4

    meta.set_request_adapters(["chat", None])
    meta.pin("code")  # sql is neither mapped nor pinned: code takes its slot
    assert meta.slots == ["code", "chat"]
    assert _error(saved, compiled, ["chat", None]) < 1e-4
    meta.set_request_adapters(["code", "sql"])  # code pinned, chat unused: sql (host copy) returns in chat's slot
    assert meta.slots == ["code", "sql"]
    assert _error(saved, compiled, ["code", "sql"]) < 1e-4


def test_unload_refuses_a_pinned_adapter_and_changes_nothing(saved):
    meta, _ = _serving(saved)
    meta.pin("code")
    meta.set_request_adapters([None])
    slots, stacks = meta.slots, {s: meta.host_stacks(s)[0].clone() for s in meta.sites}
    with pytest.raises(ValueError, match=r"unload_adapter\('code'\): .*pinned; unpin it first"):
        meta.unload_adapter("code")
    assert meta.slots == slots and all(torch.equal(meta.host_stacks(s)[0], a) for s, a in stacks.items())
    meta.unpin("code")
    assert meta.unload_adapter("code") == 1 and meta.slots == ["sql", None]


def test_prefetch_reads_no_directory_of_an_adapter_in_a_slot(saved, monkeypatch):
    meta, _ = _serving(saved, slots=3)
    meta.load_adapter("chat", saved["dirs"]["chat"])  # read once, for the load
    reads = []
    read = host_stacks.read_adapter_dir
    monkeypatch.setattr(host_stacks, "read_adapter_dir", lambda where, path: (reads.append(path), read(where, path))[1])
    meta.prefetch(["chat", "code"], wait=True)
    assert reads == [saved["dirs"]["code"]]  # chat is in a slot: nothing to read; code is not
    meta.set_request_adapters(["code", "chat"])  # code comes from the prefetched copy
    assert reads == [saved["dirs"]["code"]]


def test_add_adapter_under_a_name_in_a_slot_writes_the_new_definition_now(saved):
    """add_adapter("chat", code's directory) while chat sits in a slot under the mapping: the next call serves
    the new definition (before, the slot kept the old rows until an eviction)."""
    torch._dynamo.reset()
    meta, compiled = _serving(saved)
    meta.set_request_adapters(["sql", "chat"])
    assert _error(saved, compiled, ["sql", "chat"]) < 1e-4
    meta.add_adapter("chat", saved["dirs"]["code"])
    assert meta.slots == ["sql", "chat"]
    ids = torch.randint(0, 128, (2, 6), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        out = compiled(input_ids=ids).logits
    assert (out - eager_reference(saved["reference"], ids, ["sql", "code"])).abs().max().item() < 1e-4


def test_a_swap_back_from_the_host_cache_reads_and_prepares_nothing(saved, monkeypatch):
    """chat and code take turns in one slot: once each was read and swapped in, its next swap back reads no
    directory and prepares no rows (the host cache keeps both), and every call equals eager PEFT; with
    host_cache=0, or a host_cache_bytes too small for one adapter, each swap reads its directory again."""
    from xla_lora_pass.metadata import slot_swap

    torch._dynamo.reset()
    reads, stages = [], []
    read, stage = host_stacks.read_adapter_dir, slot_swap.SlotSwap.stage
    monkeypatch.setattr(host_stacks, "read_adapter_dir", lambda where, path: (reads.append(path), read(where, path))[1])
    monkeypatch.setattr(slot_swap.SlotSwap, "stage", lambda self, rows: (stages.append(1), stage(self, rows))[1])
    meta, compiled = _serving(saved)
    for rows in (["chat", "sql"], ["code", "sql"]) * 2:  # the first turn of each: read, and prepared for the graph
        meta.set_request_adapters(rows)
        assert _error(saved, compiled, rows) < 1e-4
    assert len(reads) == 2 and stages
    reads.clear(), stages.clear()
    for rows in (["chat", "sql"], ["code", "sql"], ["chat", "sql"]):
        meta.prefetch([rows[0]], wait=True)
        meta.set_request_adapters(rows)
        assert _error(saved, compiled, rows) < 1e-4
    assert meta.stats["evictions"] >= 5 and reads == [] and stages == []
    _assert_host_equals_device(meta)  # a swap leaves the host copy to be written when read: it is, here

    for bound in (dict(host_cache=0), dict(host_cache_bytes=1000)):  # fewer bytes than one adapter holds
        reads.clear()
        uncached = xlp.LoRAMetadata(max_num_tokens=64, max_slots=2, max_rank=8, **bound)
        uncached.register_adapters(saved["served"])
        for name, path in saved["dirs"].items():
            uncached.add_adapter(name, path)
        for rows in (["chat", "sql"], ["code", "sql"], ["chat", "sql"]):
            uncached.set_request_adapters(rows)
        assert reads == [saved["dirs"]["chat"], saved["dirs"]["code"], saved["dirs"]["chat"]], bound


@pytest.mark.parametrize("key", ["host_cache", "host_cache_bytes"])
@pytest.mark.parametrize("bad", [-1, 1.5, True, "8"])
def test_host_cache_bounds_must_be_counts(key, bad):
    with pytest.raises(ValueError, match=f"{key} must be None \\(no bound\\) or an int >= 0"):
        xlp.LoRAMetadata(max_num_tokens=64, **{key: bad})
    xlp.LoRAMetadata(max_num_tokens=64, **{key: None})  # None: no bound
    xlp.LoRAMetadata(max_num_tokens=64, **{key: np.int64(8)})  # any integer type


def test_a_state_dict_added_is_served_as_it_was_when_added(saved):
    """The caller's tensors change in place after add_adapter(name, state): the adapter still swaps back in as
    added, and the host stacks equal the device's (before, the kept copy shared the caller's lora_A tensors, so the
    host stacks took the change while the swap prepared earlier sent the old rows)."""
    from peft import LoraConfig
    from safetensors.torch import load_file

    torch._dynamo.reset()
    meta, compiled = _serving(saved)
    state = load_file(str(saved["dirs"]["chat"] / "adapter_model.safetensors"))
    meta.add_adapter("chat", state, config=LoraConfig.from_pretrained(str(saved["dirs"]["chat"])))
    for rows in (["chat", "sql"], ["code", "sql"]):  # chat in (its swap prepared), then out
        meta.set_request_adapters(rows)
        assert _error(saved, compiled, rows) < 1e-4
    with torch.no_grad():
        for tensor in state.values():
            tensor.mul_(3.0)
    meta.set_request_adapters(["chat", "sql"])
    assert _error(saved, compiled, ["chat", "sql"]) < 1e-4
    _assert_host_equals_device(meta)


def _assert_host_equals_device(meta):
    """Every device stack equals the host stack it was made from (host stacks written after swaps)."""
    for (site, role, _), copy_ in meta.device_copies().items():
        names = site if isinstance(site, tuple) else (site,)
        host = (torch.cat([meta.host_stacks(n)[0] for n in names], 1) if role.startswith("A")
                else meta.host_stacks(site)[1])
        assert torch.equal(copy_, host.transpose(1, 2) if role.endswith("_T") else host), (site, role)
