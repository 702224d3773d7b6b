"""Issue 14: request mappings (one adapter per batch row) laid over each graph's token dims."""
import pytest
import torch

import xla_lora_pass as xlp

from .helpers import assert_golden, capture_graphs, check_rewrite, lora_weight_uses, normalize_gm, shrink_expand_counts
from .models import peft_two_layer, peft_two_stacks, per_row_reference


@pytest.fixture
def meta():
    m = xlp.LoRAMetadata(max_num_tokens=64)
    m.register_adapters(peft_two_layer())
    return m


def test_request_rows_are_laid_over_every_token_layout(meta):
    meta.set_request_adapters(["sql", None, 1])
    assert meta.token_mapping((3, 4)).tolist() == [0] * 4 + [-1] * 4 + [1] * 4  # a prompt [B, S]
    assert meta.token_mapping((3, 1)).tolist() == [0, -1, 1]  # a decode step [B, 1]
    assert meta.token_mapping((3,)).tolist() == [0, -1, 1]  # a pooled [B]
    assert meta.rows_uniform((3, 4))
    assert meta.mapped_slots() == {0, -1, 1}
    assert meta.mapping() is None and meta.request_adapters().tolist() == [0, -1, 1]


def test_request_rows_of_the_wrong_batch_name_both_sizes(meta):
    meta.set_request_adapters(["sql", "chat"])
    with pytest.raises(xlp.UnsupportedMappingError, match="2 rows but this call has a batch of 3"):
        meta.token_mapping((3, 4))
    with pytest.raises(xlp.UnsupportedMappingError, match="2 rows but this call has a batch of 6"):
        meta.token_mapping((6,))  # flat tokens of three-token rows: the layout does not say where rows end


def test_token_and_request_mappings_replace_each_other(meta):
    meta.set_request_adapters(["sql", "chat"])
    meta.set_token_adapters(["chat"] * 3)
    assert meta.request_adapters() is None and meta.token_mapping((3,)).tolist() == [1, 1, 1]
    with pytest.raises(xlp.UnsupportedMappingError, match="3 entries but this call has 4 tokens"):
        meta.token_mapping((2, 2))
    meta.set_request_adapters([None, "sql"])
    assert meta.mapping() is None and meta.token_mapping((2, 2)).tolist() == [-1, -1, 0, 0]


def test_bad_request_rows_are_refused_and_change_nothing(meta):
    meta.set_request_adapters(["sql"])
    with pytest.raises(KeyError, match="set_request_adapters: row 1: unknown adapter 'nope'"):
        meta.set_request_adapters(["sql", "nope"])
    with pytest.raises(ValueError, match="row 0: slot 5 is not a loaded slot"):
        meta.set_request_adapters([5])
    with pytest.raises(ValueError, match="one entry per batch row, got none"):
        meta.set_request_adapters([])
    with pytest.raises(TypeError, match="one entry per row"):
        meta.set_request_adapters("sql")
    assert meta.request_adapters().tolist() == [0]


def test_a_compiled_call_of_another_batch_is_refused():
    model = peft_two_layer()
    meta = xlp.LoRAMetadata(max_num_tokens=64)
    meta.register_adapters(model)
    compiled = torch.compile(model, backend=xlp.make_backend(meta, inner="aot_eager"))
    x = torch.randn(3, 5, 16)
    meta.set_request_adapters(["sql", None, "chat"])
    with torch.no_grad():
        out = compiled(x)
        torch.testing.assert_close(out, per_row_reference(model, x, ["sql", None, "chat"]), atol=1e-5, rtol=0)
        torch.testing.assert_close(compiled(x[:, :2]), per_row_reference(model, x[:, :2], ["sql", None, "chat"]),
                                   atol=1e-5, rtol=0)  # a shorter call: the same rows hold
        with pytest.raises(xlp.UnsupportedMappingError, match="3 rows but this call has a batch of 2"):
            compiled(x[:2])


def test_sites_on_another_stack_of_the_same_rows_golden_and_numerics(update_golden):
    """An encoder [B, 8], a decoder [B, 4] and a pooled head [B] in one graph: every site on its row's adapter."""
    model = peft_two_stacks()
    meta = xlp.LoRAMetadata(max_num_tokens=64)
    meta.register_adapters(model)
    gen = torch.Generator().manual_seed(3)
    x_enc, x_dec = torch.randn(3, 8, 16, generator=gen), torch.randn(3, 4, 16, generator=gen)
    rows = ["chat", None, "sql"]
    reference = per_row_reference_two(model, x_enc, x_dec, rows)
    meta.set_request_adapters(rows)
    for output_index in (0, 1):
        new_gm, report = check_rewrite(model, [x_enc, x_dec], meta, rewrites={"lora_linear": 3},
                                       ops=shrink_expand_counts(3, 3), reference=reference[output_index],
                                       token_dims=(3, 8), atol=1e-5, output_index=output_index)
    assert lora_weight_uses(new_gm) == 0
    assert_golden("lora_linear_other_stacks", normalize_gm(new_gm), update_golden)


def test_a_site_on_other_rows_is_a_near_miss():
    """Negative: a decoder input whose batch is not the encoder's is no stack of the same rows."""
    model = peft_two_stacks()
    meta = xlp.LoRAMetadata(max_num_tokens=64)
    meta.register_adapters(model)
    x_enc, x_dec = torch.randn(3, 8, 16), torch.randn(1, 4, 16)  # broadcast over the rows, not one per row
    (gm, example_inputs), = capture_graphs(model, x_enc, x_dec)
    new_gm, report = xlp.rewrite(gm, example_inputs, meta)
    assert [n.site for n in report.near_misses] == ["base_model.model.dec"], report.format()
    assert "neither the graph's token layout" in report.near_misses[0].reason


def per_row_reference_two(model, x_enc, x_dec, rows):
    with torch.no_grad():
        return model(x_enc, x_dec, adapter_names=["__base__" if r is None else r for r in rows])
