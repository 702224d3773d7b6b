"""Property-based tests (hypothesis): the masked kernel's shrink and expand, and the whole pass.

CPU only, no XLA: ops run eagerly, the pass runs through ``capture_graphs`` +
``xlp.rewrite`` + ``run_rewritten``.  Derandomized, so CI sees the same
examples every run; the example counts below add up to 480 op and pass
examples (mapping fuzzing: tests/test_mapping_fuzz.py).
"""
from __future__ import annotations

import math
from typing import List, Optional

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from peft import LoraConfig, get_peft_model

import xla_lora_pass as xlp
from xla_lora_pass.kernels import masked as ops

from .helpers import capture_graphs, check_rewrite, count_ops, lora_weight_uses, normalize_gm, run_rewritten, \
    shrink_expand_counts
from .models import TwoLayer, peft_two_layer

SETTINGS = dict(deadline=None, derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow])
# A pass example captures a Dynamo graph (~0.1 s): shrinking one failure could take many minutes in CI,
# so these report the failing example as drawn.
PASS_SETTINGS = dict(SETTINGS, phases=(Phase.explicit, Phase.generate))
OP_EXAMPLES = 140  # per op: 2 x 140
PASS_EXAMPLES = 80  # PEFT grammar, hand-written grammar: 2 x 80, near misses: 40
NEAR_MISS_EXAMPLES = 40

# Ops: |impl - reference| <= TOL * (the same sum over |terms|), per dtype.  Both round the same
# exact value (fp32: D-term sums in float32; bf16: one more rounding per output and per scale).
TOL = {torch.float32: 1e-5, torch.bfloat16: 2.0 ** -5}


# ------------------------------------------------------------------------ ops
@st.composite
def op_inputs(draw):
    """Random x, stacked w, y, idx (-1 mixed in), scale, dtype for one op call; tensors from a drawn seed."""
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16]))
    T, D, N, R = draw(st.integers(1, 33)), draw(st.integers(1, 40)), draw(st.integers(1, 6)), draw(st.integers(1, 8))
    O = draw(st.integers(1, 40))
    idx = torch.tensor(draw(st.lists(st.integers(-1, N - 1), min_size=T, max_size=T)), dtype=torch.int32)
    magnitude = draw(st.sampled_from([1e-3, 1.0, 30.0]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2 ** 31 - 1)))
    x = (torch.randn(T, D, generator=g) * magnitude).to(dtype)
    a = torch.randn(N, R, D, generator=g).to(dtype)
    b = torch.randn(N, O, R, generator=g).to(dtype)
    xr = (torch.randn(T, R, generator=g) * magnitude).to(dtype)
    y = torch.randn(T, O, generator=g).to(dtype)
    scale = draw(st.floats(-4.0, 4.0, allow_nan=False, width=32))
    add_inputs = draw(st.booleans())
    return dict(dtype=dtype, x=x, a=a, b=b, xr=xr, y=y, idx=idx, scale=scale, add_inputs=add_inputs)


def _assert_within(out, ref, bound, dtype):
    assert out.dtype == ref.dtype == dtype and out.shape == ref.shape
    err = (out.double() - ref.double()).abs()
    limit = TOL[dtype] * bound + 1e-30
    worst = (err - limit).max().item() if err.numel() else 0.0
    assert worst <= 0, f"max excess {worst:.3g}, max err {err.max().item():.3g} ({dtype})"


@settings(max_examples=OP_EXAMPLES, **SETTINGS)
@given(op_inputs())
def test_bgmv_shrink_matches_reference(c):
    x, a, idx, scale = c["x"], c["a"], c["idx"], c["scale"]
    out = torch.ops.xla_lora.bgmv_shrink(x, a, idx, scale)
    ref = ops.bgmv_shrink_reference(x, a, idx, scale)
    bound = ops.bgmv_shrink_reference(x.double().abs(), a.double().abs(), idx, abs(scale))
    _assert_within(out, ref, bound, c["dtype"])
    assert torch.all(out[idx == -1] == 0)


