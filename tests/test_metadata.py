"""LoRAMetadata: slots, stacking, mappings and adapter loading."""
import pytest
import torch

import xla_lora_pass as xlp
from xla_lora_pass.demo_models import tiny_peft_llama

Q0 = "base_model.model.model.layers.0.self_attn.q_proj"


@pytest.fixture(scope="module")
def model_and_names():
    return tiny_peft_llama()


@pytest.fixture
def meta(model_and_names):
    m = xlp.LoRAMetadata(max_num_tokens=64, max_slots=4)
    m.register_adapters(model_and_names[0])
    return m


def test_register_returns_slot_names_and_stacks_every_site(model_and_names, meta):
    model, names = model_and_names
    assert meta.slots == names + [None]
    assert len(meta.sites) == 4  # q_proj and v_proj in 2 layers
    a, b = meta.stacked_weights(Q0, "cpu")
    assert a.shape == (4, 8, 32) and b.shape == (4, 32, 8)  # 4 slots, max rank 8
    layer = model.get_submodule(Q0)
    for slot, name in enumerate(names):
        r = layer.r[name]
        torch.testing.assert_close(a[slot, :r], layer.lora_A[name].weight)
        torch.testing.assert_close(b[slot, :, :r], layer.lora_B[name].weight * layer.scaling[name])
        assert torch.all(a[slot, r:] == 0) and torch.all(b[slot, :, r:] == 0)
    assert torch.all(a[3] == 0)  # the free slot


def test_lookup_finds_parameters_by_identity(model_and_names, meta):
    layer = model_and_names[0].get_submodule(Q0)
    assert meta.lookup(layer.lora_A["chat"].weight) == (Q0, "chat", "A")
    assert meta.lookup(layer.lora_B["sql"].weight) == (Q0, "sql", "B")
    assert meta.lookup(layer.base_layer.weight) is None
    assert meta.lookup(layer.lora_A["chat"].weight.clone()) is None


def test_mapping_accepts_names_none_and_slots(meta):
    meta.set_token_adapters(["sql", None, 1, -1, "code"])
    assert meta.mapping().tolist() == [0, -1, 1, -1, 2]
    assert meta.mapping().dtype == torch.int32
    meta.set_token_adapters(torch.tensor([2, -1], dtype=torch.int64))
    assert meta.mapping().tolist() == [2, -1]


@pytest.mark.parametrize("bad, error, match", [
    (["nope"], KeyError, "unknown adapter 'nope'"),
    (["__base__"], KeyError, "the base model is None here"),
    ([3], ValueError, "slot 3 is not a loaded slot"),
    ([7], ValueError, "slot 7 is not a loaded slot"),
    ([-2], ValueError, "slot -2"),
    ([1.5], TypeError, "expected str, int or None"),
    ([True], TypeError, "expected str, int or None"),
    ("sql", TypeError, "one entry per token"),
    (torch.zeros(2, 2, dtype=torch.int32), TypeError, "1-d integer tensor"),
    (["sql"] * 65, ValueError, "65 tokens exceed max_num_tokens=64"),
])
def test_bad_mappings_are_rejected_and_keep_the_old_one(meta, bad, error, match):
    meta.set_token_adapters(["chat"])
    with pytest.raises(error, match=match):
        meta.set_token_adapters(bad)
    assert meta.mapping().tolist() == [1]


def test_token_indices_are_laid_out_for_the_padded_shape(meta):
    meta.set_token_adapters(["sql", "chat", "code", None, "sql", "chat"])  # 2 rows x 3 tokens
    idx = meta.token_indices("cpu", (2, 3), (4, 4))
    assert idx.shape == (64,)
    grid = idx[:16].reshape(4, 4)
    assert grid[:2, :3].tolist() == [[0, 1, 2], [-1, 0, 1]]
    assert torch.all(grid[2:] == -1) and torch.all(grid[:, 3] == -1) and torch.all(idx[16:] == -1)


def test_load_adapter_fills_a_free_slot_and_replaces_by_name(model_and_names, meta):
    layer = model_and_names[0].get_submodule(Q0)
    g = torch.Generator().manual_seed(3)
    lora_a, lora_b = torch.randn(3, 32, generator=g), torch.randn(32, 3, generator=g)
    slot = meta.load_adapter("new", {f"{Q0}.lora_A.weight": lora_a, f"{Q0}.lora_B.weight": lora_b}, scaling=2.0)
    assert slot == 3 and meta.slots[3] == "new"
    a, b = meta.stacked_weights(Q0, "cpu")
    torch.testing.assert_close(a[3, :3], lora_a)
    torch.testing.assert_close(b[3, :, :3], lora_b * 2.0)
    # Sites the state does not name get nothing for this adapter.
    v0 = Q0.replace("q_proj", "v_proj")
    assert torch.all(meta.stacked_weights(v0, "cpu")[1][3] == 0)
    # Loading under an existing name overwrites that slot.
    assert meta.load_adapter("sql", {f"{Q0}.lora_A.weight": lora_a, f"{Q0}.lora_B.weight": lora_b},
                             scaling=1.0) == 0
    torch.testing.assert_close(meta.stacked_weights(Q0, "cpu")[1][0, :, :3], lora_b)
    assert layer.lora_A["sql"].weight.shape == (4, 32)  # the model itself is untouched


