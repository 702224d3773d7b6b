"""The parts behind the LoRAMetadata facade: the step cache, stats, the lock, fused sites."""
import threading

import pytest
import torch

import xla_lora_pass as xlp
from xla_lora_pass.kernels import table as kernels
from xla_lora_pass.demo_models import tiny_peft_llama
from xla_lora_pass.adapters.records import AdapterWeights
from xla_lora_pass.metadata.slot_weights import host_slot_weights
from xla_lora_pass.metadata.stats import Stats
from xla_lora_pass.metadata.token_mapping import StepCache

Q0 = "base_model.model.model.layers.0.self_attn.q_proj"
V0 = Q0.replace("q_proj", "v_proj")


@pytest.fixture(scope="module")
def model():
    return tiny_peft_llama()[0]


@pytest.fixture
def meta(model):
    m = xlp.LoRAMetadata(max_num_tokens=64, max_slots=4)
    m.register_adapters(model)
    return m


def test_step_cache_builds_once_per_key_and_caches_no_failed_build():
    cache, calls = StepCache(), []

    def build(value):
        calls.append(value)
        return value

    assert cache.get("a", lambda: build(1)) == 1 and cache.get("a", lambda: build(2)) == 1
    assert cache.get("none", lambda: build(None)) is None and cache.get("none", lambda: build(3)) is None
    assert calls == [1, None]  # a cached None is a value, not a miss

    def fail():
        raise ValueError("no")
    with pytest.raises(ValueError):
        cache.get("b", fail)
    assert len(cache) == 2 and cache.get("b", lambda: 4) == 4
    pair = (torch.zeros(1), torch.ones(2))
    cache.get("pair", lambda: pair)
    assert [t.shape for t in cache.tensors()] == [torch.Size([1]), torch.Size([2])]
    cache.clear()
    assert len(cache) == 0 and cache.get("a", lambda: build(5)) == 5


def test_step_values_are_built_once_per_mapping_and_bucket(meta):
    meta.set_token_adapters(["sql", "chat"] * 4)  # 2 rows x 4 tokens
    idx = meta.token_indices("cpu", (2, 4), (2, 4))
    assert meta.token_indices("cpu", (2, 4), (2, 4)) is idx
    other_bucket = meta.token_indices("cpu", (2, 4), (4, 8))
    assert other_bucket is not idx and other_bucket[:8].tolist() == [0, 1, 0, 1, -1, -1, -1, -1]
    assert [id(t) for t in meta.step_tensors("cpu")] == [id(idx), id(other_bucket)]


def test_segment_layout_is_built_once_for_fit_and_layout(meta, monkeypatch):
    calls = []
    real = kernels.build_segment_layout

    def counting(*args):
        calls.append(args[1:])
        return real(*args)
    monkeypatch.setattr(kernels, "build_segment_layout", counting)
    meta.set_token_adapters(["sql"] * 8 + ["chat"] * 8)
    assert kernels.segments_fit(meta, (16,), (16,), 8, 1)
    kernels.segment_inputs(meta, "cpu", (16,), (16,), 8, 1)
    kernels.segment_inputs(meta, "cpu", (16,), (16,), 8, 1)
    assert calls == [(8, 1)]
    assert kernels.segments_fit(meta, (16,), (16,), 4, 1)  # another block shape: built again
    assert calls == [(8, 1), (4, 1)]


def test_a_new_mapping_drops_every_step_value(meta):
    meta.set_token_adapters(["sql"] * 4)
    old = meta.token_indices("cpu", (1, 4), (1, 4))
    assert meta.rows_uniform((2, 2))
    meta.set_token_adapters(["sql", "chat"] * 2)
    assert meta.token_indices("cpu", (1, 4), (1, 4))[:4].tolist() == [0, 1, 0, 1] and old[:4].tolist() == [0] * 4
    assert not meta.rows_uniform((2, 2))  # not the cached answer of the old mapping
    meta.set_request_adapters(["chat"])
    assert meta.token_indices("cpu", (1, 4), (1, 4))[:4].tolist() == [1] * 4


def test_new_slots_drop_the_mapping_and_its_step_values(model, meta):
    meta.set_token_adapters(["code"] * 4)
    meta.token_indices("cpu", (4,), (4,))
    meta.register_adapters(model)  # slot numbers may now mean other adapters
    assert not meta.has_mapping and meta.step_tensors("cpu") == []
    assert meta.token_indices("cpu", (4,), (4,))[:4].tolist() == [-1] * 4


