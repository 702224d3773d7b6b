"""DoRA (pattern 6) in a mixed batch with plain LoRA and the base model: golden, numerics, near miss, on XLA.

PEFT refuses ``adapter_names=`` with DoRA, so the reference is PEFT run
once per adapter (``set_adapter``, and ``disable_adapter`` for the base).
PEFT initialises each magnitude to the norm it divides by (a scale of
exactly 1, plain LoRA); the magnitudes here are perturbed so that a missing
rescaling shows.
"""
import pytest
import torch
import torch.nn as nn
from peft import LoraConfig, get_peft_model

import xla_lora_pass as xlp
from xla_lora_pass.demo_models import per_sequence_mapping, tiny_peft_llama

from .helpers import (assert_golden, capture_graphs, check_rewrite, count_ops, lora_weight_uses, normalize_gm,
                      shrink_expand_counts)

DORA_OP = torch.ops.xla_lora.bgmv_dora.default


class _QV(nn.Module):
    """q (no bias) and v (bias) from one input, then a head."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.q, self.v = nn.Linear(16, 16, bias=False), nn.Linear(16, 16)
        self.head = nn.Linear(16, 50, bias=False)

    def forward(self, ids):
        h = self.embed(ids)
        return self.head(self.q(h) * torch.sigmoid(self.v(h)))


def perturb_magnitudes(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_magnitude_vector" in name:
                p.mul_(0.5 + torch.rand(p.shape, generator=g))


def _qv_model():
    torch.manual_seed(0)
    model = get_peft_model(_QV(), LoraConfig(r=2, lora_alpha=4, target_modules=["q", "v"], use_dora=True,
                                             init_lora_weights=False), adapter_name="dora")
    model.add_adapter("plain", LoraConfig(r=4, lora_alpha=4, target_modules=["q", "v"], init_lora_weights=False))
    perturb_magnitudes(model)
    return model.eval()


def per_adapter_reference(model, call, rows):
    """Row i of PEFT's output with adapter rows[i] active (None: adapters disabled)."""
    active = model.active_adapter
    outs = {}
    with torch.no_grad():
        for name in {r for r in rows if r is not None}:
            model.set_adapter(name)
            outs[name] = call()
        with model.disable_adapter():
            outs[None] = call()
    model.set_adapter(active)
    return torch.stack([outs[r][i] for i, r in enumerate(rows)])


ROWS = ["dora", None, "plain"]


class _OwnParameter(nn.Parameter):
    """A weight type PEFT's dequantize_module_weight does not return as is without asking (a quantized
    weight's stand-in): Dynamo runs PEFT's function outside the graph, which breaks DoRA's forward in two."""


def test_a_dora_forward_split_by_a_graph_break_is_refused_not_wrong():
    """A DoRA layer Dynamo cannot trace whole (its base weight is a Parameter subclass): a mixed batch is
    refused naming the layer, a batch all on the active adapter is exact.  (torch 2.14 split every DoRA
    forward so, at PEFT's str.startswith, before adapters/formats/peft_tracing.py.)"""
    torch._dynamo.reset()
    model = _qv_model()
    q = model.base_model.model.q.base_layer
    q.weight = _OwnParameter(q.weight.detach().clone(), requires_grad=False)
    ids = torch.randint(0, 50, (3, 4), generator=torch.Generator().manual_seed(2))
    uniform = per_adapter_reference(model, lambda: model(ids), ["dora"] * 3)
    meta = xlp.LoRAMetadata(max_num_tokens=64)
    meta.register_adapters(model)
    compiled = torch.compile(model, backend=xlp.make_backend(meta, inner="aot_eager"))
    meta.set_token_adapters(per_sequence_mapping(ROWS, 4))
    with torch.no_grad():
        with pytest.raises(xlp.UnsupportedMappingError, match=r"base_model.model.q \(adapter 'dora'\): no "
                                                              r"pattern matched .*a DoRA layer: a graph break"):
            compiled(ids)
        meta.set_token_adapters(per_sequence_mapping(["dora"] * 3, 4))
        torch.testing.assert_close(compiled(ids), uniform, atol=1e-5, rtol=0)


# Traced with "plain" active, the graph holds no DoRA forward to break: DoRA rows are rescaled on every torch.
@pytest.mark.parametrize("active, rewrites", [("dora", {"lora_dora": 2}),
                                              ("plain", {"lora_linear": 2})])
def test_dora_golden_and_numerics(active, rewrites, update_golden):
    """Whichever adapter Dynamo traced, DoRA rows are rescaled and the others are not."""
    model = _qv_model()
    ids = torch.randint(0, 50, (3, 4), generator=torch.Generator().manual_seed(2))
    reference = per_adapter_reference(model, lambda: model(ids), ROWS)
    model.set_adapter(active)
    meta = xlp.LoRAMetadata(max_num_tokens=64)
    meta.register_adapters(model)
    meta.set_token_adapters(per_sequence_mapping(ROWS, 4))
    ops = {DORA_OP: 2, torch.ops.aten.linalg_vector_norm.default: 0}  # q and v share one shrink
    new_gm, _ = check_rewrite(model, [ids], meta, rewrites=rewrites, ops=shrink_expand_counts(1, 2, also=ops),
                              reference=reference, token_dims=(3, 4))
    assert lora_weight_uses(new_gm) == 0
    assert "linalg_norm" not in new_gm.code and "eye" not in new_gm.code  # the folded scale's subgraph is gone
    if active == "dora":
        assert_golden("lora_dora", normalize_gm(new_gm), update_golden)