@pytest.mark.parametrize("state, error, match", [
    ({f"{Q0}.lora_A.weight": torch.randn(9, 32), f"{Q0}.lora_B.weight": torch.randn(32, 9)}, ValueError,
     r"1 <= r <= 8"),
    ({f"{Q0}.lora_A.weight": torch.randn(2, 31), f"{Q0}.lora_B.weight": torch.randn(32, 2)}, ValueError,
     r"expected \[r, 32\]"),
    ({f"{Q0}.lora_A.weight": torch.randn(2, 32), f"{Q0}.lora_B.weight": torch.randn(31, 2)}, ValueError,
     r"lora_B: expected \[32, 2\]"),
    ({f"{Q0}.lora_A.weight": torch.ones(2, 32, dtype=torch.int64), f"{Q0}.lora_B.weight": torch.randn(32, 2)},
     TypeError, "floating-point"),
    ({f"{Q0}.lora_A.weight": torch.randn(2, 32)}, KeyError, "needs both lora_A and lora_B"),
    ({"model.nowhere.lora_A.weight": torch.randn(2, 32)}, KeyError, "names no registered LoRA site"),
    ({f"{Q0}.base_layer.weight": torch.randn(2, 32)}, KeyError, "is not a lora_A / lora_B weight"),
])
def test_load_adapter_rejects_bad_weights(meta, state, error, match):
    before = [t.clone() for t in meta.stacked_weights(Q0, "cpu")]
    with pytest.raises(error, match=match):
        meta.load_adapter("new", state, scaling=1.0)
    assert meta.slots[3] is None
    for old, new in zip(before, meta.stacked_weights(Q0, "cpu")):
        assert torch.equal(old, new)


def test_load_adapter_needs_a_scaling_and_a_slot_the_mapping_does_not_use(model_and_names):
    meta = xlp.LoRAMetadata(max_num_tokens=64)
    names = meta.register_adapters(model_and_names[0])
    state = {f"{Q0}.lora_A.weight": torch.randn(2, 32), f"{Q0}.lora_B.weight": torch.randn(32, 2)}
    with pytest.raises(ValueError, match="give scaling= or a LoraConfig"):
        meta.load_adapter("sql", state)
    meta.set_request_adapters(names)  # every slot is in use
    with pytest.raises(xlp.UnsupportedMappingError, match="3 of them kept by .* it needs 4 slots"):
        meta.load_adapter("new", state, scaling=1.0)
    assert meta.slots == names
    meta.set_request_adapters(names[1:])
    assert meta.load_adapter("new", state, scaling=1.0) == 0  # the least recently used, unused adapter goes
    assert meta.slots == ["new"] + names[1:] and meta.stats["evictions"] == 1


def test_model_without_lora_warns():
    meta = xlp.LoRAMetadata()
    with pytest.warns(UserWarning, match="has no LoRA layers"):
        assert meta.register_adapters(torch.nn.Linear(4, 4)) == []


def test_two_metadata_objects_share_nothing(model_and_names):
    one, two = xlp.LoRAMetadata(max_num_tokens=8), xlp.LoRAMetadata(max_num_tokens=8)
    one.register_adapters(model_and_names[0])
    one.set_token_adapters(["sql"])
    assert two.slots == [] and two.mapping() is None and two.lookup(
        model_and_names[0].get_submodule(Q0).lora_A["sql"].weight) is None


def test_site_base_weight_is_read_from_the_live_module(model_and_names, meta):
    """The pass finds a site through its base weight: the live tensor, also after a Parameter swap."""
    layer = model_and_names[0].get_submodule(Q0)
    site = meta.sites[Q0]
    assert site.base_weight() is layer.base_layer.weight
    old = layer.base_layer.weight
    try:
        layer.base_layer.weight = torch.nn.Parameter(old.detach().clone())
        assert site.base_weight() is layer.base_layer.weight and site.base_weight() is not old
    finally:
        layer.base_layer.weight = old
    import dataclasses
    assert dataclasses.replace(site, base_weight_attr=None).base_weight() is None