@settings(max_examples=OP_EXAMPLES, **SETTINGS)
@given(op_inputs())
def test_bgmv_expand_matches_reference(c):
    xr, b, y, idx, add = c["xr"], c["b"], c["y"], c["idx"], c["add_inputs"]
    out = torch.ops.xla_lora.bgmv_expand(xr, b, y, idx, add)
    ref = ops.bgmv_expand_reference(xr, b, y, idx, add)
    bound = ops.bgmv_expand_reference(xr.double().abs(), b.double().abs(), y.double().abs(), idx, add)
    _assert_within(out, ref, bound, c["dtype"])
    base_rows = idx == -1
    assert torch.equal(out[base_rows], y[base_rows] if add else torch.zeros_like(y[base_rows]))


@pytest.mark.xfail(strict=True, reason="ops.py bug: bgmv_expand's masked matmul multiplies every slot's B by "
                   "zeros for tokens on other slots, so a NaN/inf in the B of a slot no token uses turns every "
                   "row NaN, even idx == -1 rows; the reference leaves them alone. LoRAMetadata refuses non-finite "
                   "weights, so stacks from register_adapters/load_adapter cannot trigger it.")
def test_expand_keeps_a_non_finite_unused_slot_out_of_other_rows():
    g = torch.Generator().manual_seed(0)
    x, w, y = torch.randn(4, 3, generator=g), torch.randn(2, 5, 3, generator=g), torch.randn(4, 5, generator=g)
    idx = torch.tensor([0, 0, -1, 0], dtype=torch.int32)
    w[1, 0, 0] = float("inf")  # slot 1: no token uses it
    out = torch.ops.xla_lora.bgmv_expand(x, w, y, idx, True)
    torch.testing.assert_close(out, ops.bgmv_expand_reference(x, w, y, idx, True))


# ------------------------------------------------------------------- the pass
ALPHAS = (1.0, 2.0, 3.5, 8.0, 16.0)


@st.composite
def adapter_specs(draw):
    """1-3 adapters: (name, rank, alpha), each scaling its own."""
    n = draw(st.integers(1, 3))
    return [(f"ad{i}", draw(st.integers(1, 4)), draw(st.sampled_from(ALPHAS))) for i in range(n)]


def _peft_model(dims, targets, adapters, seed, **lora_kw) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = None
    for name, r, alpha in adapters:
        cfg = LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets), init_lora_weights=False, **lora_kw)
        if model is None:
            model = get_peft_model(TwoLayer(*dims), cfg, adapter_name=name)
        else:
            model.add_adapter(name, cfg)
    return model.eval()


@st.composite
def token_mapping(draw, num_tokens: int, names: List[str]):
    """One entry per token: a name, a slot number, None or -1."""
    entry = st.one_of(st.none(), st.just(-1), st.sampled_from(names), st.integers(0, len(names) - 1))
    return draw(st.lists(entry, min_size=num_tokens, max_size=num_tokens))


def _slot_name(entry, names) -> Optional[str]:
    if entry is None or entry == -1:
        return None
    return entry if isinstance(entry, str) else names[entry]


def _select_per_token(outputs: dict, mapping, names, leading) -> torch.Tensor:
    """Each token's row from the output of its own adapter (tokens do not interact in these modules)."""
    rows = [outputs[_slot_name(e, names)].reshape(len(mapping), -1)[i] for i, e in enumerate(mapping)]
    return torch.stack(rows).reshape(*leading, -1)


@st.composite
def leading_dims(draw):
    return tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=3)))


