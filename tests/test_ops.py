"""The three BGMV ops against their per-token reference, eagerly, under fake tensors and on XLA."""
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from xla_lora_pass.kernels import masked as ops


def _case(T=13, D=16, N=3, R=4, O=10, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=g).to(dtype)
    a = torch.randn(N, R, D, generator=g).to(dtype)
    b = torch.randn(N, O, R, generator=g).to(dtype)
    y = torch.randn(T, O, generator=g).to(dtype)
    idx = torch.randint(-1, N, (T,), generator=g, dtype=torch.int32)
    idx[0] = -1  # at least one base token in every case
    return x, a, b, y, idx


def test_shrink_matches_reference_and_zeroes_base_tokens():
    x, a, _, _, idx = _case()
    out = torch.ops.xla_lora.bgmv_shrink(x, a, idx, 0.5)
    torch.testing.assert_close(out, ops.bgmv_shrink_reference(x, a, idx, 0.5))
    assert torch.all(out[idx == -1] == 0)
    # Slot s of a token is exactly scale * x @ a[s].T.
    t = int((idx >= 0).nonzero()[0])
    torch.testing.assert_close(out[t], 0.5 * x[t] @ a[idx[t]].T)


def test_expand_adds_delta_and_leaves_base_rows_unchanged():
    x, a, b, y, idx = _case()
    t = torch.ops.xla_lora.bgmv_shrink(x, a, idx)
    out = torch.ops.xla_lora.bgmv_expand(t, b, y, idx, True)
    torch.testing.assert_close(out, ops.bgmv_expand_reference(t, b, y, idx, True))
    assert torch.equal(out[idx == -1], y[idx == -1])
    delta_only = torch.ops.xla_lora.bgmv_expand(t, b, y, idx, False)
    torch.testing.assert_close(delta_only, out - y)


def test_zero_padded_rank_is_exact():
    """An adapter of rank 2 stacked at rank 6 gives the same result as unpadded."""
    x, a, b, y, idx = _case(R=2, N=2)
    a_pad = torch.cat([a, torch.zeros(2, 4, a.shape[2])], dim=1)
    b_pad = torch.cat([b, torch.zeros(2, b.shape[1], 4)], dim=2)
    small = torch.ops.xla_lora.bgmv_expand(torch.ops.xla_lora.bgmv_shrink(x, a, idx), b, y, idx)
    padded = torch.ops.xla_lora.bgmv_expand(torch.ops.xla_lora.bgmv_shrink(x, a_pad, idx), b_pad, y, idx)
    torch.testing.assert_close(small, padded)


def test_bf16_matches_reference():
    x, a, b, y, idx = _case(dtype=torch.bfloat16)
    t = torch.ops.xla_lora.bgmv_shrink(x, a, idx)
    out = torch.ops.xla_lora.bgmv_expand(t, b, y, idx)
    ref = ops.bgmv_expand_reference(ops.bgmv_shrink_reference(x, a, idx), b, y, idx)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref.float(), rtol=1e-2, atol=1e-2)


def test_fake_impls_give_shapes():
    with FakeTensorMode():
        x, a, b, y, idx = (torch.empty(5, 16), torch.empty(3, 4, 16), torch.empty(3, 10, 4),
                           torch.empty(5, 10), torch.empty(5, dtype=torch.int32))
        assert torch.ops.xla_lora.bgmv_shrink(x, a, idx).shape == (5, 4)
        assert torch.ops.xla_lora.bgmv_expand(torch.empty(5, 4), b, y, idx).shape == (5, 10)


def test_bad_shapes_are_rejected_with_the_dims():
    x, a, _, _, idx = _case()
    with pytest.raises(RuntimeError, match="13 tokens in x but 12 indices"):
        torch.ops.xla_lora.bgmv_shrink(x, a, idx[:12])
    with pytest.raises(RuntimeError, match="x has 15 features, w expects 16"):
        torch.ops.xla_lora.bgmv_shrink(x[:, :15], a, idx)


def test_ops_under_openxla_match_reference(xla_device):
    x, a, b, y, idx = _case()

    def f(x, a, b, y, idx):
        return torch.ops.xla_lora.bgmv_expand(torch.ops.xla_lora.bgmv_shrink(x, a, idx, 0.25), b, y, idx)

    compiled = torch.compile(f, backend="openxla")
    out = compiled(*(t.to(xla_device) for t in (x, a, b, y, idx))).cpu()
    ref = ops.bgmv_expand_reference(ops.bgmv_shrink_reference(x, a, idx, 0.25), b, y, idx)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_dora_rescales_dora_slots_and_leaves_other_rows_exactly_unchanged(xla_device):
    _, _, _, y, idx = _case()
    g = torch.Generator().manual_seed(1)
    dora = torch.randn(3, 2, y.shape[1], generator=g)
    dora[1] = 0  # a plain LoRA slot: gain and shift zero
    out = torch.ops.xla_lora.bgmv_dora(y, dora, idx)
    torch.testing.assert_close(out, ops.bgmv_dora_reference(y, dora, idx))
    keep = (idx == -1) | (idx == 1)
    assert torch.equal(out[keep], y[keep])
    t = int((idx == 0).nonzero()[0])
    torch.testing.assert_close(out[t], y[t] * (1 + dora[0, 0]) - dora[0, 1])
    on_xla = torch.compile(torch.ops.xla_lora.bgmv_dora, backend="openxla")(
        y.to(xla_device), dora.to(xla_device), idx.to(xla_device)).cpu()
    torch.testing.assert_close(on_xla, out, atol=1e-5, rtol=1e-5)
    assert torch.equal(on_xla[keep], y[keep])
