"""The kernel table (xla_lora_pass/kernels/table.py) and the op registration every kernel goes through."""
import dataclasses

import pytest
import torch

import xla_lora_pass  # noqa: F401  (registers torch.ops.xla_lora)
from xla_lora_pass import config
from xla_lora_pass.kernels import table as kernels
from xla_lora_pass.kernels.common import bgmv_shrink_reference


def test_every_entry_is_complete():
    """Ops registered, a feed per input kind; only the last entry (the fallback) serves any site and mapping."""
    entries = list(kernels.KERNELS.values())
    for kernel in entries:
        spec = kernel.spec
        assert spec.shrink_op is not None and spec.expand_op is not None, spec.name
        assert set(kernel.feeds) == set(spec.input_kinds), spec.name
        assert all(kind in kernels.FEEDS for kind in spec.weight_kinds), spec.name
    for kernel in entries[:-1]:
        assert kernel.fits is not None and kernel.spec.site_inputs is not None, kernel.spec.name
    assert entries[-1].fits is None and entries[-1].spec.site_inputs is None
    assert kernels.FALLBACK == entries[-1].spec.name and kernels.FIRST == entries[0].spec.name


def test_rewrite_kernel_names_the_choices():
    settings = config.snapshot(segment_block_tokens=64)
    first = kernels.KERNELS[kernels.FIRST].spec
    assert kernels.rewrite_kernel("auto", settings) == dataclasses.replace(
        first, params=(settings.row_kernel_min_tokens,))
    assert kernels.rewrite_kernel(kernels.FALLBACK, settings) == kernels.KERNELS[kernels.FALLBACK].spec
    # Each kernel's sizes come from the settings it is bound with, not from the module at call time.
    assert kernels.rewrite_kernel("segments", settings).params == (64, settings.segment_slots_per_block)
    # The first kernel is exact only for some mappings: it runs under "auto", which falls back for the rest.
    for bad in ("blocked", kernels.FIRST):
        with pytest.raises(ValueError, match="expected one of"):
            kernels.rewrite_kernel(bad, settings)


class _Mapping:
    """Stands for what LoRAMetadata answers the per-call choice: rows_uniform, and the segment layout."""

    def __init__(self, rows_uniform: bool, segments_fit: bool):
        self._rows, self._segments = rows_uniform, segments_fit
        self.asked = []
        self.num_slots = 1  # the sorted kernel sizes its blocks for the slots and the base

    def rows_uniform(self, real):
        self.asked.append("rows")
        return self._rows

    def step_value(self, key, real, padded, build):
        self.asked.append(key)  # the segment kernel's layout, ("segments", block_tokens, slots_per_block)
        return object() if self._segments else None


def _requests(name):
    from graph_rewrites.annotations import GraphInputRequest

    kinds = kernels.KERNELS[name].spec.input_kinds
    return [GraphInputRequest(kind, None, (8,), blocks=(32, 2)) for kind in kinds]


@pytest.mark.parametrize("rows, segments, want", [(True, True, "rows"), (False, True, "segments"),
                                                  (False, False, "masked")])
def test_choose_takes_the_first_kernel_that_fits(rows, segments, want):
    meta = _Mapping(rows, segments)
    assert kernels.choose(meta, _requests, (1, 64), (1, 64), config.snapshot()) == want
    if want != "rows":  # the segment kernel is asked with the blocks its rewrite is made for
        assert ("segments", 32, 2) in meta.asked


def test_choose_skips_a_kernel_whose_rewrite_has_no_site_on_it():
    meta = _Mapping(True, True)
    assert kernels.choose(meta, lambda name: [], (1, 64), (1, 64), config.snapshot()) == kernels.FALLBACK


def test_choose_asks_fits_before_it_makes_a_rewrite():
    """A rewrite with another kernel is made (``requests_of``) only for a kernel whose ``fits`` accepts."""
    meta, made = _Mapping(False, False), []

    def requests_of(name):
        made.append(name)
        return _requests(name)
    assert kernels.choose(meta, requests_of, (1, 64), (1, 64), config.snapshot()) == kernels.FALLBACK
    assert made == [] and "rows" in meta.asked


def test_registered_ops_fill_in_their_defaults():
    """Ops defined with an explicit schema get only the arguments given; the defaults are the helper's."""
    g = torch.Generator().manual_seed(0)
    x, a = torch.randn(6, 8, generator=g), torch.randn(3, 4, 8, generator=g)
    idx = torch.tensor([0, 2, -1, 1, 1, 0], dtype=torch.int32)
    torch.testing.assert_close(torch.ops.xla_lora.bgmv_shrink(x, a, idx), bgmv_shrink_reference(x, a, idx))
    torch.testing.assert_close(torch.ops.xla_lora.bgmv_shrink(x, a, idx, 0.5), bgmv_shrink_reference(x, a, idx, 0.5))
    row_slots = torch.tensor([2, -1], dtype=torch.int32)
    t = torch.ops.xla_lora.bgmv_shrink_rows(x, a.transpose(1, 2).contiguous(), row_slots)
    b_t = torch.randn(3, 4, 5, generator=g)
    y = torch.randn(6, 5, generator=g)
    with_y = torch.ops.xla_lora.bgmv_expand_rows(t, b_t, y, row_slots)
    delta = torch.ops.xla_lora.bgmv_expand_rows(t, b_t, y, row_slots, False)
    torch.testing.assert_close(with_y, y + delta)
    torch.testing.assert_close(t, bgmv_shrink_reference(x, a, row_slots.repeat_interleave(3)))