@settings(max_examples=PASS_EXAMPLES, **PASS_SETTINGS)
@given(st.data())
def test_peft_modules_rewrite_and_match_eager_per_token(data):
    """PEFT-wrapped nn.Linear targets, random ranks/alphas/adapter counts/dropout/rsLoRA/active adapter."""
    dims = (data.draw(st.integers(1, 12)), data.draw(st.integers(1, 12)), data.draw(st.integers(1, 6)))
    targets = data.draw(st.sampled_from([("proj",), ("out",), ("proj", "out")]))
    adapters = data.draw(adapter_specs())
    names = [a[0] for a in adapters]
    model = _peft_model(dims, targets, adapters, data.draw(st.integers(0, 999)),
                        lora_dropout=data.draw(st.sampled_from([0.0, 0.1])), use_rslora=data.draw(st.booleans()))
    active = data.draw(st.sampled_from(names))
    leading = data.draw(leading_dims())
    x = torch.randn(*leading, dims[0], generator=torch.Generator().manual_seed(data.draw(st.integers(0, 999))))
    mapping = data.draw(token_mapping(math.prod(leading), names))
    with torch.no_grad():
        outputs = {}
        for name in names:
            model.set_adapter(name)
            outputs[name] = model(x)
        with model.disable_adapter():
            outputs[None] = model(x)
    model.set_adapter(active)
    meta = xlp.LoRAMetadata(max_num_tokens=64, max_slots=data.draw(st.sampled_from([None, len(names) + 1])))
    assert meta.register_adapters(model) == names
    meta.set_token_adapters(mapping)
    new_gm, _ = check_rewrite(model, [x], meta, rewrites={"lora_linear": len(targets)},
                              ops=shrink_expand_counts(len(targets), len(targets)),
                              reference=_select_per_token(outputs, mapping, names, leading), token_dims=leading,
                              atol=1e-4, rtol=1e-4)
    assert lora_weight_uses(new_gm) == 0


class HandWritten(torch.nn.Module):
    """``base + delta * s`` and its forms, written out over a registered PEFT layer's own parameters."""

    def __init__(self, inner, adapter: str, delta_form: str, combine: str, base_form: str, scale: float,
                 leak: bool = False):
        super().__init__()
        self.inner, self.adapter, self.scale, self.leak = inner, adapter, scale, leak
        self.delta_form, self.combine, self.base_form = delta_form, combine, base_form

    def forward(self, x):
        proj = self.inner.base_model.model.proj
        w, a, b = proj.base_layer.weight, proj.lora_A[self.adapter].weight, proj.lora_B[self.adapter].weight
        base = F.linear(x, w) if self.base_form == "linear" else x @ w.t()
        if self.delta_form == "linear":
            shrunk = F.linear(x, a)
            delta = F.linear(shrunk, b)
        elif self.delta_form == "matmul_op":
            shrunk = x @ a.t()
            delta = shrunk @ b.t()
        else:  # torch.matmul
            shrunk = torch.matmul(x, a.t())
            delta = torch.matmul(shrunk, b.t())
        s = self.scale
        if self.combine == "base + delta * s":
            y = base + delta * s
        elif self.combine == "base + s * delta":
            y = base + s * delta
        elif self.combine == "delta * s + base":
            y = delta * s + base
        else:  # "s * delta + base"
            y = s * delta + base
        y = torch.relu(y)
        return (y, shrunk) if self.leak else y


def _hand_written_reference(inner, x, mapping, names, leading):
    """Per token: its adapter's delta with that adapter's own scaling (what the stacks fold in), or none."""
    proj = inner.base_model.model.proj
    with torch.no_grad():
        base = F.linear(x, proj.base_layer.weight)
        outputs = {None: torch.relu(base)}
        for n in names:
            delta = F.linear(F.linear(x, proj.lora_A[n].weight), proj.lora_B[n].weight)
            outputs[n] = torch.relu(base + delta * proj.scaling[n])
    return _select_per_token(outputs, mapping, names, leading)


