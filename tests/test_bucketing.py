"""Issue 3: shape bucketing keeps a stream of token counts to a handful of programs."""
import random

import pytest
import torch

import xla_lora_pass as xlp
from xla_lora_pass.demo_models import eager_reference, per_sequence_mapping, tiny_peft_llama

from .helpers import compile_lora
from .models import peft_two_layer
from .xla_utils import device_compiles


# ---------------------------------------------------------------- policies
def test_pow2_buckets_and_padding():
    b = xlp.Buckets.pow2(min=8, max=512)
    assert list(b) == [8, 16, 32, 64, 128, 256, 512]
    assert [b.pad(n) for n in (1, 8, 9, 100, 512)] == [8, 8, 16, 128, 512]
    assert b.waste(9) == pytest.approx(7 / 16)
    assert b.table()[1] == (16, 9, pytest.approx(1 - 9 / 16))
    assert list(xlp.Buckets.pow2(min=5, max=40)) == [8, 16, 32, 40]


def test_pow2_then_gap_is_linear_above_the_gap():
    b = xlp.Buckets.pow2_then_gap(min=8, gap=128, max=640)
    assert list(b) == [8, 16, 32, 64, 128, 256, 384, 512, 640]
    assert b.pad(129) == 256 and b.pad(300) == 384
    assert list(xlp.Buckets.pow2_then_gap(min=8, gap=128, max=48)) == [8, 16, 32, 48]  # never past max


def test_size_above_the_largest_bucket_names_size_and_limit():
    with pytest.raises(ValueError, match="size 513 exceeds the largest bucket 512"):
        xlp.Buckets.pow2(8, 512).pad(513)
    with pytest.raises(ValueError, match="1 <= min <= max"):
        xlp.Buckets.pow2(min=16, max=8)


def test_a_cache_length_past_the_largest_bucket_takes_the_next_power_of_two():
    b = xlp.Buckets([8, 16, 24])
    assert [b.pad_length(n) for n in (1, 9, 24, 25, 40, 64, 65)] == [8, 16, 24, 32, 64, 64, 128]
    with pytest.raises(ValueError, match="a cache length must be >= 1, got 0"):
        b.pad_length(0)


# ------------------------------------------------------------- the stream
@pytest.fixture(scope="module")
def llama():
    torch._dynamo.reset()
    model, names = tiny_peft_llama(num_hidden_layers=1)
    ids = torch.randint(0, 128, (1, 600), generator=torch.Generator().manual_seed(0))
    return model, names, ids


def test_stream_of_every_token_count_compiles_once_per_bucket(llama, device, inner):
    model, names, ids = llama
    lengths = list(range(1, 513))
    random.Random(0).shuffle(lengths)
    adapters = [names[i % 3] for i in range(len(lengths))]
    references = [eager_reference(model, ids[:, :n], [a]) for n, a in zip(lengths, adapters)]
    meta, backend, compiled = compile_lora(model, device, 512, buckets=xlp.Buckets.pow2(min=8, max=512), inner=inner)
    worst = 0.0
    for step, (n, adapter, ref) in enumerate(zip(lengths, adapters, references)):
        meta.set_token_adapters([adapter] * n)  # a new mapping every call
        if step == 300:  # and new weights in a slot mid-stream
            meta.load_adapter(adapter, _slot_state(model, adapter), scaling=_scaling(model, adapter))
        with torch.no_grad():
            out = compiled(input_ids=ids[:, :n].to(device)).logits.cpu()
        worst = max(worst, (out - ref).abs().max().item())
    model.cpu()
    assert worst < 1e-4, worst
    bucketed = [g for g in backend.graphs if g.shapes.padded_symbols]
    static = [g for g in backend.graphs if not g.shapes.padded_symbols]
    assert len(bucketed) == 1 and len(bucketed[0].programs) <= 7
    assert len(static) <= 2  # Dynamo's first trace and its size-1 specialization
    assert meta.stats["compiles"] == len(bucketed[0].programs) + len(static) <= 9
    hits = meta.stats["bucket_hits"]
    assert sum(hits.values()) == 512
    assert 0 < meta.stats["padded_token_fraction"] < 0.5


def _slot_state(model, adapter):
    """The adapter's own weights as a PEFT-style state dict (a reload that changes nothing)."""
    state = {}
    for name, module in model.named_modules():
        if hasattr(module, "lora_A") and adapter in module.lora_A:
            state[f"{name}.lora_A.weight"] = module.lora_A[adapter].weight.detach().cpu()
            state[f"{name}.lora_B.weight"] = module.lora_B[adapter].weight.detach().cpu()
    return state


