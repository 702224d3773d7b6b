"""The kernel table: every BGMV kernel the pass emits, in one place.

One entry per kernel:

* its graph side (``graph_rewrites.KernelSpec``): the shrink/expand ops, the
  weight layout (plain ``[N, R, in]`` / ``[N, out, R]`` or the transposed
  stacks), the per-step graph inputs it adds and, through its ``site_inputs``
  function, to which sites it applies at rewrite (each input is a fixed-size
  buffer the graph narrows to the bucket);
* ``feeds``: the ``LoRAMetadata`` function that feeds each of its inputs;
* ``fits``: per call, whether it is exact for the step's mapping;
* ``params``: its sizes (block lengths), read from a backend's ``Settings``.

How "auto" (the default setting ``kernel``) picks a kernel, told here once:
a graph is rewritten with the first kernel, and each call runs the first
kernel whose ``fits`` accepts the mapping (its rewrite of the same Dynamo
graph made on first need, ``choose``):

1. ``rows`` (rows.py) when every row of the ``[B, S]`` token grid is on one
   adapter (one adapter per request, as PEFT's ``adapter_names=`` and serving
   do; a decode step's rows of one token always are): each row's weights are
   gathered once and only the LoRA's own FLOPs run;
2. ``segments`` (segments.py) when requests are packed as contiguous
   segments of one flat row: no block of ``segment_block_tokens`` tokens
   uses more than ``segment_slots_per_block`` adapters;
3. ``sorted`` (sorted_tokens.py) for any other mapping, when the bucket is
   large enough for sorting the tokens by slot to pay (``sorted_fits``);
4. ``masked`` (masked.py), the fallback: every token times every slot's
   columns, then a select; exact for any mapping at N times the LoRA FLOPs,
   and the kernel of every site the others do not apply to.

Results never depend on the choice, only cost does.  A setting naming one
kernel rewrites with it and runs it for every call.  Rewrite, backend,
fusion and the tests read this table; a new kernel is its ops file
(``common.define_kernel_ops``) and one entry here (docs/kernels.md, "Adding
a kernel").
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from graph_rewrites import STACKED_A, STACKED_B, STACKED_BIAS, STACKED_DORA, TOKEN_INDICES
from graph_rewrites.annotations import (POOLED_ROW_SLOTS, ROW_SLOTS, SAVED_MODULE_PARAM, SEGMENT_BLOCK_SLOTS,
                                        SEGMENT_PICK, SORTED_BLOCK_SLOTS, SORTED_GATHER, SORTED_INVERSE, STACKED_A_T,
                                        STACKED_B_T, GraphInputRequest)
from graph_rewrites.kernel_spec import KernelSpec
from graph_rewrites.site_inputs import site_row_slots, site_segment_layout, site_sorted_layout

# Imported to register the torch.ops.xla_lora ops the specs name.
from . import masked, rows, segments, sorted_tokens  # noqa: F401
from .common import DECOMPOSITIONS
from ..config import Settings
from ..errors import UnsupportedMappingError
from ..metadata.lora_metadata import LoRAMetadata
from .segments import build_segment_layout
from .sorted_tokens import build_sorted_layout, sorted_blocks, sorted_buffers

# (meta, request, device, real token dims, padded token dims) -> the tensor for one added placeholder.
Feed = Callable[[LoRAMetadata, GraphInputRequest, torch.device, tuple, tuple], torch.Tensor]
# (meta, the kernel's params, real dims, padded dims) -> whether it runs this call's mapping (exact, and worth it).
Fits = Callable[[LoRAMetadata, Tuple[int, ...], tuple, tuple], bool]


@dataclasses.dataclass(frozen=True)
class Kernel:
    """One entry of the table."""

    spec: KernelSpec
    feeds: Dict[str, Feed]  # one per kind in spec.input_kinds
    fits: Optional[Fits] = None  # None: exact for any mapping (the fallback)
    params: Callable[[Settings], Tuple[int, ...]] = lambda settings: ()  # spec.params from a backend's settings


def segments_fit(meta: LoRAMetadata, real, padded, block_tokens: int, slots_per_block: int) -> bool:
    """Whether the segment kernel can run this mapping: no block of ``block_tokens`` consecutive (padded)
    tokens uses more than ``slots_per_block`` slots.  True for requests packed as contiguous segments of at
    least ``block_tokens`` tokens each (with 2 passes per block).  Built once per mapping and bucket."""
    return _host_segments(meta, real, padded, block_tokens, slots_per_block) is not None


def segment_inputs(meta: LoRAMetadata, device, real, padded, block_tokens: int,
                   slots_per_block: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """The segment kernel's (block_slots, pick) on ``device`` for this step (kernels/segments.py), shared by every
    site.  Refused when the mapping does not fit (``segments_fit``): the kernel would give a token another
    token's adapter."""
    def build(_grid):
        layout = _host_segments(meta, real, padded, block_tokens, slots_per_block)
        if layout is None:
            raise UnsupportedMappingError(
                f"the mapping uses more than {slots_per_block} adapters in some block of {block_tokens} "
                f"consecutive tokens (token dims {list(real)}): a graph rewritten with the segment kernel cannot "
                "run it (the backend switches to the sorted or masked kernel; rewrite(..., kernel='sorted') does "
                "the same for a graph rewritten by hand)")
        return tuple(t.to(device) for t in segments.segment_buffers(layout, block_tokens, meta.max_num_tokens))
    return meta.step_value(("segment_inputs", str(device), block_tokens, slots_per_block), real, padded, build)


