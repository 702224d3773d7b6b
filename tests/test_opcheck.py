"""``torch.library.opcheck`` on every ``torch.ops.xla_lora`` op: schema, fake kernel, Dynamo and AOT tracing.

Every op in the namespace must have sample inputs here: a new op without
them fails ``test_every_op_has_samples`` rather than going unchecked.
"""
import pytest
import torch

import xla_lora_pass  # noqa: F401  (registers torch.ops.xla_lora)
from xla_lora_pass.kernels.segments import build_segment_layout
from xla_lora_pass.kernels.sorted_tokens import build_sorted_layout

T, D, O, R, N = 6, 5, 7, 3, 4
ROWS = 2  # T tokens as ROWS rows of T // ROWS


def _gen():
    return torch.Generator().manual_seed(0)


def _samples():
    """op name -> list of (args, kwargs); weights in each op's own layout."""
    g = _gen()
    x, y = torch.randn(T, D, generator=g), torch.randn(T, O, generator=g)
    xr = torch.randn(T, R, generator=g)
    a, b = torch.randn(N, R, D, generator=g), torch.randn(N, O, R, generator=g)
    idx = torch.tensor([0, -1, 3, 1, 1, 2], dtype=torch.int32)
    row_slots = torch.tensor([2, -1], dtype=torch.int32)
    ids = torch.tensor([0, 4, 1, 3, 2, 4])
    emb_a = torch.randn(N, R, D, generator=g)  # [N, R, vocab]
    bias = torch.randn(N, O, generator=g)
    segments = tuple(build_segment_layout(idx, block_tokens=4, slots_per_block=3))  # 2 blocks, the last padded
    sorted_ = tuple(build_sorted_layout(idx, block_tokens=2, groups=N + 1))  # a base block, pad rows and blocks
    return {
        "bgmv_shrink": [((x, a, idx, 1.0), {}), ((x, a, idx, 0.5), {})],
        "bgmv_expand": [((xr, b, y, idx, True), {}), ((xr, b, y, idx, False), {})],
        "bgmv_embedding_shrink": [((ids, emb_a, idx), {})],
        "bgmv_bias": [((y, bias, idx), {})],
        "bgmv_dora": [((y, torch.randn(N, 2, O, generator=g), idx), {})],
        "bgmv_shrink_rows": [((x, a.transpose(1, 2).contiguous(), row_slots, 1.0), {})],
        "bgmv_expand_rows": [((xr, b.transpose(1, 2).contiguous(), y, row_slots, True), {})],
        "bgmv_shrink_segments": [((x, a.transpose(1, 2).contiguous(), *segments, 0.5), {})],
        "bgmv_expand_segments": [((xr, b.transpose(1, 2).contiguous(), y, *segments, True), {}),
                                 ((xr, b.transpose(1, 2).contiguous(), y, *segments, False), {})],
        "bgmv_shrink_sorted": [((x, a.transpose(1, 2).contiguous(), *sorted_, 0.5), {})],
        "bgmv_expand_sorted": [((xr, b.transpose(1, 2).contiguous(), y, *sorted_, True), {}),
                               ((xr, b.transpose(1, 2).contiguous(), y, *sorted_, False), {})],
    }


def _registered_ops():
    names = torch._C._dispatch_get_all_op_names()
    return sorted({n.split("::", 1)[1].split(".", 1)[0] for n in names if n.startswith("xla_lora::")})


def test_every_op_has_samples():
    missing = set(_registered_ops()) - set(_samples())
    assert not missing, f"add opcheck samples for {sorted(missing)} to tests/test_opcheck.py"


@pytest.mark.parametrize("name", sorted(_samples()))
def test_opcheck(name):
    op = getattr(torch.ops.xla_lora, name)
    for args, kwargs in _samples()[name]:
        torch.library.opcheck(op, args, kwargs)


def _keyword_form(name, args):
    """The sample with its trailing default argument (scale, add_inputs) given by keyword, if it has one."""
    keyword = "scale" if name.startswith("bgmv_shrink_") or name == "bgmv_shrink" else (
        "add_inputs" if name.startswith("bgmv_expand") else None)
    return (args[:-1], {keyword: args[-1]}) if keyword else (args, {})


@pytest.mark.parametrize("name", sorted(_samples()))
def test_decomposition_traces_to_aten_and_computes_the_op(name):
    """Each op's decomposition (kernels.table.decompositions()) traced by make_fx gives ATen ops only and the
    op's exact result, its trailing default given by position or by keyword."""
    from torch.fx.experimental.proxy_tensor import make_fx
    from xla_lora_pass.kernels.table import decompositions

    op = getattr(torch.ops.xla_lora, name)
    for args, _ in _samples()[name]:
        for pos, kw in ((args, {}), _keyword_form(name, args)):
            gm = make_fx(lambda *a: op(*a, **kw), decomposition_table=decompositions(), tracing_mode="fake")(*pos)
            targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
            assert targets and all(t.namespace == "aten" for t in targets), targets
            torch.testing.assert_close(gm(*pos), op(*args), rtol=0, atol=0)
            # Called directly too (make_fx hands it every argument by position).
            torch.testing.assert_close(decompositions()[op.default](*pos, **kw), op(*args), rtol=0, atol=0)