@st.composite
def hand_written_case(draw, delta_forms=("linear", "matmul_op"),
                      combines=("base + delta * s", "base + s * delta", "delta * s + base")):
    dims = (draw(st.integers(1, 12)), draw(st.integers(1, 12)), 3)
    adapters = draw(adapter_specs())
    names = [a[0] for a in adapters]
    inner = _peft_model(dims, ("proj",), adapters, draw(st.integers(0, 999)))
    adapter = draw(st.sampled_from(names))
    forms = dict(delta_form=draw(st.sampled_from(delta_forms)), combine=draw(st.sampled_from(combines)),
                 base_form=draw(st.sampled_from(["linear", "matmul_op"])))
    leading = draw(leading_dims())
    x = torch.randn(*leading, dims[0], generator=torch.Generator().manual_seed(draw(st.integers(0, 999))))
    return inner, names, adapter, forms, leading, x


@settings(max_examples=PASS_EXAMPLES, **PASS_SETTINGS)
@given(hand_written_case(), st.data())
def test_hand_written_forms_rewrite_and_match_eager_per_token(case, data):
    inner, names, adapter, forms, leading, x = case
    model = HandWritten(inner, adapter, scale=inner.base_model.model.proj.scaling[adapter], **forms).eval()
    mapping = data.draw(token_mapping(math.prod(leading), names))
    meta = xlp.LoRAMetadata(max_num_tokens=64)
    meta.register_adapters(inner)
    meta.set_token_adapters(mapping)
    check_rewrite(model, [x], meta, rewrites={"lora_linear": 1}, ops=shrink_expand_counts(1, 1),
                  reference=_hand_written_reference(inner, x, mapping, names, leading),
                  token_dims=leading, atol=1e-4, rtol=1e-4)


@settings(max_examples=NEAR_MISS_EXAMPLES, **PASS_SETTINGS)
@given(hand_written_case(), st.sampled_from(["scale", "leak"]), st.sampled_from([2.0, 0.5, -1.0, 1e-3]))
def test_near_misses_leave_the_graph_unchanged(case, kind, factor):
    """A scale that is not the registered scaling, or an intermediate used elsewhere: left exactly as it was."""
    inner, names, adapter, forms, leading, x = case
    scaling = inner.base_model.model.proj.scaling[adapter]
    scale = scaling * factor if kind == "scale" else scaling
    model = HandWritten(inner, adapter, scale=scale, leak=kind == "leak", **forms).eval()
    meta = xlp.LoRAMetadata(max_num_tokens=64)
    meta.register_adapters(inner)
    (gm, example_inputs), = capture_graphs(model, x)
    new_gm, report = xlp.rewrite(gm, example_inputs, meta)
    assert report.error is None and report.sites == []
    [miss] = report.near_misses
    assert miss.site == "base_model.model.proj"
    assert ("scales the delta by" if kind == "scale" else "no pattern matched") in miss.reason, miss.reason
    assert normalize_gm(new_gm) == normalize_gm(gm)
    assert count_ops(new_gm, torch.ops.xla_lora.bgmv_shrink.default) == 0
    # Unchanged, so it still computes the active adapter for every token, exactly as eager.
    meta.set_token_adapters([adapter] * math.prod(leading))
    with torch.no_grad():
        expected = model(x)
    got = run_rewritten(new_gm, example_inputs, meta, leading)
    torch.testing.assert_close(got[0], expected[0] if kind == "leak" else expected, atol=0, rtol=0)


@pytest.mark.parametrize("delta_form, combine", [("torch_matmul", "base + delta * s"),
                                                 ("linear", "s * delta + base")])
def test_other_spellings_of_the_same_lora_are_rewritten(delta_form, combine):
    inner = peft_two_layer()
    model = HandWritten(inner, "sql", delta_form, combine, "linear", inner.base_model.model.proj.scaling["sql"])
    meta = xlp.LoRAMetadata(max_num_tokens=64)
    meta.register_adapters(inner)
    x = torch.randn(2, 3, 16)
    mapping = ["sql", None, "chat", "chat", -1, 0]
    meta.set_token_adapters(mapping)
    check_rewrite(model, [x], meta, rewrites={"lora_linear": 1}, ops=shrink_expand_counts(1, 1),
                  reference=_hand_written_reference(inner, x, mapping, ["sql", "chat"], (2, 3)),
                  token_dims=(2, 3), atol=1e-4, rtol=1e-4)