def test_warm_up_sees_the_base_model_and_its_values_go_on_exit(meta):
    meta.set_token_adapters(["sql", "chat"] * 2)
    before = meta.token_indices("cpu", (2, 2), (2, 2))
    with meta.warming_up():
        assert meta.is_warming_up and not meta.has_mapping
        warm = meta.token_indices("cpu", (2, 2), (2, 2))
        assert warm is not before and warm[:4].tolist() == [-1] * 4
        meta.row_slots("cpu", (2, 2), (2, 2))  # a mixed row is not refused while warming up
    assert not meta.is_warming_up and meta.mapping().tolist() == [0, 1, 0, 1]
    assert meta.token_indices("cpu", (2, 2), (2, 2))[:4].tolist() == [0, 1, 0, 1]


def test_graph_inputs_look_stacks_up_once_per_generation_and_step_values_every_call(model, meta, monkeypatch):
    from graph_rewrites.annotations import ROW_SLOTS, STACKED_A_T, STACKED_B_T, GraphInputRequest

    requests = [GraphInputRequest(STACKED_A_T, Q0), GraphInputRequest(ROW_SLOTS),
                GraphInputRequest(STACKED_B_T, Q0)]
    inputs = kernels.GraphInputs(requests)
    lookups = []
    real = meta.stacked_a

    def counting(*args, **kwargs):
        lookups.append(args)
        return real(*args, **kwargs)
    monkeypatch.setattr(meta, "stacked_a", counting)
    meta.set_request_adapters(["sql", "chat"])
    first = inputs(meta, "cpu", (2, 4), (2, 4))
    meta.set_request_adapters(["chat", None])
    second = inputs(meta, "cpu", (2, 4), (2, 4))
    assert len(lookups) == 1 and second[0] is first[0] and second[2] is first[2]
    assert first[1][:2].tolist() == [0, 1] and second[1][:2].tolist() == [1, -1]  # the row slots: every call
    assert all(t is w for t, w in zip(second, kernels.lora_graph_inputs(meta, requests, "cpu", (2, 4), (2, 4))))
    lookups.clear()
    meta.register_adapters(model)  # stacks made anew: the next call looks them up again
    meta.set_request_adapters(["sql", "chat"])
    third = inputs(meta, "cpu", (2, 4), (2, 4))
    assert len(lookups) == 1 and third[0] is not first[0] and third[0] is meta.stacked_a(Q0, "cpu", transposed=True)


def test_the_mapping_check_is_cached_per_mapping_and_still_refuses(meta):
    from xla_lora_pass.errors import UnsupportedMappingError

    meta.set_request_adapters(["sql", "chat"])
    meta.check_mapping_fits((2, 4))
    meta.check_mapping_fits((2, 4))
    with pytest.raises(UnsupportedMappingError, match="2 rows but this call has a batch of 3"):
        meta.check_mapping_fits((3, 1))
    with pytest.raises(UnsupportedMappingError, match="2 rows but this call has a batch of 3"):
        meta.check_mapping_fits((3, 1))  # a refusal is not cached as a pass
    meta.set_request_adapters(["sql", "chat", None])
    meta.check_mapping_fits((3, 1))
    with pytest.raises(UnsupportedMappingError, match="3 rows but this call has a batch of 2"):
        meta.check_mapping_fits((2, 4))  # the old mapping's pass went with it


def test_slot_weights_refuse_every_non_finite_value_and_only_those():
    """The check reduces each tensor to its float64 sum: NaN, inf and inf - inf are refused with their count; a
    finite float64 tensor whose sum overflows is not."""
    a, b = torch.ones(2, 4, dtype=torch.float64), torch.ones(3, 2, dtype=torch.float64)
    huge = torch.full((2, 4), 1e308, dtype=torch.float64)  # its sum is inf, every value finite
    got_a, got_b = host_slot_weights("w", AdapterWeights(huge, b, 2.0), torch.float64)
    assert torch.equal(got_a, huge) and torch.equal(got_b, 2 * b)
    for bad_a, bad_b, what, count in [(a.index_fill(1, torch.tensor([0, 3]), float("inf")), b, "lora_A", 4),
                                      (torch.tensor([[float("inf"), -float("inf"), 0, 0]] * 2).double(), b,
                                       "lora_A", 4),
                                      (a, b.index_fill(0, torch.tensor([1]), float("nan")), r"lora_B \* scaling", 2)]:
        with pytest.raises(ValueError, match=rf"w: {what}.* has {count} NaN or inf value"):
            host_slot_weights("w", AdapterWeights(bad_a, bad_b, 1.0), torch.float64)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):  # the stack dtype: checked after the cast
        with pytest.raises(ValueError, match="lora_A has 8 NaN or inf"):
            host_slot_weights("w", AdapterWeights(huge, b, 1.0), dtype)