def _scaling(model, adapter):
    return next(m.scaling[adapter] for m in model.modules() if isinstance(getattr(m, "scaling", None), dict)
                and adapter in m.scaling)


def test_greedy_generation_of_64_tokens_compiles_at_most_5_programs(device, inner):
    torch._dynamo.reset()
    model, names = tiny_peft_llama(num_hidden_layers=1, seed=3)
    prompt = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(1))
    rows = ["chat", None]

    def generate(step_fn, ids):
        for _ in range(64):
            logits = step_fn(ids)
            ids = torch.cat([ids, logits[:, -1].argmax(-1, keepdim=True).cpu()], dim=1)
        return ids

    with torch.no_grad():
        expected = generate(lambda ids: eager_reference(model, ids, rows), prompt)
    model.to(device)
    meta = xlp.LoRAMetadata(max_num_tokens=512)
    meta.register_adapters(model)
    compiled = torch.compile(model, backend=xlp.make_backend(meta, buckets=xlp.Buckets.pow2(8, 256), inner=inner))

    def step(ids):
        meta.set_token_adapters(per_sequence_mapping(rows, ids.shape[1]))
        with torch.no_grad():
            return compiled(input_ids=ids.to(device), use_cache=False).logits.cpu()

    got = generate(step, prompt)
    model.cpu()
    assert torch.equal(got, expected)
    assert meta.stats["compiles"] <= 5, meta.stats


def test_batch_and_sequence_are_both_bucketed(device, inner):
    torch._dynamo.reset()
    model, names = tiny_peft_llama(num_hidden_layers=1, seed=5)
    shapes = [(2, 5), (3, 7), (4, 9), (5, 3), (3, 12), (2, 16)]
    rows_for = {b: [names[i % 3] if i % 4 != 3 else None for i in range(b)] for b in range(1, 6)}
    inputs = {s: torch.randint(0, 128, s, generator=torch.Generator().manual_seed(sum(s))) for s in shapes}
    refs = {s: eager_reference(model, inputs[s], rows_for[s[0]]) for s in shapes}
    meta, backend, compiled = compile_lora(model, device, 256, buckets=xlp.Buckets.pow2(8, 64), inner=inner)
    for s in shapes:
        meta.set_token_adapters(per_sequence_mapping(rows_for[s[0]], s[1]))
        with torch.no_grad():
            out = compiled(input_ids=inputs[s].to(device)).logits.cpu()
        assert (out - refs[s]).abs().max().item() < 1e-4, s
    model.cpu()
    [dynamic] = [g for g in backend.graphs if g.shapes.padded_symbols]
    assert len(dynamic.shapes.padded_symbols) == 2
    # (3,7) (4,9) (5,3) (3,12) (2,16) -> batch 4/4/8/4/2, sequence 8/16/8/16/16
    # Program keys name every size symbol; read them back as padded (batch, sequence).
    batch, seq = (str(d) for d in dynamic.shapes.token_layout)
    assert {(dict(k)[batch], dict(k)[seq]) for k in dynamic.programs} == {(4, 8), (4, 16), (8, 8), (2, 16)}
    assert len(dynamic.programs) == 4


class _FlatTokens(torch.nn.Module):
    """vLLM layout: the model sees flattened tokens [T, D], no batch dim."""

    def __init__(self):
        super().__init__()
        self.inner = peft_two_layer()

    def forward(self, hidden):
        return self.inner(hidden)


def test_flattened_token_layout_is_bucketed(device, inner):
    torch._dynamo.reset()
    model = _FlatTokens().eval()
    xs = {t: torch.randn(t, 16, generator=torch.Generator().manual_seed(t)) for t in (3, 5, 9, 13, 17, 30)}
    mappings = {t: [("sql", "chat", None)[i % 3] for i in range(t)] for t in xs}
    refs = {}
    for t, x in xs.items():
        rows = mappings[t]
        refs[t] = torch.stack([
            model.inner(x[i:i + 1], adapter_names=["__base__" if r is None else r])[0] for i, r in enumerate(rows)
        ]).detach()
    meta, backend, compiled = compile_lora(model, device, 64, buckets=xlp.Buckets.pow2(8, 64), inner=inner)
    compiles_before = None
    for t, x in xs.items():
        meta.set_token_adapters(mappings[t])
        with torch.no_grad():
            out = compiled(x.to(device)).cpu()
        torch.testing.assert_close(out, refs[t], atol=1e-5, rtol=0)
        if t == 9:
            compiles_before = device_compiles(device, meta)
    [dynamic] = [g for g in backend.graphs if g.shapes.padded_symbols]
    # Two adapters and the base cycling per token: at most 2 slots per block, so the segment kernel runs.
    ran = dynamic.variants["segments"]
    assert {tuple(v for _, v in key) for key in ran.programs} == {(8,), (16,), (32,)}
    assert meta.stats["compiles"] == 4  # one static first trace + three buckets
    assert compiles_before is not None


