"""loralib ``MergedLinear`` (pattern 7): stacked layout, golden graph and numerics, near misses, refusals.

The mixed batch on XLA with 0 compiles on remap and on ``load_adapter`` is
the ``loralib_merged`` client of test_formats.py.
"""
import copy
import operator

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import xla_lora_pass as xlp
from graph_rewrites.passes.normalize import functionalize_fresh_index_puts
from xla_lora_pass import UnsupportedAdapterError
from xla_lora_pass.demo_models import per_sequence_mapping

from . import format_models as fm
from .helpers import assert_golden, capture_graphs, check_rewrite, lora_weight_uses, normalize_gm, shrink_expand_counts

pytestmark = pytest.mark.needs("loralib")  # every test builds loralib's MergedLinear

ROWS = ["default", None, "second"]
SEQ = 4


def _eager_rows(model, states, ids, rows):
    """Row i of the module run with ``states[rows[i]]`` loaded over its LoRA weights."""
    outs = {}
    for name, state in states.items():
        m = copy.deepcopy(model)
        m.load_state_dict(state, strict=False)
        with torch.no_grad():
            outs[name] = m(ids)
    return torch.stack([outs[r][i] for i, r in enumerate(rows)])


def _states(model):
    """The module's own adapter, a second one in its state-dict keys, and the base model (every B zero)."""
    return {"default": {}, "second": fm.randomize_lora(model, 2), None: fm.without_lora(model)}


def _registered(model, states):
    meta = xlp.LoRAMetadata(max_num_tokens=64, max_slots=2)
    assert meta.register_adapters(model) == ["default"]
    assert meta.load_adapter("second", states["second"]) == 1
    return meta


@pytest.mark.parametrize("fan_in_fan_out", [False, True])
def test_stacked_b_times_a_is_loralibs_padded_delta(fan_in_fan_out):
    """Each slot's B @ A is the layer's own merge_AB() (its zero-padded delta_w), in both weight layouts."""
    import loralib

    torch.manual_seed(0)
    layer = loralib.MergedLinear(8, 36, r=3, lora_alpha=6, enable_lora=[False, True, True, False],
                                 fan_in_fan_out=fan_in_fan_out, merge_weights=False)
    nn.init.normal_(layer.lora_B)
    model = nn.Sequential(layer)
    states = _states(model)
    deltas = []
    for name in ("default", "second"):
        m = copy.deepcopy(layer)
        m.load_state_dict({k[2:]: v for k, v in states[name].items()}, strict=False)  # keys "0.lora_A" ...
        with torch.no_grad():
            delta = m.merge_AB() * m.scaling
        deltas.append(delta.T if fan_in_fan_out else delta)
    stack_a, stack_b = _registered(model, states).host_stacks("0")
    assert stack_a.shape[1] == 3 * 2  # r per enabled slice
    for slot, delta in enumerate(deltas):
        torch.testing.assert_close(stack_b[slot] @ stack_a[slot], delta, atol=1e-6, rtol=0)
        assert stack_b[slot][:9].abs().max() == 0 and stack_b[slot][27:].abs().max() == 0  # disabled slices


def test_merged_golden_and_numerics(update_golden):
    """Both MergedLinear layers (one fan_in_fan_out) rewritten; rows of 2 adapters and the base match eager."""
    model = fm.loralib_merged_net()
    ids = torch.randint(0, fm.VOCAB, (len(ROWS), SEQ), generator=torch.Generator().manual_seed(0))
    states = _states(model)
    reference = _eager_rows(model, states, ids, ROWS)
    meta = _registered(model, states)
    meta.set_token_adapters(per_sequence_mapping(ROWS, SEQ))
    ops = {torch.ops.aten.conv1d.default: 0, torch.conv1d: 0, torch.index_put: 0}
    new_gm, report = check_rewrite(model, [ids], meta, rewrites={"lora_merged": 2},
                                   ops=shrink_expand_counts(2, 2, also=ops), reference=reference,
                                   token_dims=(len(ROWS), SEQ))
    assert report.near_misses == []
    assert lora_weight_uses(new_gm) == 0  # neither A, B nor the slice mask is read any more
    assert_golden("lora_merged", normalize_gm(new_gm), update_golden)


class _OtherB(nn.Module):
    """A MergedLinear whose forward convolves A with a tensor that is not its lora_B."""

    def __init__(self, layer):
        super().__init__()
        self.layer = layer
        self.other_b = nn.Parameter(torch.randn_like(layer.lora_B))

    def delta(self):
        layer = self.layer
        delta_w = F.conv1d(layer.lora_A.unsqueeze(0), self.other_b.unsqueeze(-1),
                           groups=sum(layer.enable_lora)).squeeze(0)
        return layer.zero_pad(delta_w)


class _OtherMask(_OtherB):
    """A MergedLinear whose delta is scattered by a mask that is not its own lora_ind."""

    def delta(self):
        layer = self.layer
        delta_w = F.conv1d(layer.lora_A.unsqueeze(0), layer.lora_B.unsqueeze(-1),
                           groups=sum(layer.enable_lora)).squeeze(0)
        result = delta_w.new_zeros((layer.out_features, layer.in_features))
        result[self.mask] = delta_w
        return result


