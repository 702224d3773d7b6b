"""The blocked BGMV form (xla_lora_pass/ops_blocked.py) against the reference ops."""
from __future__ import annotations

import pytest
import torch

from xla_lora_pass.ops import bgmv_expand_reference, bgmv_shrink_reference
from xla_lora_pass.ops_blocked import BLOCK_SIZE, blocked_expand, blocked_shrink, build_layout, num_blocks


def _mapping(kind: str, num_tokens: int, num_slots: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if kind == "random":
        return torch.randint(-1, num_slots, (num_tokens,), generator=g, dtype=torch.int32)
    if kind == "one_slot":  # every token on the last slot: the most blocks one slot can take
        return torch.full((num_tokens,), num_slots - 1, dtype=torch.int32)
    if kind == "all_base":
        return torch.full((num_tokens,), -1, dtype=torch.int32)
    if kind == "one_each":  # one token per slot, the rest base: N nearly empty blocks
        idx = torch.full((num_tokens,), -1, dtype=torch.int32)
        idx[: min(num_slots, num_tokens)] = torch.arange(min(num_slots, num_tokens), dtype=torch.int32)
        return idx[torch.randperm(num_tokens, generator=g)]
    raise ValueError(kind)


@pytest.mark.parametrize("kind", ["random", "one_slot", "all_base", "one_each"])
@pytest.mark.parametrize("num_tokens,num_slots", [(1, 1), (31, 3), (64, 16), (100, 5), (257, 4)])
def test_layout_invariants(kind, num_tokens, num_slots):
    idx = _mapping(kind, num_tokens, num_slots)
    lay = build_layout(idx, num_slots)
    nb = num_blocks(num_tokens, num_slots)
    assert lay.row_token.shape == (nb * BLOCK_SIZE,) and lay.block_slot.shape == (nb,)
    assert lay.token_row.shape == (num_tokens,)
    assert {t.dtype for t in lay} == {torch.int32}
    valid = (idx >= 0).nonzero().flatten()
    # Every valid token sits in exactly one row, in a block of its own slot, and that row points back.
    rows = lay.token_row[valid].long()
    assert len(set(rows.tolist())) == len(valid)
    assert torch.equal(lay.row_token[rows].long(), valid)
    assert torch.equal(lay.block_slot[rows // BLOCK_SIZE], idx[valid])
    # Rows not holding a valid token are padding; -1 tokens point at a padding row; the last block is spare.
    assert int((lay.row_token >= 0).sum()) == len(valid)
    base = (idx < 0).nonzero().flatten()
    assert bool((lay.row_token[lay.token_row[base].long()] == -1).all())
    assert bool((lay.row_token[-BLOCK_SIZE:] == -1).all())


def test_layout_rejects_bad_indices():
    with pytest.raises(ValueError, match="token indices"):
        build_layout(torch.tensor([0, 3], dtype=torch.int32), num_slots=3)
    with pytest.raises(ValueError, match="token indices"):
        build_layout(torch.tensor([-2], dtype=torch.int32), num_slots=3)


@pytest.mark.parametrize("kind", ["random", "one_slot", "all_base", "one_each"])
@pytest.mark.parametrize("num_tokens,num_slots,rank,d_in,d_out", [(37, 3, 4, 16, 24), (128, 16, 8, 32, 32)])
def test_matches_reference(kind, num_tokens, num_slots, rank, d_in, d_out):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(num_tokens, d_in, generator=g)
    a = torch.randn(num_slots, rank, d_in, generator=g)
    b = torch.randn(num_slots, d_out, rank, generator=g)
    y = torch.randn(num_tokens, d_out, generator=g)
    idx = _mapping(kind, num_tokens, num_slots)
    lay = build_layout(idx, num_slots)

    t = blocked_shrink(x, a, lay, 0.5)
    torch.testing.assert_close(t, bgmv_shrink_reference(x, a, idx, 0.5), atol=1e-4, rtol=1e-5)
    # Expand with an input that is NOT zero on -1 rows: those rows must still get nothing.
    t_in = torch.randn(num_tokens, rank, generator=g)
    torch.testing.assert_close(blocked_expand(t_in, b, y, lay), bgmv_expand_reference(t_in, b, y, idx),
                               atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(blocked_expand(t_in, b, y, lay, add_inputs=False),
                               bgmv_expand_reference(t_in, b, y, idx, add_inputs=False), atol=1e-4, rtol=1e-5)
    # Shrink then expand: the whole LoRA delta, as a rewritten site computes it.
    torch.testing.assert_close(blocked_expand(t, b, y, lay),
                               bgmv_expand_reference(bgmv_shrink_reference(x, a, idx, 0.5), b, y, idx),
                               atol=1e-4, rtol=1e-5)


def test_bf16_and_nan_stays_in_its_row():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(40, 16, generator=g).to(torch.bfloat16)
    a = torch.randn(4, 4, 16, generator=g).to(torch.bfloat16)
    idx = _mapping("random", 40, 4)
    x[3, 0] = float("nan")
    lay = build_layout(idx, 4)
    out = blocked_shrink(x, a, lay)
    assert out.dtype == torch.bfloat16
    ref = bgmv_shrink_reference(x, a, idx)
    others = torch.arange(40) != 3
    torch.testing.assert_close(out[others], ref[others], atol=2e-2, rtol=2e-2)


def test_on_xla_device_matches_cpu():
    """The device side traces and runs on XLA with the host layout copied over."""
    torch_xla = pytest.importorskip("torch_xla")
    dev = torch_xla.device()
    g = torch.Generator().manual_seed(3)
    x, a, b = torch.randn(70, 16, generator=g), torch.randn(5, 4, 16, generator=g), torch.randn(5, 8, 4, generator=g)
    y = torch.randn(70, 8, generator=g)
    idx = _mapping("random", 70, 5)
    lay = build_layout(idx, 5)
    out = blocked_expand(blocked_shrink(x.to(dev), a.to(dev), lay.to(dev)), b.to(dev), y.to(dev), lay.to(dev))
    ref = bgmv_expand_reference(bgmv_shrink_reference(x, a, idx), b, y, idx)
    torch.testing.assert_close(out.cpu(), ref, atol=1e-4, rtol=1e-5)
