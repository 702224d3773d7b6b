"""One slot's rows of a stack cut to what its adapter uses: what a pool swap sends to the device.

The host stacks pad every adapter to its site's stacked rank R with zeros
(host_stacks.py), so a rank-2 adapter at a site of R=8 holds 6 zero rows of A
and 6 zero columns of B.  A swap sends only the rows in use and the device
pads them back with zeros it makes itself.  A write whose input has r rows is
an XLA program of its own, so r is rounded up to a bucket (0, then powers of
two, capped at R: ranks 1, 2, 4, 8 send exactly their rows), and every bucket's
write is compiled when the stack is first sent (``buckets``), never at a swap.
Rows in use are read off the rows themselves (the last nonzero one), so a
slot's rows need no record of its adapter's rank and the copy on the device
always equals the host row.

A stack row is given as parts along a rank dim: one part for a site's A
(``[R, in]``, dim 0) or B (``[out, R]``, dim 1), one per site for a fused
group's A (each site's rows cut to the bucket, then concatenated as the
group's stack is), or a bias / DoRA row with no rank dim, sent whole or,
when all zero, not at all (buckets 1 and 0).
"""
from __future__ import annotations

from typing import Callable, List, NamedTuple, Optional, Tuple

import numpy
import torch


class SlotRow(NamedTuple):
    """One slot's host row of a stack: its parts and the rank dim they are cut along (None: whole only)."""

    parts: Tuple[torch.Tensor, ...]
    dim: Optional[int]

    @property
    def width(self) -> int:
        """The largest bucket: the stacked rank R (of the widest part), or 1 for a row sent whole."""
        return 1 if self.dim is None else max(p.shape[self.dim] for p in self.parts)

    def used(self) -> int:
        """Rows in use: past them every part is zero (1 or 0 for a row without a rank dim)."""
        if self.dim is None:
            return int(any(bool(_nonzero(p).any()) for p in self.parts))
        return max(_rows_in_use(p, self.dim) for p in self.parts)

    def uses(self, row: int) -> bool:
        """Whether some part holds a nonzero value in rank row ``row`` (a part that narrow has none)."""
        return any(bool(_nonzero(p.select(self.dim, row)).any()) for p in self.parts if p.shape[self.dim] > row)

    def piece(self, bucket: int) -> Optional[torch.Tensor]:
        """The host tensor a write of ``bucket`` rows sends (None for bucket 0: the device writes zeros)."""
        if bucket == 0:
            return None
        if self.dim is None:
            return self.parts[0]
        cut = [p.narrow(self.dim, 0, min(bucket, p.shape[self.dim])) for p in self.parts]
        return (cut[0] if len(cut) == 1 else torch.cat(cut, self.dim)).contiguous()

    def full(self, sent: Optional[torch.Tensor], bucket: int, device) -> torch.Tensor:
        """The whole row on ``device`` from what was sent: each part's rows, then zeros up to its width."""
        dtype = self.parts[0].dtype
        if sent is None:
            shape = list(self.parts[0].shape)
            if self.dim is not None:
                shape[self.dim] = sum(p.shape[self.dim] for p in self.parts)
            return torch.zeros(shape, dtype=dtype, device=device)
        if self.dim is None:
            return sent
        out: List[torch.Tensor] = []
        sizes = [min(bucket, p.shape[self.dim]) for p in self.parts]
        for piece, part in zip(sent.split(sizes, self.dim), self.parts):
            pad = part.shape[self.dim] - piece.shape[self.dim]
            if pad:
                shape = list(piece.shape)
                shape[self.dim] = pad
                piece = torch.cat([piece, torch.zeros(shape, dtype=dtype, device=device)], self.dim)
            out.append(piece)
        return out[0] if len(out) == 1 else torch.cat(out, self.dim)


RANK_DIM = {"A": 0, "B": 1}  # the rank dim of a slot's A row [R, in] and B row [out, R]; bias / DoRA rows have none


def slot_row(site, role: str, row_of: Callable[[str, str], torch.Tensor]) -> SlotRow:
    """One slot's row of a plain stack as parts along its rank dim, from ``row_of(site name, role)``, the
    slot's row of one site's stack; a fused group's A (``site`` a tuple of names) one part per site,
    concatenated along the rank as the group's stack is."""
    if isinstance(site, tuple):
        return SlotRow(tuple(row_of(name, "A") for name in site), RANK_DIM["A"])
    return SlotRow((row_of(site, role),), RANK_DIM.get(role))


def bucket(rows: int, width: int) -> int:
    """The rows a write sends for ``rows`` in use: 0, else the next power of two, at most ``width``."""
    return 0 if rows <= 0 else min(1 << (rows - 1).bit_length(), width)


def buckets(width: int) -> List[int]:
    """Every bucket of a stack of ``width``: one write program each, compiled when the stack is first sent."""
    return sorted({0, width} | {1 << k for k in range(width.bit_length()) if 1 << k < width})


def _rows_in_use(part: torch.Tensor, dim: int) -> int:
    nonzero = _nonzero(part)
    where = numpy.flatnonzero(nonzero.any(axis=tuple(d for d in range(nonzero.ndim) if d != dim)))
    return int(where[-1]) + 1 if where.size else 0


def _nonzero(part: torch.Tensor) -> numpy.ndarray:
    """``part != 0`` as a numpy array, from the host tensor's own memory where numpy has its dtype.

    A swap reads the rows in use of every part of every stack it sends (28 parts a slot for a 2-layer
    Llama with LoRA on every linear).  Torch's five small ops took 48-50 us a part, these 20-21 us, and
    staging an adapter's swap went from 2.15 to 1.34 ms (hidden 256, r=16, 2-core CPU)."""
    part = part.detach().cpu()  # host rows already: no copy
    if part.dtype not in _NUMPY_FLOATS:
        part = part.float()  # bfloat16 (which numpy has not) and others: exact in float32 for a zero test
    return part.numpy() != 0


_NUMPY_FLOATS = (torch.float16, torch.float32, torch.float64)


__all__ = ["RANK_DIM", "SlotRow", "bucket", "buckets", "slot_row"]
