"""One slot of many device stacks written at once: one host buffer, one transfer, one program.

A swap changes one slot of every device stack (``device_stacks.py``).
Written one stack at a time, each stack costs a transfer and, on XLA, a
program launch and a sync of its own (22 of each for a 2-layer all-linear
Llama; measured 7.7 ms a swap at load 6 on 2 cores).  Here every stack's
rows for the slot are packed into one host buffer, sent in one call
(``Runtime.send``), and one update cuts it up, pads each piece with zeros
made on the device and index-copies it into its stack in place
(``Runtime.write_program``): on XLA one program, traced once and then run on
each swap's data, since tracing its ops again took most of a swap.

The program depends on every piece's shape, so the rows sent are cut to
one bucket for the whole swap (``slot_rows.bucket`` of the most rows any
stack uses, each stack taking at most its own width) and whole rows (LoRA
bias, DoRA) are sent when any of them is nonzero: for a set of stacks,
``len(buckets(R)) * 2`` one-slot programs at most, and once a pool is in use
up to 14 more that write 2 to 8 full-rank slots at once (``BATCH_SIZES``),
all compiled by ``warm`` (an adapter of rank r at every site still sends its
own rows exactly; one of mixed ranks sends its largest rank's bucket at
every site).  The slot numbers travel with the rows, in the same transfer
call, so they are an input of the program rather than constants of it.
"""
from __future__ import annotations

import functools
from typing import Callable, Dict, Iterable, List, NamedTuple, Optional, Sequence, Tuple

import numpy
import torch

from .. import runtimes
from .slot_rows import SlotRow, bucket, buckets

# The numbers of slots one program writes: a mapping's swaps of the stacks' full rank go in one program when
# there are at most 8 of them (more: 8 at a time, then the rest).  Exact sizes, not padded ones: a padded batch
# would send some adapter's rows twice, and a swap sends its adapter's own bytes.  Each size is a program per
# set of stacks, compiled ahead (``warm``: about 0.45 s each on XLA:CPU here, 7 of them once a pool is in use),
# and only for the full rank: an adapter of a lower rank (another row bucket) is written by a program of its
# own.  Sizes 1, 2, 4, 8 alone (5 swaps: 4 + 1) compiled 4 fewer programs and cost 13-17% more per prefetched
# swap in bench/adapter_pool.py (1.87 / 2.02 ms against 1.65 / 1.72 at 8 / 32 slots).
BATCH_SIZES = (1, 2, 3, 4, 5, 6, 7, 8)


class Target(NamedTuple):
    """One device stack a swap writes: its key, the tensor, the plain row it is made from, and its layout."""

    key: tuple
    copy: torch.Tensor
    row: int  # index of its plain row in the swap's rows (a transposed copy shares its plain one's)
    transposed: bool


class Staged(NamedTuple):
    """A swap's host side done ahead (``SlotSwap.stage``): for that swap only."""

    swap: "SlotSwap"
    shape: Tuple[int, bool]
    sizes: Tuple[int, ...]  # rows sent per plain row
    pieces: tuple  # per plain row: (dtype, shape) of its piece, or None when nothing is sent
    buffers: Dict[torch.dtype, torch.Tensor]
    offsets: Tuple[int, ...]
    bytes: int


