"""The pattern engine itself: a toy pattern registered in PATTERNS is matched, checked, near-missed, replaced."""
import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F

import graph_rewrites
import xla_lora_pass as xlp
from graph_rewrites import Pattern, fx_utils
from graph_rewrites.patterns.lora_linear import lora_linear_replacement, weights_reason
from graph_rewrites.pattern_matcher import find_matches, traced_form

from .helpers import capture_graphs, check_rewrite, normalize_gm, shrink_expand_counts
from .models import peft_two_layer, per_row_reference

REFUSED = "the toy check refuses every site"


def _peft_form(x, base, lora_a, lora_b, scale):
    return base + F.linear(F.linear(x, lora_a), lora_b) * scale


def _toy(check=weights_reason, replacement=lora_linear_replacement) -> Pattern:
    """PEFT's own form of pattern 1 under another name: it claims the site before ``lora_linear`` does."""
    return Pattern("toy_linear", (_peft_form,), check, replacement)


@pytest.fixture
def register(monkeypatch):
    """Put a pattern first in the table for one test."""
    def put(pattern: Pattern):
        monkeypatch.setattr(graph_rewrites, "PATTERNS", (pattern,) + graph_rewrites.PATTERNS)
    return put


def _meta(model):
    meta = xlp.LoRAMetadata(max_num_tokens=64)
    meta.register_adapters(model)
    return meta


def test_registered_pattern_is_matched_replaced_and_counted(register):
    register(_toy())
    model = peft_two_layer()
    meta = _meta(model)
    x = torch.randn(3, 4, 16)
    rows = ["chat", None, "sql"]
    meta.set_token_adapters([r for r in rows for _ in range(4)])
    _, report = check_rewrite(model, [x], meta, rewrites={"toy_linear": 1}, ops=shrink_expand_counts(1, 1),
                              reference=per_row_reference(model, x, rows), token_dims=(3, 4))
    [site] = report.sites
    assert site.site == "base_model.model.proj" and site.pattern == "toy_linear" and site.replaced


def test_pattern_switched_off_by_name_leaves_the_site_to_the_next(register, monkeypatch):
    register(_toy())
    monkeypatch.setitem(xlp.config.passes, "toy_linear", False)
    model = peft_two_layer()
    meta = _meta(model)
    (gm, example_inputs), = capture_graphs(model, torch.randn(2, 16))
    _, report = xlp.rewrite(gm, example_inputs, meta)
    assert report.counts() == {"lora_linear": 1}


def test_check_reason_is_a_near_miss_and_the_graph_is_left_alone(register, monkeypatch):
    register(_toy(check=lambda m: REFUSED))
    monkeypatch.setitem(xlp.config.passes, "lora_linear", False)
    model = peft_two_layer()
    meta = _meta(model)
    (gm, example_inputs), = capture_graphs(model, torch.randn(2, 16))
    new_gm, report = xlp.rewrite(gm, example_inputs, meta)
    assert report.sites == []
    [miss] = report.near_misses
    assert (miss.site, miss.pattern, miss.reason) == ("base_model.model.proj", "toy_linear", REFUSED)
    assert miss.nodes  # the matched nodes, for xla-lora-dump to highlight
    assert normalize_gm(new_gm) == normalize_gm(gm)


def test_replacement_reason_is_a_near_miss(register, monkeypatch):
    register(_toy(replacement=lambda graph, m, ctx: (None, REFUSED)))
    monkeypatch.setitem(xlp.config.passes, "lora_linear", False)
    model = peft_two_layer()
    (gm, example_inputs), = capture_graphs(model, torch.randn(2, 16))
    _, report = xlp.rewrite(gm, example_inputs, _meta(model))
    assert [(n.pattern, n.reason) for n in report.near_misses] == [("toy_linear", REFUSED)]


def _raising_replacement(graph, m, ctx):
    raise ValueError("toy replacement broke")


def test_replacement_that_raises_names_the_node(register, monkeypatch):
    register(_toy(replacement=_raising_replacement))
    monkeypatch.setattr(xlp.config, "fallback_on_error", False)
    model = peft_two_layer()
    (gm, example_inputs), = capture_graphs(model, torch.randn(2, 16))
    output = next(n for n in gm.graph.nodes if n.op == "call_function" and n.target.__name__ == "add")
    with pytest.raises(ValueError, match="toy replacement broke") as caught:
        xlp.rewrite(gm, example_inputs, _meta(model))
    message = str(caught.value)
    assert "pattern toy_linear, replacement" in message and output.format_node() in message


def test_replacement_that_raises_falls_back_with_the_node_in_the_report(register):
    register(_toy(replacement=_raising_replacement))
    model = peft_two_layer()
    (gm, example_inputs), = capture_graphs(model, torch.randn(2, 16))
    new_gm, report = xlp.rewrite(gm, example_inputs, _meta(model))
    assert report.error.startswith("ValueError: toy replacement broke")
    assert "call_function[target=operator.add]" in report.error
    assert report.sites == [] and normalize_gm(new_gm) == normalize_gm(gm)


def test_check_that_raises_names_the_node_and_a_key_error_reads_as_a_message(register, monkeypatch):
    register(_toy(check=lambda m: {}["missing"]))
    monkeypatch.setattr(xlp.config, "fallback_on_error", False)
    model = peft_two_layer()
    (gm, example_inputs), = capture_graphs(model, torch.randn(2, 16))
    with pytest.raises(RuntimeError, match=r"^missing \[pattern toy_linear, check of the site ending at %"):
        xlp.rewrite(gm, example_inputs, _meta(model))


def test_find_matches_returns_graph_order_and_earlier_forms_win():
    def two_sites(x, base, a1, b1, a2, b2):
        first = base + F.linear(F.linear(x, a1), b1) * 2.0
        return first + F.linear(F.linear(torch.relu(first), a2), b2) * 3.0

    gm = fx.symbolic_trace(two_sites)
    forms = [traced_form(_peft_form), traced_form(_peft_form)]  # the second copy finds nothing new
    matches = find_matches(gm, forms)
    assert [m.scale for m in matches] == [2.0, 3.0]
    assert [m.lora_a.name for m in matches] == ["a1", "a2"]
    assert len({n for m in matches for n in m.nodes}) == sum(len(m.nodes) for m in matches)


def test_traced_form_is_traced_once():
    assert traced_form(_peft_form) is traced_form(_peft_form)
    assert [p.name for p in traced_form(_peft_form).find_nodes(op="placeholder")] == [
        "x", "base", "lora_a", "lora_b", "scale"]


def test_shape_of_is_the_example_shape_or_none():
    model = peft_two_layer()
    (gm, _), = capture_graphs(model, torch.randn(2, 16))
    x = next(iter(gm.graph.find_nodes(op="placeholder")))
    assert fx_utils.shape_of(x) == tuple(fx_utils.example_value(x).shape)
    assert fx_utils.shape_of(3) is None