def _host_segments(meta: LoRAMetadata, real, padded, block_tokens: int, slots_per_block: int):
    return meta.step_value(("segments", block_tokens, slots_per_block), real, padded,
                           lambda grid: build_segment_layout(grid, block_tokens, slots_per_block))


def sorted_fits(padded, block_tokens: int, groups: int) -> bool:
    """Whether the sorted kernel is worth running for a bucket of ``padded`` token dims: its sorted rows
    (the tokens, each slot's padded to whole blocks) at most half the masked kernel's N rows per token.  It is
    exact for any mapping; this keeps small buckets (a decode step's few tokens) on the masked kernel, whose
    block padding would outweigh the work."""
    tokens = math.prod(int(d) for d in padded)
    return 2 * sorted_blocks(tokens, block_tokens, groups) * block_tokens <= tokens * (groups - 1)


def sorted_inputs(meta: LoRAMetadata, device, real, padded, block_tokens: int,
                  groups: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The sorted kernel's (gather, block_slots, inverse) on ``device`` for this step (kernels/sorted_tokens.py), shared by
    every site, in buffers sized for ``meta.max_num_tokens``."""
    max_blocks = sorted_blocks(meta.max_num_tokens, block_tokens, groups)

    def build(grid):
        layout = build_sorted_layout(grid, block_tokens, groups)
        return tuple(t.to(device) for t in sorted_buffers(layout, block_tokens, max_blocks, meta.max_num_tokens))
    return meta.step_value(("sorted_inputs", str(device), block_tokens, groups), real, padded, build)


def _nth_input(inputs: Callable, i: int) -> Feed:
    """The feed of a kernel's i-th per-step input, from its ``inputs(meta, device, real, padded, *req.blocks)``,
    which builds them all once per step."""
    return lambda meta, req, device, real, padded: inputs(meta, device, real, padded, *req.blocks)[i]


KERNELS: Dict[str, Kernel] = {
    # One adapter per row of the [B, S] token grid (kernels/rows.py).
    "rows": Kernel(
        KernelSpec("rows", "bgmv_shrink_rows", "bgmv_expand_rows", transposed=True, site_inputs=site_row_slots,
                   input_kinds=(ROW_SLOTS,)),
        feeds={ROW_SLOTS: lambda meta, req, device, real, padded: meta.row_slots(device, real, padded)},
        fits=lambda meta, params, real, padded: meta.rows_uniform(real),
        params=lambda settings: (settings.row_kernel_min_tokens,)),
    # Requests packed as contiguous segments of the flattened tokens (kernels/segments.py).
    "segments": Kernel(
        KernelSpec("segments", "bgmv_shrink_segments", "bgmv_expand_segments", transposed=True,
                   site_inputs=site_segment_layout, input_kinds=(SEGMENT_BLOCK_SLOTS, SEGMENT_PICK)),
        feeds={SEGMENT_BLOCK_SLOTS: _nth_input(segment_inputs, 0), SEGMENT_PICK: _nth_input(segment_inputs, 1)},
        fits=lambda meta, params, real, padded: segments_fit(meta, real, padded, *params),
        params=lambda settings: (settings.segment_block_tokens, settings.segment_slots_per_block)),
    # Any mapping, the tokens ordered by slot on the host into blocks of one slot each (kernels/sorted_tokens.py).
    "sorted": Kernel(
        KernelSpec("sorted", "bgmv_shrink_sorted", "bgmv_expand_sorted", transposed=True,
                   site_inputs=site_sorted_layout, input_kinds=(SORTED_GATHER, SORTED_BLOCK_SLOTS, SORTED_INVERSE)),
        feeds={SORTED_GATHER: _nth_input(sorted_inputs, 0), SORTED_BLOCK_SLOTS: _nth_input(sorted_inputs, 1),
               SORTED_INVERSE: _nth_input(sorted_inputs, 2)},
        fits=lambda meta, params, real, padded: sorted_fits(padded, params[0], meta.num_slots + 1),
        params=lambda settings: (settings.sorted_block_tokens,)),
    # Every token times every slot's columns, then a select (kernels/masked.py): any mapping.
    "masked": Kernel(KernelSpec("masked", "bgmv_shrink", "bgmv_expand", transposed=False), feeds={}),
}

AUTO = "auto"
# Where a mapping that mixes adapters within a row starts, past the kernels that need a shape of mapping:
# precompile warms it (and, for buckets it does not fit, what it falls to) for such mappings.
MIXED = "sorted"
FIRST = next(iter(KERNELS))  # the kernel "auto" rewrites with
FALLBACK = list(KERNELS)[-1]
# Settings.kernel: "auto", or one kernel for every call.  Not the first alone: it is exact only for the
# mappings its ``fits`` accepts, so it runs under "auto", which falls back for the others.
CHOICES = (AUTO,) + tuple(KERNELS)[1:]
# Every kernel's spec as the table declares it (params unbound): for counting ops in a graph, by op name.
SPECS: Tuple[KernelSpec, ...] = tuple(k.spec for k in KERNELS.values())

# Inputs of any graph whatever its kernels: the token indices, the weight stacks in both layouts, LoRA bias,
# DoRA, and saved modules' tensors.
_SHARED_FEEDS: Dict[str, Feed] = {
    TOKEN_INDICES: lambda meta, req, device, real, padded: meta.token_indices(device, real, padded),
    POOLED_ROW_SLOTS: lambda meta, req, device, real, padded: meta.row_slots(device, real, padded, pooled=True),
    SAVED_MODULE_PARAM: lambda meta, req, device, real, padded: meta.saved_tensor(req.site, *req.param, device),
    STACKED_A: lambda meta, req, device, real, padded: meta.stacked_a(req.site, device),
    STACKED_B: lambda meta, req, device, real, padded: meta.stacked_b(req.site, device),
    STACKED_A_T: lambda meta, req, device, real, padded: meta.stacked_a(req.site, device, transposed=True),
    STACKED_B_T: lambda meta, req, device, real, padded: meta.stacked_b(req.site, device, transposed=True),
    STACKED_BIAS: lambda meta, req, device, real, padded: meta.stacked_bias(req.site, device),
    STACKED_DORA: lambda meta, req, device, real, padded: meta.stacked_dora(req.site, device),
}
FEEDS: Dict[str, Feed] = {**_SHARED_FEEDS, **{kind: f for k in KERNELS.values() for kind, f in k.feeds.items()}}


def decompositions() -> Dict:
    """Every ``torch.ops.xla_lora`` op's ATen decomposition (its implementation), by op overload: for a
    compiler to trace the ops into the ATen ops they run (backend/static_programs.py, inductor)."""
    return dict(DECOMPOSITIONS)


def bound_specs(settings: Settings) -> Tuple[KernelSpec, ...]:
    """Every kernel's spec in table order, with its params read from ``settings``: what a rewrite emits."""
    return tuple(dataclasses.replace(k.spec, params=k.params(settings)) for k in KERNELS.values())


def rewrite_kernel(name: str, settings: Settings) -> KernelSpec:
    """The spec a rewrite with kernel ``name`` emits ("auto": the first kernel's); a clear error for an unknown
    name."""
    if name not in CHOICES:
        raise ValueError(f"unknown kernel {name!r}: expected one of {CHOICES}")
    return bound_specs(settings)[list(KERNELS).index(FIRST if name == AUTO else name)]


# Inputs that are device copies of the adapter stacks: the same tensors until meta.stacks_generation changes.
STACK_KINDS = frozenset({STACKED_A, STACKED_B, STACKED_A_T, STACKED_B_T, STACKED_BIAS, STACKED_DORA})


def _feed(req: GraphInputRequest) -> Feed:
    feed = FEEDS.get(req.kind)
    if feed is None:
        raise AssertionError(f"no feed for graph input request {req}: add it to a kernel's feeds")
    return feed


def lora_graph_inputs(meta: LoRAMetadata, requests: Sequence[GraphInputRequest], device, token_dims,
                      padded_dims) -> List[torch.Tensor]:
    """The tensors for a rewritten graph's added placeholders, in their order."""
    return [_feed(req)(meta, req, device, token_dims, padded_dims) for req in requests]


class GraphInputs:
    """``lora_graph_inputs`` for one graph's requests, called every step: the stacks (most of the inputs,
    one per site) are looked up once per device and ``meta.stacks_generation``, not once per call; the
    per-step values (token indices, row slots, saved modules' live tensors) every call."""

    def __init__(self, requests: Sequence[GraphInputRequest]):
        self.requests = list(requests)
        self._stacks_key = None
        self._stacks: Dict[int, torch.Tensor] = {}

    def __call__(self, meta: LoRAMetadata, device, token_dims, padded_dims) -> List[torch.Tensor]:
        key = (str(device), meta.stacks_generation)
        if key != self._stacks_key:
            with meta.sending_stacks(device):  # a swap then writes all of them in one program
                self._stacks = {i: _feed(req)(meta, req, device, None, None)
                                for i, req in enumerate(self.requests) if req.kind in STACK_KINDS}
            self._stacks_key = key
        return [self._stacks[i] if i in self._stacks else _feed(req)(meta, req, device, token_dims, padded_dims)
                for i, req in enumerate(self.requests)]


def kernel_request(requests: Sequence[GraphInputRequest], name: str) -> Optional[GraphInputRequest]:
    """The first of ``requests`` that is an input of kernel ``name`` (None: no site runs that kernel)."""
    kinds = KERNELS[name].spec.input_kinds
    return next((r for r in requests if r.kind in kinds), None)


def kernels_run(requests: Sequence[GraphInputRequest]) -> frozenset:
    """Names of the kernels with inputs among ``requests``, besides the fallback (which every graph may run)."""
    return frozenset(name for name in KERNELS if kernel_request(requests, name) is not None)


def choose(meta: LoRAMetadata, requests_of: Callable[[str], Sequence[GraphInputRequest]], token_dims,
           padded_dims, settings: Settings, start: Optional[str] = None) -> str:
    """The per-call choice: the first kernel whose ``fits`` accepts the mapping and whose rewrite runs it.

    ``fits`` is asked first, with the kernel's params from ``settings``:
    ``requests_of(name)``, the graph inputs of the rewrite with kernel
    ``name``, makes that rewrite on first need, so only a kernel that fits
    gets one.  The fallback when none fits.  ``start``: consider the table
    from that kernel on (precompile warms what a kernel falls to for a bucket
    it does not fit).
    """
    names = list(KERNELS)
    for name in names[names.index(start) if start is not None else 0:]:
        kernel = KERNELS[name]
        if kernel.fits is None:
            break
        if kernel.fits(meta, kernel.params(settings), token_dims, padded_dims) \
                and kernel_request(requests_of(name), name) is not None:
            return name
    return FALLBACK