class SlotSwap:
    """Writes one slot of a fixed set of device stacks (on one device) with one transfer and one program."""

    def __init__(self, device: str, targets: Sequence[Target], plains: Sequence, rows: Callable[[int], List[SlotRow]]):
        self.device = device
        self.targets = tuple(targets)
        self.plains = tuple(plains)  # what each plain row is (the caller's keys), in Target.row order
        self._rows = rows  # slot -> the plain host rows, in Target.row order
        self._batched: Tuple[Tuple[int, bool], ...] = ()  # the shapes written several slots at once (warm)
        self._programs: Dict[tuple, Callable[..., None]] = {}  # (shape, slots, pieces) -> runtime.write_program

    def shape_of(self, rows: Sequence[SlotRow]) -> Tuple[int, bool]:
        """The (bucket, whole rows sent) a swap of these rows runs: the key of its program."""
        ranked = [r for r in rows if r.dim is not None]
        widest = max((r.width for r in ranked), default=1)
        # An adapter of the sites' full rank uses the last row somewhere, usually at the first site: then its
        # bucket is the widest without scanning every row (28 scans of 20 us for a 2-layer all-linear Llama).
        full = any(r.uses(widest - 1) for r in ranked)
        rank_rows = widest if full else max((r.used() for r in ranked), default=0)
        return bucket(rank_rows, widest), any(r.used() for r in rows if r.dim is None)

    def shapes(self, rows: Sequence[SlotRow]) -> List[Tuple[int, bool]]:
        """Every (bucket, whole rows sent) a swap of these stacks may run."""
        widest = max((r.width for r in rows if r.dim is not None), default=1)
        wholes = (False, True) if any(r.dim is None for r in rows) else (False,)
        return [(b, z) for b in buckets(widest) for z in wholes]

    def stage(self, rows: Sequence[SlotRow]) -> "Staged":
        """The host side of a swap of these rows (their shape, the pieces cut and packed), done ahead: on the
        prefetch thread, from an adapter read but not yet in a slot (``DeviceStacks.stage``)."""
        return self._staged(rows, self.shape_of(rows))

    def _staged(self, rows: Sequence[SlotRow], shape: Tuple[int, bool]) -> "Staged":
        rank_bucket, whole = shape
        sizes = [rank_bucket if r.dim is not None else int(whole) for r in rows]
        pieces = [r.piece(n) for r, n in zip(rows, sizes)]
        sent = [p for p in pieces if p is not None]
        buffers, offsets = _pack(sent)
        return Staged(self, shape, tuple(sizes), tuple(None if p is None else (p.dtype, p.shape) for p in pieces),
                      buffers, tuple(offsets), sum(p.numel() * p.element_size() for p in sent))

    def write(self, slot: int, shape: Optional[Tuple[int, bool]] = None, rows=None,
              staged: Optional["Staged"] = None) -> int:
        """Write ``slot`` of every target from the host rows (cut to ``shape``, default their own), or from
        what ``stage`` made of the same rows; return the bytes sent."""
        return self.write_many([slot], shape, None if rows is None else [rows], [staged])

    def write_many(self, slots: Sequence[int], shape: Optional[Tuple[int, bool]] = None, rows=None,
                   staged: Sequence[Optional["Staged"]] = ()) -> int:
        """Write every slot of ``slots`` (distinct) of every target, one transfer and one program per batch;
        return the bytes sent.  Slots whose rows have one shape (their own, or ``shape`` for all) go
        together, in batches of ``BATCH_SIZES`` if ``warm`` compiled those for the shape, else one by one.
        ``rows`` / ``staged``: per slot, as for ``write``."""
        staged = [s if s is not None and s.swap is self else None for s in staged]
        staged += [None] * (len(slots) - len(staged))
        # The host rows are read only where nothing staged stands for them (reading them costs 0.2 ms a swap).
        rows = list(rows) if rows is not None else [None if s is not None else self._rows(n)
                                                    for s, n in zip(staged, slots)]
        groups: Dict[Tuple[int, bool], List[int]] = {}  # shape -> positions in slots
        for i, (s, r) in enumerate(zip(staged, rows)):
            groups.setdefault(shape or (s.shape if s is not None else self.shape_of(r)), []).append(i)
        total = 0
        for group_shape, at in groups.items():
            for i in at:
                if rows[i] is None and staged[i].shape != group_shape:
                    rows[i] = self._rows(slots[i])
            for size in batches(len(at), BATCH_SIZES if group_shape in self._batched else (1,)):
                part, at = at[:size], at[size:]
                total += self._write_batch([slots[i] for i in part], group_shape, [rows[i] for i in part],
                                           [staged[i] for i in part])
        return total

    def _write_batch(self, slots: Sequence[int], shape: Tuple[int, bool], rows, staged) -> int:
        """One program: ``slots`` written from their rows cut to ``shape`` (what was staged with it reused)."""
        staged = [s if s is not None and s.shape == shape else self._staged(r, shape) for s, r in zip(staged, rows)]
        batch, first = len(slots), staged[0]
        runtime = runtimes.for_device(self.device)
        # Each slot's buffer is sent as it was staged (kept for its next swap), not joined with the others on
        # the host: the program joins the pieces of a dtype's buffers, in slot order, as one [batch * length].
        dtypes = tuple(first.buffers)
        sent = runtime.send([s.buffers[d] for d in dtypes for s in staged] + [torch.tensor(list(slots))],
                            self.device)
        # The slot numbers are a device input of the program, not constants of it.
        pieces = [[p for ps in sent[i * batch:(i + 1) * batch] for p in ps] for i in range(len(dtypes))] + sent[-1:]
        joined_shapes = tuple(torch.Size([batch * first.buffers[d].numel()]) for d in dtypes) + (torch.Size([batch]),)
        copies = [t.copy for t in self.targets]
        args = copies + [p for ps in pieces for p in ps]
        key = (shape, batch, first.pieces)
        program = self._programs.get(key)
        if program is None:
            # Every slot's rows have the same parts' shapes (the stacks'): slot 0's give the structure.
            layout = _Layout(batch, dtypes, first.offsets, first.sizes, first.pieces,
                             _structure(self._rows(0)), joined_shapes, tuple(map(len, pieces)))
            write = functools.partial(self._write_program, runtime, layout)
            program = self._programs[key] = runtime.write_program(write, args, range(len(copies)))
        program(*args)
        return sum(s.bytes for s in staged)

    def _write_program(self, runtime, layout: "_Layout", *values: torch.Tensor) -> None:
        """What one batch's program does: the sent pieces joined, cut per plain row, padded back to the
        stacks' widths, and index-copied into every target at the slot numbers sent with them."""
        values = list(values)
        copies, arrived = values[:len(self.targets)], values[len(self.targets):]
        joined = []
        for shape, count in zip(layout.sent, layout.counts):
            joined.append(runtime.joined(arrived[:count], shape))
            arrived = arrived[count:]
        index = joined.pop()
        batch = layout.batch
        # Each slot's buffer has the same layout: slot b's is [b * length, (b + 1) * length) of its dtype's.
        # Cut from the 1-d buffer slot by slot, XLA folds each cut into the stack write that reads it (from the
        # pieces it spans); narrowing a [batch, length] view of it instead made XLA:CPU join every piece first,
        # and a one-slot program at hidden 2048 (11 stacks, 2.39 MB) ran 3.25 ms against 0.55 ms.
        on_device = {d: (t, t.numel() // batch) for d, t in zip(layout.dtypes, joined)}
        full, at = [], iter(layout.offsets)
        for row, size, piece in zip(layout.rows, layout.sizes, layout.pieces):
            if piece is not None:
                dtype, piece_shape = piece
                flat, length = on_device[dtype]
                offset, numel = next(at), piece_shape.numel()
                piece = torch.stack([flat.narrow(0, b * length + offset, numel) for b in range(batch)])
                piece = piece.view(batch, *piece_shape)
            full.append(_padded(row, piece, size, self.device, batch))
        for target, copy in zip(self.targets, copies):
            value = full[target.row]
            # In place on XLA too (the stacks are aliased to the program's outputs): 22 stacks of [N, 16, 512]
            # written in 0.56 ms with N = 8 or 32 (index_put_: 0.79 ms).
            copy.index_copy_(0, index, value.transpose(1, 2) if target.transposed else value)

    def warm(self, batched: bool = False) -> int:
        """Compile every program a swap of these stacks may run: one slot of each shape, or (``batched``)
        batches of several slots of the full-rank shapes, up to the slot count.  Slots 0.. are written
        with their own rows cut to each shape, then once more uncut (they end as they were); return the
        bytes sent."""
        rows = self._rows(0)
        sizes = [n for n in BATCH_SIZES if n <= self.targets[0].copy.shape[0]]
        if batched:
            widest = max(b for b, _ in self.shapes(rows))
            runs = [(shape, n) for shape in self.shapes(rows) if shape[0] == widest for n in sizes[1:]]
        else:
            runs = [(shape, 1) for shape in self.shapes(rows)]
        if batched:
            self._batched = tuple(dict.fromkeys(shape for shape, _ in runs))
        total = sum(self.write_many(list(range(n)), shape) for shape, n in runs)
        return total + (self.write_many(list(range(max(n for _, n in runs)))) if runs else 0)


class _Layout(NamedTuple):
    """What a write program is built for: the number of slots it writes, one slot's staged layout (the same
    for every slot of a shape: ``Staged``), the plain rows' structure, and how the buffers were sent."""

    batch: int
    dtypes: Tuple[torch.dtype, ...]  # the buffers', in the order sent
    offsets: Tuple[int, ...]
    sizes: Tuple[int, ...]
    pieces: tuple
    rows: Tuple[SlotRow, ...]  # the plain rows' parts as meta tensors: shapes and dtypes only
    sent: Tuple[torch.Size, ...]  # per dtype the slots' buffers joined, then the slot numbers: the shape
    counts: Tuple[int, ...]  # and the pieces it arrived in


def _structure(rows: Sequence[SlotRow]) -> Tuple[SlotRow, ...]:
    """``rows`` without their values (a program kept for the pool's life keeps no adapter's rows alive)."""
    return tuple(SlotRow(tuple(torch.empty(p.shape, dtype=p.dtype, device="meta") for p in r.parts), r.dim)
                 for r in rows)


def batches(n: int, sizes: Sequence[int] = BATCH_SIZES) -> List[int]:
    """The program sizes ``n`` swaps are written in: the largest of ``sizes`` that fits, again."""
    out = []
    while n > 0:
        out.append(max(b for b in sizes if b <= n))
        n -= out[-1]
    return out


def _padded(row: SlotRow, piece: Optional[torch.Tensor], size: int, device, batch: int) -> torch.Tensor:
    """``row.full`` for ``batch`` slots at once (``piece``: ``[batch, *sent]``, None when nothing is sent), with
    one op per part (a pad)."""
    if piece is None:
        zeros = row.full(None, size, device)
        return zeros.expand(batch, *zeros.shape)
    if row.dim is None:
        return piece
    dim = row.dim + 1
    parts = [piece] if len(row.parts) == 1 else piece.split([min(size, p.shape[row.dim]) for p in row.parts], dim)
    padded = []
    for got, part in zip(parts, row.parts):
        missing = part.shape[row.dim] - got.shape[dim]
        # F.pad's pairs run from the last dim: (0, missing) pads the last dim, (0, 0, 0, missing) the one before
        padded.append(torch.nn.functional.pad(got, (0, missing) if dim == 2 else (0, 0, 0, missing))
                      if missing else got)
    return padded[0] if len(padded) == 1 else torch.cat(padded, dim)


def _pack(pieces: Iterable[torch.Tensor]) -> Tuple[Dict[torch.dtype, torch.Tensor], List[int]]:
    """The pieces flattened into one host buffer per dtype (one in practice), and each piece's offset in its
    buffer, in order."""
    by_dtype: Dict[torch.dtype, List[torch.Tensor]] = {}
    filled: Dict[torch.dtype, int] = {}
    offsets = []
    for p in pieces:
        by_dtype.setdefault(p.dtype, []).append(p.reshape(-1))
        offsets.append(filled.get(p.dtype, 0))
        filled[p.dtype] = offsets[-1] + p.numel()
    # A new tensor even for one piece: on the CPU the "device" buffer may be this one, and the stacks are
    # written from it.
    return {dtype: _host_cat(flats) for dtype, flats in by_dtype.items()}, offsets


def _host_cat(flats: Sequence[torch.Tensor]) -> torch.Tensor:
    """``torch.cat`` of 1-d host tensors of one dtype, copied by the calling thread alone (numpy's copy, on
    the tensors' bits: numpy has no bfloat16).

    ``torch.cat`` splits a copy of this size over torch's intra-op threads, and a split copy waits until each
    of them gets a core.  Swaps are staged and written while a compiled step keeps XLA's threads on every
    core (the prefetch thread stages during the step): 8 buffers of 0.5 MB joined 40 times next to a running
    XLA program took a median 0.58 ms, 3.2 ms at the 90th percentile and 104 ms at worst with torch's 2
    threads; 0.37 / 0.48 / 0.57 ms on one (2-core CPU)."""
    dtype = flats[0].dtype
    bits = _SAME_SIZE_INT[flats[0].element_size()]
    joined = numpy.concatenate([f.detach().contiguous().view(bits).numpy() for f in flats])
    return torch.from_numpy(joined).view(dtype)


_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


__all__ = ["SlotSwap", "Staged", "Target"]
