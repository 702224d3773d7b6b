"""Issue 4: the pattern library on real PEFT models, golden graphs and near misses."""
import copy

import pytest
import torch
import torch.nn as nn
from peft import LoraConfig, get_peft_model
from peft.tuners.lora import LoraLayer
from transformers import GPT2Config, GPT2LMHeadModel, LlamaForCausalLM

import xla_lora_pass as xlp
from xla_lora_pass.demo_models import tiny_llama_config

from .helpers import (assert_golden, capture_graphs, check_rewrite, compile_lora, count_ops, count_shrinks,
                      lora_weight_uses, normalize_gm, shrink_expand_counts)

LLAMA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "embed_tokens",
                 "lm_head"]
GPT2_TARGETS = ["c_attn", "c_proj", "c_fc", "wte", "lm_head"]
# (name, rank, alpha, rsLoRA): every adapter has its own rank and scaling.
ADAPTERS = [("sql", 4, 8, False), ("chat", 8, 16, True), ("code", 2, 2, False), ("math", 6, 3, False)]
EMB_SHRINK = torch.ops.xla_lora.bgmv_embedding_shrink.default


def _peft(model, targets, adapters, dtype=torch.float32, **kw):
    peft_model = None
    for name, r, alpha, rs in adapters:
        cfg = LoraConfig(r=r, lora_alpha=alpha, use_rslora=rs, target_modules=targets, init_lora_weights=False,
                         lora_dropout=0.1, **kw)
        peft_model = get_peft_model(model, cfg, adapter_name=name) if peft_model is None else peft_model
        if name not in peft_model.peft_config:
            peft_model.add_adapter(name, cfg)
    peft_model.set_adapter(adapters[0][0])
    return peft_model.to(dtype).eval()


def _llama(dtype=torch.float32, adapters=ADAPTERS, layers=2, **kw):
    torch.manual_seed(0)
    return _peft(LlamaForCausalLM(tiny_llama_config(num_hidden_layers=layers)), LLAMA_TARGETS, adapters, dtype,
                 **kw)


def _gpt2(dtype=torch.float32, adapters=ADAPTERS[:3]):
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=128, n_embd=32, n_layer=2, n_head=4, n_positions=64))
    return _peft(model, GPT2_TARGETS, adapters, dtype, fan_in_fan_out=True)


def _rows_reference(model, ids, rows, **kw):
    with torch.no_grad():
        return model(input_ids=ids, adapter_names=["__base__" if r is None else r for r in rows], **kw).logits


def _close(out, ref, dtype):
    if dtype == torch.float32:
        assert (out - ref).abs().max().item() < 1e-4
    else:  # bf16: 1e-2 relative error of the logits (norm of the difference over norm of the reference)
        rel = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
        assert rel < 1e-2, rel


@pytest.mark.compat
@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_every_lora_module_rewritten(family, dtype, device, inner):
    # No Dynamo reset between cases: a GPT-2 after a Llama is traced dynamically at once
    # (PeftModel.forward's frame is already dynamic), which on XLA needs runtimes/xla_layer_norm.py.
    model = _llama(dtype) if family == "llama" else _gpt2(dtype)
    peft_layers = sum(isinstance(m, LoraLayer) for m in model.modules())
    names = list(model.peft_config)
    rows = names + [None]
    ids = torch.randint(0, 128, (len(rows), 7), generator=torch.Generator().manual_seed(1))
    reference = _rows_reference(model, ids, rows)
    if dtype != torch.float32:
        # bf16 is judged against the fp32 truth (same weights, upcast); PEFT's own bf16 path
        # is itself about 1% off it, so two bf16 paths can differ by twice that.
        reference = _rows_reference(copy.deepcopy(model).float(), ids, rows)
    meta, backend, compiled = compile_lora(model, device, 128, inner=inner)
    meta.set_token_adapters([r for r in rows for _ in range(7)])
    with torch.no_grad():
        out = compiled(input_ids=ids.to(device)).logits.cpu()
    model.cpu()
    _close(out, reference, dtype)
    [graph] = backend.graphs
    assert sum(meta.stats["rewrites"].values()) == peft_layers == len(meta.sites)
    assert graph.report.near_misses == [] and lora_weight_uses(graph.gm) == 0
    assert count_ops(graph.gm, EMB_SHRINK) == 1
    if family == "llama":
        # One shrink per shared input: q/k/v, o, gate/up, down per layer, and lm_head.
        assert count_shrinks(graph.gm) == 4 * 2 + 1
        assert graph.report.shrinks_fused == 2 * (2 + 1)
    else:  # GPT-2: c_attn, attn c_proj, c_fc, mlp c_proj per layer, and lm_head: no shared inputs
        assert count_shrinks(graph.gm) == 4 * 2 + 1


