"""The adapter pool's pure parts: slot planning (LRU, pinning, capacity) and the adapter source."""
import threading

import pytest
import torch

from xla_lora_pass.metadata.pool import SlotCapacityError, plan_slots
from xla_lora_pass.metadata.source import AdapterSource
from xla_lora_pass.errors import UnsupportedMappingError


def test_resident_adapters_are_hits_and_missing_ones_take_free_slots_first():
    plan = plan_slots(["a", None, "b", None], ["b", "c", "d"], last_used={"a": 0, "b": 1})
    assert plan.loads == (("c", 1), ("d", 3))
    assert plan.evictions == ()
    assert plan.hits == 1


def test_without_free_slots_the_least_recently_used_unneeded_adapter_goes():
    slots = ["a", "b", "c"]
    plan = plan_slots(slots, ["c", "x"], last_used={"a": 5, "b": 2, "c": 1})
    assert plan.loads == (("x", 1),)
    assert plan.evictions == ("b",)


def test_pinned_and_wanted_adapters_are_never_evicted():
    slots = ["a", "b", "c"]
    plan = plan_slots(slots, ["c", "x"], pinned={"b"}, last_used={"a": 5, "b": 0, "c": 1})
    assert plan.evictions == ("a",)
    assert plan.loads == (("x", 0),)


def test_a_mapping_needing_more_adapters_than_slots_is_refused_with_the_count():
    slots = ["a", "b"]
    with pytest.raises(SlotCapacityError, match=r"needs 3 adapters .* 2 slots: it needs 3 slots"):
        plan_slots(slots, ["x", "y", "z"])
    assert issubclass(SlotCapacityError, UnsupportedMappingError)


def test_pinned_slots_count_against_the_capacity_and_are_named():
    with pytest.raises(SlotCapacityError, match=r"1 of them kept by \['p'\] .*: it needs 3 slots"):
        plan_slots(["p", "a"], ["x", "y"], pinned={"p"})


def test_a_repeated_name_needs_one_slot():
    plan = plan_slots([None, None], ["x", "x", "y", "x"])
    assert plan.loads == (("x", 0), ("y", 1))


def _save_dir(path, scale=1.0):
    import json

    from safetensors.torch import save_file

    path.mkdir()
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "lora_alpha": 8, "r": 4}))
    save_file({"q.lora_A.weight": torch.full((4, 8), scale)}, str(path / "adapter_model.safetensors"))


class _Reads:
    """A validate function for AdapterSource that records which thread read which directory."""

    def __init__(self, wait=None):
        self.calls, self.wait = [], wait

    def __call__(self, name, path, scaling, config, where=None):
        from xla_lora_pass.metadata.host_stacks import LoadedAdapter
        from xla_lora_pass.adapters.formats.peft_dir import read_adapter_dir

        self.calls.append((name, threading.current_thread().name))
        if self.wait is not None:
            self.wait()
        state, _ = read_adapter_dir(name, path)
        return LoadedAdapter(name, {"q": (state["q.lora_A.weight"], state["q.lora_A.weight"].T)}, {})


def test_source_reads_a_directory_once_while_cached(tmp_path):
    _save_dir(tmp_path / "a")
    reads = _Reads()
    source = AdapterSource(reads, host_cache=1)
    source.add_dir("a", tmp_path / "a")
    loaded = source.get("a")
    assert source.get("a") is loaded
    assert [n for n, _ in reads.calls] == ["a"]
    assert torch.equal(loaded.weights["q"][0], torch.ones(4, 8))


def test_source_host_cache_keeps_only_the_most_recent_reads(tmp_path):
    for n in "abc":
        _save_dir(tmp_path / n)
    reads = _Reads()
    source = AdapterSource(reads, host_cache=2)
    for n in "abc":
        source.add_dir(n, tmp_path / n)
    for n in "abca":
        source.get(n)
    assert [n for n, _ in reads.calls] == ["a", "b", "c", "a"]  # a fell out when c was read


def test_source_host_cache_bytes_keeps_the_most_recent_reads_that_fit(tmp_path):
    for n in "abc":
        _save_dir(tmp_path / n)
    for bound, reread in ((600, []), (100, ["b"])):  # each read holds 256 bytes: 600 keep b and c, 100 none
        reads = _Reads()
        source = AdapterSource(reads, host_cache_bytes=bound)
        for n in "abc":
            source.add_dir(n, tmp_path / n)
        for n in "abcb":
            source.get(n)
        assert [n for n, _ in reads.calls] == ["a", "b", "c"] + reread, bound


def test_host_lru_bounds_count_and_bytes_least_recently_used_first():
    from xla_lora_pass.metadata.host_lru import HostLRU

    lru = HostLRU(max_items=3, max_bytes=100)
    for key, size in (("a", 40), ("b", 40), ("c", 10)):
        lru.put(key, key.upper(), size)
    assert lru.get("a") == "A" and len(lru) == 3 and lru.nbytes == 90
    lru.put("d", "D", 30)  # 120 bytes: b, the least recently used, goes
    assert "b" not in lru and lru.nbytes == 80 and lru.get("b") is None
    lru.put("e", "E", 1)  # 4 entries: c goes
    assert [k for k in "acde" if k in lru] == ["a", "d", "e"]
    lru.put("f", "F", 500)  # larger than the bound on its own: nothing is left
    assert len(lru) == 0 and lru.nbytes == 0
    floor = HostLRU(max_bytes=10, min_items=2)
    for key in "xyz":
        floor.put(key, key, 50)
    assert [k for k in "xyz" if k in floor] == ["y", "z"] and floor.nbytes == 100
    floor.put("y", "y2", 5)  # a put again replaces the entry and its bytes
    assert floor.get("y") == "y2" and floor.nbytes == 55
    floor.pop("y"), floor.pop("missing")
    assert floor.nbytes == 50
    floor.clear()
    assert len(floor) == 0 and floor.nbytes == 0


def test_kept_copies_are_returned_as_they_are_and_replace_a_directory(tmp_path):
    from xla_lora_pass.metadata.host_stacks import LoadedAdapter

    _save_dir(tmp_path / "a")
    reads = _Reads()
    source = AdapterSource(reads)
    source.add_dir("a", tmp_path / "a")
    kept = LoadedAdapter("a", {}, {})
    source.keep(kept)
    assert source.get("a") is kept and reads.calls == []
    source.forget_copies()
    assert "a" not in source


def test_prefetch_reads_on_another_thread_and_get_waits_for_it(tmp_path):
    _save_dir(tmp_path / "a", scale=2.0)
    started, release = threading.Event(), threading.Event()
    reads = _Reads(wait=lambda: (started.set(), release.wait(10)))
    source = AdapterSource(reads)
    source.add_dir("a", tmp_path / "a")
    source.prefetch(["a", "unknown"])
    assert started.wait(10)
    release.set()
    loaded = source.get("a")
    assert len(reads.calls) == 1 and reads.calls[0][1].startswith("xla-lora-prefetch")
    assert torch.equal(loaded.weights["q"][0], torch.full((4, 8), 2.0))


def test_source_refuses_what_it_cannot_read(tmp_path):
    source = AdapterSource(_Reads())
    with pytest.raises(FileNotFoundError, match="not a directory"):
        source.add_dir("a", tmp_path / "missing")
    with pytest.raises(KeyError, match="unknown adapter 'b'"):
        source.get("b")
