"""Pattern 1 (linear LoRA): golden graph, numerics against eager, near misses."""
import pytest
import torch

import xla_lora_pass as xlp
from graph_rewrites import RewriteReport

from .helpers import (assert_golden, capture_graphs, check_rewrite, count_ops, lora_weight_uses, normalize_gm,
                      shrink_expand_counts)
from .models import TwoLayer, peft_two_layer, per_row_reference


def _meta(model, **kw):
    meta = xlp.LoRAMetadata(max_num_tokens=64, **kw)
    meta.register_adapters(model)
    return meta


def test_peft_linear_golden_and_numerics(update_golden):
    model = peft_two_layer()
    meta = _meta(model)
    x = torch.randn(3, 8, 16)  # rows of 8 tokens: the row kernel (config.row_kernel_min_tokens)
    rows = ["sql", None, "chat"]
    meta.set_token_adapters([r for r in rows for _ in range(8)])
    new_gm, report = check_rewrite(
        model, [x], meta, rewrites={"lora_linear": 1},
        ops=shrink_expand_counts(1, 1, also={torch.ops.xla_lora.bgmv_shrink_rows.default: 1}),
        reference=per_row_reference(model, x, rows), token_dims=(3, 8),
    )
    assert lora_weight_uses(new_gm) == 0
    assert_golden("lora_linear_peft", normalize_gm(new_gm), update_golden)


def test_mixed_per_token_mapping_matches_per_token_eager(monkeypatch, update_golden):
    """Tokens of one row on different adapters: each token gets exactly its adapter's delta.

    The row kernel cannot run this mapping.  Under "auto" the backend would run the segment kernel
    (its 8 tokens are one block of two slots; tests/test_segments_kernel.py); the masked kernel, which
    serves any mapping, is pinned here (golden file).
    """
    monkeypatch.setattr(xlp.config, "kernel", "masked")
    model = peft_two_layer()
    meta = _meta(model)
    x = torch.randn(2, 4, 16)
    mapping = ["sql", "chat", None, "chat", None, "sql", "sql", "chat"]
    with torch.no_grad():
        per_adapter = {}
        for name in ("sql", "chat"):
            model.set_adapter(name)
            per_adapter[name] = model(x).reshape(8, -1)
        with model.disable_adapter():
            per_adapter[None] = model(x).reshape(8, -1)
        model.set_adapter("sql")
    # proj is the only LoRA layer and tokens do not interact: row-wise selection is the truth.
    reference = torch.stack([per_adapter[m][i] for i, m in enumerate(mapping)]).reshape(2, 4, -1)
    meta.set_token_adapters(mapping)
    assert not meta.rows_uniform((2, 4))
    new_gm, _ = check_rewrite(model, [x], meta, rewrites={"lora_linear": 1},
                              ops=shrink_expand_counts(1, 1, also={torch.ops.xla_lora.bgmv_shrink.default: 1}),
                              reference=reference, token_dims=(2, 4))
    assert_golden("lora_linear_masked", normalize_gm(new_gm), update_golden)


def test_dropout_in_eval_mode_is_rewritten():
    model = peft_two_layer(lora_dropout=0.1)
    meta = _meta(model)
    x = torch.randn(2, 3, 16)
    meta.set_token_adapters(["chat"] * 3 + ["sql"] * 3)
    check_rewrite(model, [x], meta, rewrites={"lora_linear": 1}, ops=shrink_expand_counts(1, 1),
                  reference=per_row_reference(model, x, ["chat", "sql"]), token_dims=(2, 3))


def test_graph_without_lora_passes_through_unchanged(update_golden):
    torch.manual_seed(0)
    model = TwoLayer().eval()
    meta = _meta(peft_two_layer())  # registered adapters belong to another model
    (gm, example_inputs), = capture_graphs(model, torch.randn(2, 16))
    new_gm, report = xlp.rewrite(gm, example_inputs, meta)
    assert report.sites == [] and report.near_misses == []
    assert normalize_gm(new_gm) == normalize_gm(gm)
    assert new_gm is not gm
    assert_golden("no_lora_passthrough", normalize_gm(new_gm), update_golden)


def test_scale_mismatch_is_a_near_miss_left_alone():
    """The graph scales by a value the metadata did not stack: rewriting would change the result.

    A model adapter's float changed after registration is re-stacked before the rewrite
    (tests/test_scaling_inputs.py); one that ``load_adapter`` redefined keeps its own scaling, so the model's
    new float is a mismatch."""
    model = peft_two_layer()
    meta = _meta(model)
    proj = model.base_model.model.proj
    meta.load_adapter("sql", {"base_model.model.proj.lora_A.weight": proj.lora_A["sql"].weight.detach().clone(),
                              "base_model.model.proj.lora_B.weight": proj.lora_B["sql"].weight.detach().clone()},
                      scaling=proj.scaling["sql"])
    proj.scaling["sql"] = 3.0  # changed after the adapter was loaded: the stacks keep the loaded scaling
    (gm, example_inputs), = capture_graphs(model, torch.randn(2, 16))
    new_gm, report = xlp.rewrite(gm, example_inputs, meta)
    assert report.sites == []
    [miss] = report.near_misses
    assert miss.site == "base_model.model.proj" and "scales the delta by 3.0" in miss.reason
    assert normalize_gm(new_gm) == normalize_gm(gm)
    assert count_ops(new_gm, torch.ops.xla_lora.bgmv_shrink.default) == 0


