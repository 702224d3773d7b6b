"""The sorted kernel (ops_sorted.py): any mapping, tokens ordered by slot on the host into one-slot blocks,
and the backend's choice of it for mappings the row and segment kernels cannot run."""
import pytest
import torch

import xla_lora_pass as xlp
from xla_lora_pass.kernels import table as kernels, masked as ops
from xla_lora_pass.demo_models import eager_reference, tiny_peft_llama
from xla_lora_pass.kernels.sorted_tokens import build_sorted_layout, sorted_blocks, sorted_token_indices

from .helpers import (assert_golden, check_rewrite, compile_lora, count_ops, kernel_op_case, normalize_gm, packed,
                      shrink_expand_counts, two_layer_per_token, ServedLlama)
from .models import peft_two_layer
from .xla_utils import xla_compiles

TARGETS = ServedLlama.TARGETS


def random_mix(choices, n, seed):
    g = torch.Generator().manual_seed(seed)
    return [choices[int(i)] for i in torch.randint(0, len(choices), (n,), generator=g)]


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("mapping", ["random", "segments of 3", "all base"])
def test_sorted_ops_equal_the_per_token_reference(dtype, tol, mapping):
    idx = {"random": random_mix([0, 1, 2, -1], 45, seed=1),
           "segments of 3": packed([(i % 3 if i % 4 else -1, 3) for i in range(15)]),
           "all base": [-1] * 45}[mapping]
    x, a, b, y, idx = kernel_op_case(idx, dtype=dtype)
    layout = build_sorted_layout(idx, block_tokens=8, groups=4)
    assert torch.equal(sorted_token_indices(*layout), idx)
    a_t, b_t = a.transpose(1, 2).contiguous(), b.transpose(1, 2).contiguous()
    got_t = torch.ops.xla_lora.bgmv_shrink_sorted(x, a_t, *layout, 0.5)
    want_t = ops.bgmv_shrink_reference(x, a, idx, 0.5)
    torch.testing.assert_close(got_t.float(), want_t.float(), atol=tol, rtol=tol)
    got = torch.ops.xla_lora.bgmv_expand_sorted(got_t, b_t, y, *layout, True)
    torch.testing.assert_close(got.float(), ops.bgmv_expand_reference(want_t, b, y, idx, True).float(),
                               atol=tol * 10, rtol=tol)
    base = idx < 0
    assert torch.equal(got[base], y[base])  # tokens on the base model: exactly the base output
    delta = torch.ops.xla_lora.bgmv_expand_sorted(got_t, b_t, y, *layout, False)
    torch.testing.assert_close((y + delta).float(), got.float(), atol=tol, rtol=tol)


