"""The adapter pool's pure parts: slot planning (LRU, pinning, capacity) and the adapter source."""
import threading

import pytest
import torch

from xla_lora_pass.adapter_pool import AdapterSource, SlotCapacityError, plan_slots
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
    with pytest.raises(SlotCapacityError, match=r"uses 3 adapters .* 2 slots: it needs 3 slots"):
        plan_slots(slots, ["x", "y", "z"])
    assert issubclass(SlotCapacityError, UnsupportedMappingError)


def test_pinned_slots_count_against_the_capacity_and_are_named():
    with pytest.raises(SlotCapacityError, match=r"1 of them pinned by \['p'\]: it needs 3 slots"):
        plan_slots(["p", "a"], ["x", "y"], pinned={"p"})


def test_a_repeated_name_needs_one_slot():
    plan = plan_slots([None, None], ["x", "x", "y", "x"])
    assert plan.loads == (("x", 0), ("y", 1))


def _save_state(path, scale=1.0):
    from safetensors.torch import save_file
    import json

    path.mkdir()
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "lora_alpha": 8, "r": 4}))
    save_file({"base_model.model.q.lora_A.weight": torch.full((4, 8), scale),
               "base_model.model.q.lora_B.weight": torch.full((8, 4), scale)},
              str(path / "adapter_model.safetensors"))


def test_source_reads_a_directory_once_while_cached(tmp_path, monkeypatch):
    import xla_lora_pass.adapter_pool as pool

    _save_state(tmp_path / "a")
    reads = []
    real = pool.read_adapter_dir
    monkeypatch.setattr(pool, "read_adapter_dir", lambda where, p: reads.append(p) or real(where, p))
    source = AdapterSource(host_cache=1)
    source.add("a", tmp_path / "a")
    state, config, scaling = source.read("a")
    source.read("a")
    assert len(reads) == 1
    assert config.lora_alpha == 8 and scaling is None
    assert torch.equal(state["base_model.model.q.lora_A.weight"], torch.ones(4, 8))


def test_source_host_cache_keeps_only_the_most_recent_reads(tmp_path, monkeypatch):
    import xla_lora_pass.adapter_pool as pool

    for n in "abc":
        _save_state(tmp_path / n)
    reads = []
    real = pool.read_adapter_dir
    monkeypatch.setattr(pool, "read_adapter_dir", lambda where, p: reads.append(str(p)[-1]) or real(where, p))
    source = AdapterSource(host_cache=2)
    for n in "abc":
        source.add(n, tmp_path / n)
    for n in "abca":
        source.read(n)
    assert reads == ["a", "b", "c", "a"]  # a fell out when c was read


def test_prefetch_reads_on_another_thread_and_read_waits_for_it(tmp_path, monkeypatch):
    import xla_lora_pass.adapter_pool as pool

    _save_state(tmp_path / "a", scale=2.0)
    started, release, threads = threading.Event(), threading.Event(), []
    real = pool.read_adapter_dir

    def slow_read(where, p):
        threads.append(threading.current_thread().name)
        started.set()
        release.wait(10)
        return real(where, p)

    monkeypatch.setattr(pool, "read_adapter_dir", slow_read)
    source = AdapterSource()
    source.add("a", tmp_path / "a")
    source.prefetch(["a", "unknown"])
    assert started.wait(10)
    release.set()
    state, _, _ = source.read("a")
    assert threads == [threads[0]] and threads[0].startswith("xla-lora-prefetch")
    assert torch.equal(state["base_model.model.q.lora_B.weight"], torch.full((8, 4), 2.0))


def test_source_refuses_what_it_cannot_read(tmp_path):
    source = AdapterSource()
    with pytest.raises(FileNotFoundError, match="not a directory"):
        source.add("a", tmp_path / "missing")
    with pytest.raises(TypeError, match="directory or a state dict"):
        source.add("a", 3)
    with pytest.raises(KeyError, match="unknown adapter 'b'"):
        source.read("b")