# ------------------------------------------------------------ golden graphs
class _Attn(nn.Module):
    """q/k/v from one input, an embedding in front and a head on selected rows."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.q, self.k, self.v = nn.Linear(16, 16, bias=False), nn.Linear(16, 8, bias=False), nn.Linear(16, 8)
        self.head = nn.Linear(16, 50, bias=False)

    def forward(self, ids, keep_last=False):
        h = self.embed(ids)
        mixed = self.q(h) + torch.cat([self.k(h), self.v(h)], dim=-1)
        if keep_last:
            mixed = mixed[:, -1:, :]
        return self.head(mixed)


def _attn_model(targets, **kw):
    torch.manual_seed(0)
    return _peft(_Attn(), targets, ADAPTERS[:2], **kw)


def _mapped(meta, rows, seq):
    meta.set_token_adapters([r for r in rows for _ in range(seq)])


@pytest.mark.parametrize("name, targets, kw, rewrites, ops", [
    ("lora_embedding", ["embed"], {}, {"lora_embedding": 1},
     shrink_expand_counts(0, 0, also={EMB_SHRINK: 1, torch.ops.xla_lora.bgmv_expand.default: 1})),
    ("fuse_shared_shrink", ["q", "k", "v"], {}, {"lora_linear": 3}, shrink_expand_counts(1, 3)),
    ("lora_bias", ["q", "v"], {"lora_bias": True}, {"lora_bias": 2},
     shrink_expand_counts(1, 2, also={torch.ops.xla_lora.bgmv_bias.default: 2})),
    ("lm_head_rows", ["head"], {"keep_last": True}, {"lora_linear": 1},  # selected rows: the masked kernel
     shrink_expand_counts(0, 0, also={torch.ops.xla_lora.bgmv_shrink.default: 1,
                                      torch.ops.xla_lora.bgmv_expand.default: 1})),
])
def test_pattern_golden_and_numerics(name, targets, kw, rewrites, ops, update_golden):
    keep_last = kw.pop("keep_last", False)
    model = _attn_model(targets, **kw)
    meta = xlp.LoRAMetadata(max_num_tokens=64)
    meta.register_adapters(model)
    ids = torch.randint(0, 50, (3, 4), generator=torch.Generator().manual_seed(2))
    rows = ["sql", None, "chat"]
    with torch.no_grad():
        reference = model(ids, keep_last, adapter_names=["__base__" if r is None else r for r in rows])
    _mapped(meta, rows, 4)
    new_gm, report = check_rewrite(lambda i: model(i, keep_last), [ids], meta, rewrites=rewrites,
                                   ops=ops, reference=reference, token_dims=(3, 4))
    assert lora_weight_uses(new_gm) == 0
    assert_golden(name, normalize_gm(new_gm), update_golden)


# ------------------------------------------------------------- near misses
# DoRA is rewritten now: its golden, numerics and near miss are in test_dora.py.


def test_embedding_with_max_norm_is_a_near_miss():
    """max_norm renormalises looked-up rows: not the plain gather the kernel does."""
    model = _attn_model(["embed"])
    model.base_model.model.embed.base_layer.max_norm = 1.0
    meta = xlp.LoRAMetadata(max_num_tokens=64)
    meta.register_adapters(model)
    (gm, example_inputs), = capture_graphs(model, torch.randint(0, 50, (2, 4)))
    new_gm, report = xlp.rewrite(gm, example_inputs, meta)
    assert report.sites == [] and len(report.near_misses) == 1
    assert count_ops(new_gm, EMB_SHRINK) == 0


def test_adapter_names_loop_is_a_near_miss():
    """PEFT's data-dependent mixed-batch loop, compiled: left alone, and its own result stands."""
    model = _attn_model(["q"])
    meta = xlp.LoRAMetadata(max_num_tokens=64)
    meta.register_adapters(model)
    ids = torch.randint(0, 50, (2, 4))
    names = ["sql", "chat"]
    graphs = capture_graphs(lambda i: model(i, adapter_names=names), ids)
    for gm, example_inputs in graphs:
        new_gm, report = xlp.rewrite(gm, example_inputs, meta)
        assert report.sites == []
        assert normalize_gm(new_gm) == normalize_gm(gm)
    assert any(r.near_misses for _, r in (xlp.rewrite(g, e, meta) for g, e in graphs))