@pytest.mark.parametrize("transform", [torch.nn.Tanh(), torch.nn.LayerNorm(16)], ids=["tanh", "layer_norm"])
def test_an_input_transform_on_the_lora_branch_only_is_a_near_miss(transform):
    """``B(A(f(x)))`` beside ``base(x)``: f belongs to the active adapter alone (its own lora_dropout module).

    Rewritten, every adapter at the site would read f(x): rows on "chat" were off by 4.3e-3 in a tiny
    Llama before this check.  Left alone, the graph computes the active adapter exactly as eager.
    """
    model = peft_two_layer()
    meta = _meta(model)
    model.base_model.model.proj.lora_dropout["sql"] = transform
    x = torch.randn(2, 16)
    (gm, example_inputs), = capture_graphs(model, x)
    new_gm, report = xlp.rewrite(gm, example_inputs, meta)
    assert report.sites == []
    [miss] = report.near_misses
    assert miss.site == "base_model.model.proj" and "not the base layer's input" in miss.reason, miss.reason
    assert normalize_gm(new_gm) == normalize_gm(gm)
    assert count_ops(new_gm, torch.ops.xla_lora.bgmv_shrink.default) == 0


class _DeltaAlsoReturned(torch.nn.Module):
    """A LoRA branch whose intermediate is used outside it: rewriting would drop a use."""

    def __init__(self):
        super().__init__()
        self.inner = peft_two_layer()

    def forward(self, x):
        proj = self.inner.base_model.model.proj
        a, b = proj.lora_A["sql"].weight, proj.lora_B["sql"].weight
        shrunk = torch.nn.functional.linear(x, a)
        y = torch.nn.functional.linear(x, proj.base_layer.weight) + torch.nn.functional.linear(shrunk, b) * \
            proj.scaling["sql"]
        return y, shrunk


def test_intermediate_used_elsewhere_is_a_near_miss():
    model = _DeltaAlsoReturned().eval()
    meta = _meta(model.inner)
    (gm, example_inputs), = capture_graphs(model, torch.randn(2, 16))
    new_gm, report = xlp.rewrite(gm, example_inputs, meta)
    assert report.sites == []
    [miss] = report.near_misses
    assert miss.site == "base_model.model.proj" and "no pattern matched" in miss.reason
    assert normalize_gm(new_gm) == normalize_gm(gm)


def test_report_format_names_sites():
    model = peft_two_layer()
    meta = _meta(model)
    (gm, example_inputs), = capture_graphs(model, torch.randn(2, 16))
    _, report = xlp.rewrite(gm, example_inputs, meta)
    text = report.format()
    assert "1 LoRA sites rewritten, 0 near misses" in text
    assert "base_model.model.proj  [lora_linear]  x[2, 16] -> [2, 8]  rank 4  slots 2" in text
    assert isinstance(report, RewriteReport)


def test_peft_scaling_tensor_golden_numerics_and_near_miss(update_golden):
    """PEFT's prepare_model_for_compiled_hotswap keeps each scaling in a tensor (ranks padded to 8): the
    delta scaled by its adapter's own one-number tensor is rewritten (the scaling folded into the stacked B);
    a per-channel tensor in its place is a custom variant, left alone with the reason."""
    from peft.utils.hotswap import prepare_model_for_compiled_hotswap

    model = peft_two_layer()
    prepare_model_for_compiled_hotswap(model, target_rank=8)
    meta = _meta(model)
    x = torch.randn(3, 8, 16)
    rows = ["sql", None, "chat"]
    meta.set_token_adapters([r for r in rows for _ in range(8)])
    new_gm, _ = check_rewrite(
        model, [x], meta, rewrites={"lora_linear": 1},
        ops=shrink_expand_counts(1, 1, also={torch.ops.xla_lora.bgmv_shrink_rows.default: 1}),
        reference=per_row_reference(model, x, rows), token_dims=(3, 8),
    )
    assert lora_weight_uses(new_gm) == 0
    assert_golden("lora_linear_scaling_tensor", normalize_gm(new_gm), update_golden)

    proj = model.base_model.model.proj
    proj.scaling["sql"] = torch.full((proj.out_features,), float(proj.scaling["sql"]))
    meta = _meta(model)
    (gm, example_inputs), = capture_graphs(model, torch.randn(2, 16))
    new_gm, report = xlp.rewrite(gm, example_inputs, meta)
    [miss] = report.near_misses
    assert report.sites == [] and "scales its delta by a tensor of shape [" in miss.reason
    assert normalize_gm(new_gm) == normalize_gm(gm)