def test_layout_gives_each_block_one_slot_within_its_static_size():
    idx = torch.tensor(random_mix([0, 1, 2, 3, 4, -1], 100, seed=3), dtype=torch.int32)
    gather, block_slots, inverse = build_sorted_layout(idx, block_tokens=8, groups=6)
    assert block_slots.numel() == sorted_blocks(100, 8, 6) == (100 + 6 * 7) // 8
    assert gather.numel() == block_slots.numel() * 8
    # Every token has one row, read back by that row: the gather and the inverse agree.
    assert sorted(inverse.tolist()) == sorted(set(inverse.tolist())) and torch.equal(gather[inverse.long()],
                                                                                      torch.arange(100).int())
    # Each block's tokens are on the block's slot (the base model's -1 blocks included).
    assert torch.equal(block_slots[inverse.long() // 8], idx)
    # The static size holds for the worst case, every group one token past a whole block: 12 blocks, all used.
    worst = torch.tensor(packed([(s, 9) for s in range(5)] + [(-1, 9)]), dtype=torch.int32)
    assert build_sorted_layout(worst, block_tokens=8, groups=6).block_slots.tolist() == [-1, -1, 0, 0, 1, 1, 2, 2,
                                                                                         3, 3, 4, 4]
    with pytest.raises(ValueError, match="7 distinct slots"):
        build_sorted_layout(torch.arange(-1, 6), block_tokens=8, groups=6)


def test_nan_stays_in_its_token():
    x, a, b, y, idx = kernel_op_case(random_mix([0, 1, 2, -1], 16, seed=2))
    x[3] = float("nan")
    layout = build_sorted_layout(idx, block_tokens=4, groups=4)
    t = torch.ops.xla_lora.bgmv_shrink_sorted(x, a.transpose(1, 2).contiguous(), *layout, 1.0)
    out = torch.ops.xla_lora.bgmv_expand_sorted(t, b.transpose(1, 2).contiguous(), y, *layout, True)
    if idx[3] >= 0:
        assert out[3].isnan().all()
    assert not out[torch.arange(16) != 3].isnan().any()


def test_sorted_rewrite_golden_and_numerics(update_golden, monkeypatch):
    """A flat [T, H] batch (vLLM's layout) mixed per token through the sorted rewrite."""
    monkeypatch.setattr(xlp.config, "kernel", "sorted")
    model = peft_two_layer()
    meta = xlp.LoRAMetadata(max_num_tokens=64)
    meta.register_adapters(model)
    x = torch.randn(48, 16)
    mapping = random_mix(["sql", "chat", None], 48, seed=6)
    reference = two_layer_per_token(model, x, mapping)  # before the mapping is set: the eager guard would refuse
    meta.set_token_adapters(mapping)
    new_gm, _ = check_rewrite(model, [x], meta, rewrites={"lora_linear": 1}, ops=shrink_expand_counts(1, 1),
                              reference=reference, token_dims=(48,))
    assert count_ops(new_gm, torch.ops.xla_lora.bgmv_shrink_sorted.default) == 1
    assert_golden("lora_linear_sorted", normalize_gm(new_gm), update_golden)


def test_sorted_fits_buckets_where_sorting_beats_masking():
    def fits(tokens, slots):
        return kernels.sorted_fits((1, tokens), 16, slots + 1)

    assert fits(512, 16) and fits(512, 4) and fits(128, 3)
    # A decode step's few tokens over many slots, or two slots: block padding outweighs the masked columns.
    assert not fits(8, 16) and not fits(64, 3) and not fits(512, 2)


@pytest.fixture(scope="module")
def served(xla_device):
    torch._dynamo.reset()
    yield ServedLlama(xla_device, rows=4)
    torch._dynamo.reset()


def test_random_mix_and_short_segments_run_the_sorted_kernel_exactly(served):
    s = served
    adapters = ["sql", "chat", "code", None]
    s.run(["sql"] * 8)  # Dynamo's first (static) trace; the [1, T] calls below take its dynamic graph
    for mapping in (random_mix(adapters, 120, seed=1),  # bucket 128, 8 padded tokens
                    packed([(adapters[j % 4], 8) for j in range(15)])):  # segments of 8: 4 slots per 32 tokens
        got, want = s.run(mapping)
        assert (got - want).abs().max().item() < 1e-4
    graph = s.dynamic_graph()
    assert graph.variants["sorted"].programs and "masked" not in graph.variants
    # Other mixes of the same 120 tokens, base-model tokens among them: nothing compiles.
    before = xla_compiles()
    for seed in (2, 3):
        got, want = s.run(random_mix(adapters, 120, seed=seed))
        assert (got - want).abs().max().item() < 1e-4
    got, want = s.run(packed([(adapters[(j + 1) % 4], 8) for j in range(15)]))
    assert (got - want).abs().max().item() < 1e-4
    assert xla_compiles() == before


def test_the_choice_per_mapping(served):
    s = served
    graph = s.dynamic_graph()

    def chosen(mapping, rows=1):
        s.meta.set_token_adapters(mapping)
        n = len(mapping) // rows
        return next(iter(graph.graph_for_call((rows, n), (rows, 128)).kernels), kernels.FALLBACK)

    assert chosen(random_mix(["sql", "chat", "code", None], 120, seed=4)) == "sorted"
    assert chosen(packed([(["sql", "chat", "code"][j % 3], 8) for j in range(15)])) == "sorted"
    assert chosen(packed([(["sql", "chat", "code"][j % 3], 32) for j in range(4)])) == "segments"
    assert chosen(packed([(a, 128) for a in ("sql", "chat")]), rows=2) == "rows"


def test_sorted_rewrite_equals_peft_mixed_batch(device, inner, monkeypatch):
    """The sorted kernel for every call (config.kernel = "sorted") against PEFT's own ``adapter_names=`` batch:
    a row on the base model, and 13 tokens padded to the bucket of 16."""
    monkeypatch.setattr(xlp.config, "kernel", "sorted")
    torch._dynamo.reset()
    model, names = tiny_peft_llama(targets=TARGETS, seed=3)
    cpu_model, _ = tiny_peft_llama(targets=TARGETS, seed=3)
    cpu_model.load_state_dict(model.state_dict())
    meta, backend, compiled = compile_lora(model, device, max_num_tokens=128, inner=inner)
    ids = torch.randint(0, 128, (4, 13), generator=torch.Generator().manual_seed(8))
    rows = ["chat", None, "sql", "code"]
    meta.set_request_adapters(rows)
    with torch.no_grad():
        got = compiled(input_ids=ids.to(device)).logits.cpu()
    want = eager_reference(cpu_model, ids, rows)
    assert (got - want).abs().max().item() < 1e-4
    assert all(g.kernels == {"sorted"} for g in backend.graphs if g.report.sites)
    torch._dynamo.reset()


def test_precompile_warms_the_sorted_kernel_where_mixed_rows_run_it(xla_device):
    torch._dynamo.reset()
    model, names = tiny_peft_llama(num_hidden_layers=1, seed=9)
    ids = torch.randint(0, 128, (1, 128))
    meta, backend, compiled = compile_lora(model, xla_device, 128, buckets=xlp.Buckets.pow2(8, 128))
    warmed = backend.precompile(lambda n: compiled(input_ids=ids[:, :n].to(xla_device)), progress=False)
    # The first trace (2 tokens) and buckets 8..128 twice: the row kernel's program and the one a mixed row
    # runs (sorted at 128 tokens over 3 slots, masked below: kernels.sorted_fits); the size-1 graph once.
    assert warmed == meta.stats["compiles"] == 2 * 1 + 1 + 2 * 5
    graph = next(g for g in reversed(backend.graphs) if g.source is not None)
    assert list(graph.variants["sorted"].programs) and list(graph.variants["masked"].programs)
    for n in (100, 40, 7, 128):
        meta.set_token_adapters(random_mix(["code", "sql", "chat", None], n, seed=n))
        with torch.no_grad():
            compiled(input_ids=ids[:, :n].to(xla_device)).logits.cpu()
    assert meta.stats["compiles"] == warmed
    torch._dynamo.reset()