class _WithMemory(torch.nn.Module):
    """A LoRA projection of the tokens plus a summary of a second input of its own length (an encoder's)."""

    def __init__(self):
        super().__init__()
        self.inner = peft_two_layer()

    def forward(self, x, memory):
        return self.inner(x) + memory.mean(dim=1, keepdim=True)[..., :4]


def test_a_size_other_than_the_token_dims_gets_its_own_program(device, inner):
    """Programs are keyed by every size symbol: the same token bucket with another memory length
    must never reuse the program compiled for the first length (it would crash or be wrong)."""
    torch._dynamo.reset()
    model = _WithMemory().eval()
    gen = torch.Generator().manual_seed(0)
    calls = [(5, 3), (6, 3), (5, 4), (5, 5), (7, 4)]  # (tokens, memory length): K turns dynamic at (5, 4)
    inputs = [(torch.randn(1, s, 16, generator=gen), torch.randn(1, k, 16, generator=gen)) for s, k in calls]
    with torch.no_grad():
        refs = [model(x, m) for x, m in inputs]
    meta, backend, compiled = compile_lora(model, device, 64, buckets=xlp.Buckets.pow2(8, 64), inner=inner)
    for (x, m), ref in zip(inputs, refs):
        meta.set_token_adapters(["sql"] * x.shape[1])
        with torch.no_grad():
            out = compiled(x.to(device), m.to(device)).cpu()
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
    # Static first trace, then S dynamic (one bucket), then S and K dynamic: bucket 8 with K = 4 and 5.
    assert [len(g.programs) for g in backend.graphs] == [1, 1, 2]
    assert meta.stats["compiles"] == 4


def test_padding_by_hand_changes_no_real_token(llama):
    """Zero-padding the sequence (ids 0, padded tokens on -1) leaves every real logit as it was."""
    model, names, ids = llama
    model.cpu()
    real = ids[:, :11]
    padded = torch.cat([real, torch.zeros(1, 5, dtype=real.dtype)], dim=1)
    with torch.no_grad():
        want = eager_reference(model, real, ["sql"])
        got = eager_reference(model, padded, ["sql"])[:, :11]
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    meta = xlp.LoRAMetadata(max_num_tokens=32)
    meta.register_adapters(model)
    meta.set_token_adapters(["sql"] * 11)
    idx = meta.token_indices("cpu", (1, 11), (1, 16))
    assert idx[:11].tolist() == [0] * 11 and idx[11:].tolist() == [-1] * 21


def test_precompile_warms_every_bucket_then_serving_compiles_nothing(device, inner):
    torch._dynamo.reset()
    model, names = tiny_peft_llama(num_hidden_layers=1, seed=9)
    ids = torch.randint(0, 128, (1, 64))
    meta, backend, compiled = compile_lora(model, device, 64, buckets=xlp.Buckets.pow2(8, 64), inner=inner)
    warmed = backend.precompile(lambda n: compiled(input_ids=ids[:, :n].to(device)), progress=False)
    # The first trace (2 tokens) and buckets 8..64 twice, the row kernel's program and the masked one's
    # (mixed rows); the size-1 graph once (its rows of one token cannot mix adapters: row kernel only).
    assert warmed == meta.stats["compiles"] == 2 * 1 + 1 + 2 * 4
    before = device_compiles(device, meta)
    for i, n in enumerate((5, 17, 64, 33, 1, 2, 9, 40)):
        one_row_adapter = ["code"] * n
        # Three adapters alternating: not segments either (3 slots in a block of 32), so the masked kernel.
        mixed_in_row = [("code", "sql", "chat")[j % 3] for j in range(n)]
        meta.set_token_adapters(one_row_adapter if i % 2 else mixed_in_row)
        with torch.no_grad():
            compiled(input_ids=ids[:, :n].to(device)).logits.cpu()
    assert meta.stats["compiles"] == 11
    # Only the output slices of new sizes remain (tiny programs, one per distinct size).
    assert device_compiles(device, meta) - before <= 8