class _NearMissNet(nn.Module):
    def __init__(self, wrapper):
        super().__init__()
        import loralib

        torch.manual_seed(0)
        self.embed = nn.Embedding(fm.VOCAB, 8)
        layer = loralib.MergedLinear(8, 24, r=2, lora_alpha=4, enable_lora=[True, False, True], merge_weights=False)
        nn.init.normal_(layer.lora_B)
        self.wrapped = wrapper(layer)
        self.wrapped.mask = layer.lora_ind.clone()

    def forward(self, ids):
        h = self.embed(ids)
        layer = self.wrapped.layer
        result = F.linear(h, layer.weight, layer.bias)
        result += h @ self.wrapped.delta().T * layer.scaling
        return result


@pytest.mark.parametrize("wrapper, reason", [
    (_OtherB, "the LoRA weights are not registered adapter parameters"),
    (_OtherMask, "not this MergedLinear's own lora_ind"),
])
def test_near_miss_is_left_alone_and_guarded(wrapper, reason):
    """The MergedLinear form around something that is not the site's own delta: untouched, exact, guarded."""
    model = _NearMissNet(wrapper).eval()
    ids = torch.randint(0, fm.VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        reference = model(ids)
    meta = xlp.LoRAMetadata(max_num_tokens=64)
    meta.register_adapters(model)
    (gm, example_inputs), = capture_graphs(model, ids)
    new_gm, report = xlp.rewrite(gm, example_inputs, meta)
    [miss] = report.near_misses
    assert (miss.site, miss.pattern) == ("wrapped.layer", "lora_merged") and reason in miss.reason, miss
    assert report.sites == [] and "conv1d" in new_gm.code
    with torch.no_grad():
        torch.testing.assert_close(new_gm(*example_inputs)[0], reference, atol=1e-6, rtol=0)
    compiled = torch.compile(model, backend=xlp.make_backend(meta, inner="aot_eager"))
    meta.set_token_adapters(per_sequence_mapping(["default", None], SEQ))
    with pytest.raises(xlp.UnsupportedMappingError, match=r"wrapped.layer \(adapter 'default'\)"):
        with torch.no_grad():
            compiled(ids)


def test_merged_into_its_weight_is_refused():
    import loralib

    model = nn.Sequential(loralib.MergedLinear(8, 24, r=2, enable_lora=[True, False, True]))
    model.eval()  # merge_weights=True by default: adds the delta into the weight
    with pytest.raises(UnsupportedAdapterError, match="'0' has merged its adapter into its weight"):
        xlp.LoRAMetadata(max_num_tokens=16).register_adapters(model)


def test_load_adapter_refuses_a_b_of_another_slicing_before_any_slot_changes():
    import loralib

    model = nn.Sequential(loralib.MergedLinear(8, 24, r=2, enable_lora=[True, False, True], merge_weights=False))
    meta = xlp.LoRAMetadata(max_num_tokens=16, max_slots=2)
    meta.register_adapters(model)
    state = {"0.lora_A": torch.randn(4, 8), "0.lora_B": torch.randn(24, 2)}  # B of all 3 slices, not 2
    with pytest.raises(ValueError, match=r"0.lora_B: expected \[16, 2\] \(MergedLinear's 2 enabled slices"):
        meta.load_adapter("x", state)
    with pytest.raises(ValueError, match=r"0.lora_A: expected \[r\*2, in\]"):
        meta.load_adapter("x", {"0.lora_A": torch.randn(3, 8), "0.lora_B": torch.randn(16, 2)})
    assert meta.slots == ["default", None]


def _store(read_first: bool):
    def fn(d, mask):
        z = d.new_zeros((4, 3))
        before = z.sum() if read_first else 0
        z[mask] = d
        return z * 2 + before

    return fn


@pytest.mark.parametrize("read_first", [False, True])
def test_a_store_into_fresh_zeros_is_made_functional_only_when_nothing_read_them_before(read_first):
    """loralib's zero_pad becomes index_put; a store after another reader is left as the in-place setitem."""
    gm = torch.fx.GraphModule(torch.nn.Module(), _store_graph(read_first))
    d, mask = torch.randn(2, 3), torch.tensor([True, False, True, False])
    expected = _store(read_first)(d, mask)
    assert functionalize_fresh_index_puts(gm) == (0 if read_first else 1)
    gm.recompile()
    setitems = [n for n in gm.graph.nodes if n.target is operator.setitem]
    assert len(setitems) == (1 if read_first else 0)
    torch.testing.assert_close(gm(d, mask), expected)


def _store_graph(read_first: bool) -> torch.fx.Graph:
    """The graph Dynamo makes of ``_store`` (symbolic_trace cannot trace a setitem)."""
    g = torch.fx.Graph()
    d, mask = g.placeholder("d"), g.placeholder("mask")
    z = g.call_method("new_zeros", (d, (4, 3)))
    before = g.call_method("sum", (z,)) if read_first else 0
    g.call_function(operator.setitem, (z, mask, d))
    doubled = g.call_function(operator.mul, (z, 2))
    g.output(g.call_function(operator.add, (doubled, before)))
    return g
