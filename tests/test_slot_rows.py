"""What a swap sends of one slot's rows: the rows in use, their bucket for the whole adapter, and the pieces cut
to it, against a brute-force reading of the rows."""
import pytest
import torch

from xla_lora_pass.metadata.slot_rows import SlotRow, bucket
from xla_lora_pass.metadata.slot_swap import SlotSwap


def _rows(ranks, width=8, dtype=torch.float32, seed=0):
    """One adapter's rows at sites of stacked rank ``width``: per site an A ``[width, 6]`` and a B ``[5, width]``
    zero past the site's rank (rank 0: all zero)."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for r in ranks:
        a, b = torch.zeros(width, 6, dtype=dtype), torch.zeros(5, width, dtype=dtype)
        a[:r] = torch.randn(r, 6, generator=gen).to(dtype)
        b[:, :r] = torch.randn(5, r, generator=gen).to(dtype)
        rows += [SlotRow((a,), 0), SlotRow((b,), 1)]
    return rows


def _brute_used(row: SlotRow) -> int:
    rank_dims = [p.movedim(row.dim, 0).reshape(p.shape[row.dim], -1) for p in row.parts]
    return max((i + 1 for t in rank_dims for i in range(t.shape[0]) if bool(t[i].ne(0).any())), default=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ranks", [(8, 8, 8), (2, 8, 3), (3, 5, 1), (2, 2, 2), (0, 0, 0), (0, 3, 0), (1,)])
def test_a_swaps_bucket_is_the_most_rows_any_site_uses(ranks, dtype):
    """Full-rank adapters take the widest bucket from one row's check; the others scan every row; both equal the
    bucket of the most rows in use by brute force, and each piece holds exactly the rows it is cut to."""
    rows = _rows(ranks, dtype=dtype)
    swap = SlotSwap("cpu", (), (), lambda slot: rows)
    used = max(_brute_used(r) for r in rows)
    assert [r.used() for r in rows] == [_brute_used(r) for r in rows]
    assert swap.shape_of(rows) == (bucket(used, 8), False)
    for row in rows:
        piece = row.piece(bucket(used, 8))
        if used == 0:
            assert piece is None
            continue
        assert torch.equal(piece, row.parts[0].narrow(row.dim, 0, bucket(used, 8))) and piece.is_contiguous()


def test_a_full_rank_adapter_whose_last_rows_are_zero_is_scanned():
    """Rank 8 everywhere, but row 7 zero at every site and row 5 the last nonzero one: bucket 8 (6 rows in use),
    found by the scan, not by the last-row check."""
    rows = _rows((8, 8))
    for row in rows:
        row.parts[0].narrow(row.dim, 6, 2).zero_()
    assert not any(r.uses(7) for r in rows)
    assert SlotSwap("cpu", (), (), lambda slot: rows).shape_of(rows) == (8, False)
    for row in rows:
        row.parts[0].narrow(row.dim, 4, 4).zero_()
    assert SlotSwap("cpu", (), (), lambda slot: rows).shape_of(rows) == (4, False)


def test_fused_rows_and_whole_rows():
    """A fused group's A (one part per site, of different widths) and a bias row sent whole when nonzero."""
    a1, a2 = torch.zeros(8, 3), torch.zeros(4, 3)
    a2[3, 0] = 1.0  # the narrower part's last row: 4 rows in use
    fused = SlotRow((a1, a2), 0)
    assert fused.width == 8 and fused.used() == 4 and fused.uses(3) and not fused.uses(7)
    assert torch.equal(fused.piece(4), torch.cat([a1[:4], a2]))
    bias = SlotRow((torch.zeros(5),), None)
    swap = SlotSwap("cpu", (), (), lambda slot: [fused, bias])
    assert swap.shape_of([fused, bias]) == (4, False)
    bias.parts[0][2] = 0.5
    assert swap.shape_of([fused, bias]) == (4, True)
