"""The segment kernel (ops_segments.py): requests packed as contiguous segments of one token row, and the
backend's per-call choice between the row, segment and masked kernels."""
import pytest
import torch

import xla_lora_pass as xlp
from xla_lora_pass.kernels import table as kernels, masked as ops
from xla_lora_pass.kernels.segments import build_segment_layout, segment_token_indices

from .helpers import (assert_golden, check_rewrite, compile_lora, count_ops, kernel_op_case, normalize_gm, packed,
                      shrink_expand_counts, two_layer_per_token, ServedLlama)
from .models import peft_two_layer
from .xla_utils import xla_compiles


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_segment_ops_equal_the_per_token_reference(dtype, tol):
    # Segments at any offset, a base-model segment, 45 tokens in blocks of 8 (6 blocks of 8, the last padded).
    idx = packed([(2, 11), (-1, 8), (0, 9), (1, 14), (2, 3)])
    x, a, b, y, idx = kernel_op_case(idx, dtype=dtype)
    layout = build_segment_layout(idx, block_tokens=8, slots_per_block=2)
    assert layout is not None and torch.equal(segment_token_indices(*layout), idx)
    a_t, b_t = a.transpose(1, 2).contiguous(), b.transpose(1, 2).contiguous()
    got_t = torch.ops.xla_lora.bgmv_shrink_segments(x, a_t, *layout, 0.5)
    want_t = ops.bgmv_shrink_reference(x, a, idx, 0.5)
    torch.testing.assert_close(got_t.float(), want_t.float(), atol=tol, rtol=tol)
    got = torch.ops.xla_lora.bgmv_expand_segments(got_t, b_t, y, *layout, True)
    torch.testing.assert_close(got.float(), ops.bgmv_expand_reference(want_t, b, y, idx, True).float(),
                               atol=tol * 10, rtol=tol)
    assert torch.equal(got[11:19], y[11:19])  # the base-model segment: exactly the base output
    delta = torch.ops.xla_lora.bgmv_expand_segments(got_t, b_t, y, *layout, False)
    torch.testing.assert_close((y + delta).float(), got.float(), atol=tol, rtol=tol)


def test_layout_fits_only_blocks_within_their_passes():
    three_in_a_block = packed([(0, 3), (1, 3), (2, 2)])  # one block of 8 tokens on 3 slots
    assert build_segment_layout(three_in_a_block, block_tokens=8, slots_per_block=2) is None
    assert build_segment_layout(three_in_a_block, block_tokens=8, slots_per_block=3) is not None
    # -1 tokens take no pass; a slot used twice in one block (not contiguous) takes one pass.
    layout = build_segment_layout([0, -1, 1, 0, -1, 1, 0, 0], block_tokens=8, slots_per_block=2)
    assert layout.block_slots.tolist() == [[0, 1]] and layout.pick.tolist() == [0, -1, 1, 0, -1, 1, 0, 0]
    # Every segment of at least one block fits 2 passes, wherever it starts.
    lengths = [32, 33, 40, 31 + 32, 32, 95]
    slots = [i % 5 for i in range(len(lengths))]
    assert build_segment_layout(packed(zip(slots, lengths)), block_tokens=32, slots_per_block=2) is not None


def test_nan_stays_in_its_token():
    x, a, b, y, idx = kernel_op_case(packed([(0, 5), (1, 11)]))
    x[3] = float("nan")
    layout = build_segment_layout(idx, block_tokens=8, slots_per_block=2)
    t = torch.ops.xla_lora.bgmv_shrink_segments(x, a.transpose(1, 2).contiguous(), *layout, 1.0)
    out = torch.ops.xla_lora.bgmv_expand_segments(t, b.transpose(1, 2).contiguous(), y, *layout, True)
    assert out[3].isnan().all() and not out[torch.arange(16) != 3].isnan().any()