def test_dora_with_a_scaling_changed_after_registration_is_re_stacked_and_served():
    """A float scaling moves no tensor the weight watch sees: each new graph's rewrite re-reads the model's
    scalings first (the DoRA constants fold the scaling too), so both sites are rewritten and exact; before,
    q was a near miss ("the graph scales the delta by 5.0") and a mixed batch refused."""
    model = _qv_model()
    meta = xlp.LoRAMetadata(max_num_tokens=64)
    meta.register_adapters(model)
    model.base_model.model.q.scaling["dora"] = 5.0  # after registration
    ids = torch.randint(0, 50, (2, 4), generator=torch.Generator().manual_seed(3))
    rows = ["dora", "plain"]
    reference = per_adapter_reference(model, lambda: model(ids), rows)
    model.set_adapter("dora")
    (gm, example_inputs), = capture_graphs(model, ids)
    new_gm, report = xlp.rewrite(gm, example_inputs, meta)
    assert report.near_misses == [] and sorted(s.site for s in report.sites) == ["base_model.model.q",
                                                                                 "base_model.model.v"]
    assert meta.sites["base_model.model.q"].adapters["dora"].scaling == 5.0
    assert "linalg_norm" not in new_gm.code
    compiled = torch.compile(model, backend=xlp.make_backend(meta, inner="aot_eager"))
    meta.set_token_adapters(per_sequence_mapping(rows, 4))
    with torch.no_grad():
        torch.testing.assert_close(compiled(ids), reference, atol=1e-5, rtol=0)


def _dora_llama():
    model, names = tiny_peft_llama(attention_bias=True)  # sql, chat, code; q/v biased
    model.add_adapter("dora", LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], use_dora=True,
                                         init_lora_weights=False))
    perturb_magnitudes(model)
    model.set_adapter("sql")
    return model.eval()


def test_dora_lora_and_base_in_one_batch_on_xla_match_peft(xla_device):
    torch._dynamo.reset()
    model = _dora_llama()
    rows = ["dora", "sql", None, "dora"]
    ids = torch.randint(0, 128, (len(rows), 6), generator=torch.Generator().manual_seed(0))
    swapped = ["sql", "dora", "dora", None]
    references = {tuple(r): per_adapter_reference(model, lambda: model(input_ids=ids).logits, r)
                  for r in (rows, swapped)}
    model.to(xla_device)
    meta = xlp.LoRAMetadata(max_num_tokens=128)
    meta.register_adapters(model)
    backend = xlp.make_backend(meta)
    compiled = torch.compile(model, backend=backend)

    def run(mapping_rows):
        meta.set_token_adapters(per_sequence_mapping(mapping_rows, 6))
        with torch.no_grad():
            return compiled(input_ids=ids.to(xla_device)).logits.cpu()

    out = run(rows)
    assert (out - references[tuple(rows)]).abs().max().item() < 1e-4
    assert meta.stats["rewrites"] == {"lora_linear": 4}  # sql was active: DoRA rows rescaled all the same
    [graph] = backend.graphs
    assert count_ops(graph.gm, DORA_OP) == 4 and graph.report.near_misses == []
    from .xla_utils import xla_compiles  # torch_xla's metrics: imported where XLA runs

    before = xla_compiles()
    out = run(swapped)
    assert (out - references[tuple(swapped)]).abs().max().item() < 1e-4
    assert xla_compiles() == before


def test_generate_after_peft_refused_dora_adapter_names_drops_peft_stale_hooks(xla_device):
    """PEFT refuses ``generate(adapter_names=...)`` with DoRA and leaves its per-layer hooks behind (peft 0.17,
    0.21); the routed generate removes them with a warning and serves the rows exactly, instead of raising
    PEFT's refusal for a call that never reached PEFT."""
    from xla_lora_pass.demo_models import DORA_ADAPTER, demo_llama_with_dora

    model, _ = demo_llama_with_dora()
    perturb_magnitudes(model)
    ids = torch.randint(3, 128, (3, 5), generator=torch.Generator().manual_seed(4))
    rows = [DORA_ADAPTER, None, "sql"]
    kw = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    names = ["__base__" if r is None else r for r in rows]
    with torch.no_grad():
        want = per_adapter_reference(model, lambda: model.generate(input_ids=ids, **kw), rows)
    with pytest.raises(ValueError, match="DoRA"):
        with torch.no_grad():
            model.generate(input_ids=ids, adapter_names=names, **kw)
    stale = sum(len(m._forward_pre_hooks) for m in model.modules())
    if stale == 0:
        pytest.skip("this PEFT removes its hooks when it refuses: nothing stale to drop")
    model.to(xla_device)
    meta = xlp.LoRAMetadata(max_num_tokens=64)
    meta.register_adapters(model)
    compiled = torch.compile(model, backend=xlp.make_backend(meta))
    with pytest.warns(UserWarning, match=f"removed {stale} adapter_names hooks"), torch.no_grad():
        out = compiled.generate(input_ids=ids.to(xla_device), adapter_names=names, **kw).cpu()
    assert torch.equal(out, want)
    assert sum(len(m._forward_pre_hooks) for m in model.modules()) == 0