def test_shared_input_sites_with_other_inputs_are_not_fused():
    """o_proj-like sites see another activation: each keeps its own shrink."""
    model = _attn_model(["q", "head"])
    meta = xlp.LoRAMetadata(max_num_tokens=64)
    meta.register_adapters(model)
    (gm, example_inputs), = capture_graphs(model, torch.randint(0, 50, (2, 4)))
    new_gm, report = xlp.rewrite(gm, example_inputs, meta)
    assert count_shrinks(new_gm) == 2 and report.shrinks_fused == 0


def test_row_selection_from_the_end_is_rewritten_but_not_padded(device, inner):
    """lm_head on ``h[:, -1:]``: after padding the last row would be padding, so no bucketing."""
    torch._dynamo.reset()
    model = _llama(layers=1, adapters=ADAPTERS[:2])
    lengths = (5, 6, 9)
    inputs = {n: torch.randint(0, 128, (2, n), generator=torch.Generator().manual_seed(n)) for n in lengths}
    refs = {n: _rows_reference(model, inputs[n], ["chat", None], logits_to_keep=1) for n in lengths}
    meta, backend, compiled = compile_lora(model, device, 64, inner=inner, buckets=xlp.Buckets.pow2(8, 32))
    for n in lengths:
        _mapped(meta, ["chat", None], n)
        with torch.no_grad():
            out = compiled(input_ids=inputs[n].to(device), logits_to_keep=1).logits.cpu()
        assert (out - refs[n]).abs().max().item() < 1e-4, n
    model.cpu()
    dynamic = [g for g in backend.graphs if "from its end" in (g.shapes.not_bucketable or "")]
    assert dynamic, [g.shapes.not_bucketable for g in backend.graphs]
    assert all(g.report.near_misses == [] for g in backend.graphs)


def test_reduction_over_tokens_is_never_padded():
    """A graph that sums over the token dim would see padded tokens: compiled per exact shape."""
    model = _attn_model(["q"])
    meta = xlp.LoRAMetadata(max_num_tokens=64)
    meta.register_adapters(model)
    backend = xlp.make_backend(meta, inner="aot_eager", buckets=xlp.Buckets.pow2(8, 32))
    pooled = torch.compile(lambda ids: model(ids).sum(dim=1), backend=backend)
    for n in (3, 5):
        ids = torch.randint(0, 50, (2, n), generator=torch.Generator().manual_seed(n))
        _mapped(meta, ["sql", "chat"], n)
        with torch.no_grad():
            got = pooled(ids)
            want = model(ids, adapter_names=["sql", "chat"]).sum(dim=1)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    [dynamic] = [g for g in backend.graphs if g.shapes.sources]
    assert "reduces over a token dim" in dynamic.shapes.not_bucketable