def test_segment_rewrite_golden_and_numerics(update_golden, monkeypatch):
    """A flat [T, H] batch (vLLM's layout) of packed requests through the segment rewrite."""
    monkeypatch.setattr(xlp.config, "kernel", "segments")
    model = peft_two_layer()
    meta = xlp.LoRAMetadata(max_num_tokens=64)
    meta.register_adapters(model)
    x = torch.randn(48, 16)
    mapping = packed([("sql", 20), (None, 12), ("chat", 16)])
    reference = two_layer_per_token(model, x, mapping)  # before the mapping is set: the eager guard would refuse
    meta.set_token_adapters(mapping)
    new_gm, _ = check_rewrite(model, [x], meta, rewrites={"lora_linear": 1}, ops=shrink_expand_counts(1, 1),
                              reference=reference, token_dims=(48,))
    assert count_ops(new_gm, torch.ops.xla_lora.bgmv_shrink_segments.default) == 1
    assert_golden("lora_linear_segments", normalize_gm(new_gm), update_golden)


@pytest.fixture(scope="module")
def served(xla_device):
    torch._dynamo.reset()
    yield ServedLlama(xla_device, rows=1)
    torch._dynamo.reset()


def test_packed_requests_run_the_segment_kernel_exactly(served):
    s = served
    for mapping in (packed([("sql", 40), ("chat", 33), (None, 23)]),  # Dynamo's first (static) trace
                    packed([("chat", 37), ("code", 32), ("sql", 50), (None, 1)])):  # dynamic, bucket 128
        got, want = s.run(mapping)
        assert (got - want).abs().max().item() < 1e-4
    graph = s.dynamic_graph()
    assert "segments" in graph.variants and "masked" not in graph.variants
    assert graph.variants["segments"].programs and not graph.programs
    # Another segment layout of the same 120 tokens: other lengths, offsets and adapters; nothing compiles.
    # (Another token count in the bucket compiles the slice of the logits back to it, whatever the kernel.)
    before = xla_compiles()
    for mapping in (packed([("code", 64), ("sql", 33), ("chat", 23)]),
                    packed([(None, 35), ("chat", 45), ("sql", 32), ("code", 8)])):
        got, want = s.run(mapping)
        assert (got - want).abs().max().item() < 1e-4
    assert xla_compiles() == before


def test_a_mapping_that_is_not_segments_runs_the_sorted_kernel(served):
    s = served
    g = torch.Generator().manual_seed(9)
    mixed = [["sql", "chat", "code", None][int(i)] for i in torch.randint(0, 4, (120,), generator=g)]
    segments_before = len(s.dynamic_graph().variants["segments"].programs)
    got, want = s.run(mixed)
    assert not kernels.segments_fit(s.meta, (1, 120), (1, 128), 32, 2)
    assert (got - want).abs().max().item() < 1e-4
    graph = s.dynamic_graph()
    assert graph.variants["sorted"].programs and "masked" not in graph.variants
    assert len(graph.variants["segments"].programs) == segments_before
    # The metadata refuses the segment layout outright: a hand-rewritten graph cannot misuse it.
    with pytest.raises(xlp.UnsupportedMappingError, match="more than 2 adapters"):
        kernels.segment_inputs(s.meta, "cpu", (1, 120), (1, 128), 32, 2)


def test_flat_token_batches_switch_from_masked_to_segments(device, inner):
    """vLLM's [T, H] layout: the "auto" rewrite is masked (no rows), packed requests run the segment kernel."""
    torch._dynamo.reset()
    model = peft_two_layer()
    x = torch.randn(100, 16)
    mapping = packed([("sql", 40), (None, 27), ("chat", 33)])
    want = two_layer_per_token(model, x, mapping)
    meta, backend, compiled = compile_lora(model, device, max_num_tokens=128, inner=inner)
    meta.set_token_adapters(mapping)
    with torch.no_grad():
        got = compiled(x.to(device)).cpu()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    graph, = backend.graphs
    assert "rows" not in graph.kernels and graph.variants["segments"].programs and not graph.programs
    torch._dynamo.reset()