def test_stats_count_adds_to_counters_and_refuses_unknown_ones():
    stats = Stats()
    stats.count("compiles")
    stats.count("rewrites", "lora_linear", 3)
    stats.count("rewrites", "lora_linear")
    stats.count("real_tokens", n=6)
    stats.count("padded_tokens", n=2)
    snap = stats.snapshot()
    assert snap["compiles"] == 1 and snap["rewrites"] == {"lora_linear": 4}
    assert snap["padded_token_fraction"] == 0.25
    snap["rewrites"]["lora_linear"] = 99  # a copy: the counters keep their value
    assert stats.snapshot()["rewrites"] == {"lora_linear": 4}
    with pytest.raises(KeyError, match="unknown counter 'compile'"):
        stats.count("compile")
    with pytest.raises(ValueError, match="give sub= for"):
        stats.count("rewrites")
    with pytest.raises(ValueError, match="got sub='x'"):
        stats.count("compiles", "x")


def test_count_is_public_on_the_metadata(meta):
    meta.count("bucket_hits", (2, 8))
    meta.count("fallbacks")
    assert meta.stats["bucket_hits"] == {(2, 8): 1} and meta.stats["fallbacks"] == 1


def _waits_for_lock(meta, call) -> None:
    """``call(meta)`` in another thread blocks while this thread holds the object's lock, then completes."""
    done = threading.Event()

    def run():
        call(meta)
        done.set()
    with meta._lock:
        thread = threading.Thread(target=run)
        thread.start()
        assert not done.wait(0.2)
    assert done.wait(10)
    thread.join()


@pytest.mark.parametrize("call", [
    lambda m: m.is_warming_up,
    lambda m: m.slots,
    lambda m: m.set_token_adapters(["sql"] * 4),
    lambda m: m.token_indices("cpu", (4,), (4,)),
    lambda m: m.count("compiles"),
    lambda m: m.lookup(torch.zeros(1)),
])
def test_every_call_waits_for_the_lock(meta, call):
    _waits_for_lock(meta, call)


def test_warming_up_takes_the_lock_on_entry_and_on_exit(meta):
    warm_up = meta.warming_up()  # kept here: a dropped generator would exit when collected
    _waits_for_lock(meta, lambda m: warm_up.__enter__())
    assert meta.is_warming_up
    _waits_for_lock(meta, lambda m: warm_up.__exit__(None, None, None))
    assert not meta.is_warming_up


def test_a_fused_site_is_a_tuple_and_its_a_is_the_members_concatenated(meta):
    a, b = meta.stacked_weights((Q0, V0), "cpu")
    assert b is None
    torch.testing.assert_close(a, torch.cat([meta.stacked_a(Q0, "cpu"), meta.stacked_a(V0, "cpu")], dim=1))
    assert meta.stacked_a((Q0, V0), "cpu", transposed=True).shape == (4, 32, 16)


def test_an_unchanged_mapping_costs_nothing_and_a_changed_one_is_rebuilt(meta):
    """The mapping set last, set again, keeps every per-step value built from it (no conversion, no rebuild)."""
    names = [n for n in meta.slots if n is not None][:2]
    meta.set_request_adapters(names)
    slots = meta.row_slots("cpu", (2, 3), (2, 4))
    hits = meta.stats["slot_hits"]
    meta.set_request_adapters(list(names))
    assert meta.row_slots("cpu", (2, 3), (2, 4)) is slots
    assert meta.stats["slot_hits"] == hits + 2  # its adapters still count as used (hits, eviction order)
    meta.set_request_adapters(names[::-1])
    swapped = meta.row_slots("cpu", (2, 3), (2, 4))
    assert swapped is not slots and swapped[:2].tolist() == slots[:2].flip(0).tolist()
    meta.set_token_adapters([names[0]] * 6)  # another kind of mapping with the same names is not the same one
    assert meta.request_adapters() is None and meta.mapping().tolist() == [meta.slots.index(names[0])] * 6


def test_request_rows_are_padded_as_rows(meta):
    """Row slots of a request mapping over [B, H, S] token dims: each request's slot for its rows, -1 on padding."""
    a, b = [n for n in meta.slots if n is not None][:2]
    meta.set_request_adapters([a, None, b])
    rows = meta.row_slots("cpu", (3, 2, 5), (4, 2, 8))
    sa, sb = meta.slots.index(a), meta.slots.index(b)
    assert rows[:8].tolist() == [sa, sa, -1, -1, sb, sb, -1, -1] and (rows[8:] == -1).all()
    meta.set_token_adapters(meta.token_mapping((3, 2, 5)))  # the same mapping, per token: the token-grid path
    assert meta.row_slots("cpu", (3, 2, 5), (4, 2, 8)).tolist() == rows.tolist()
