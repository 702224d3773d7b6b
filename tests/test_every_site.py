"""Issue 12: every registered adapter at every site, and PEFT's modules_to_save, served per token or row.

The pass alone on the CPU (golden graphs, numbers against eager PEFT, near
misses); tests/test_heads_and_target_modules.py runs the same cases end to end (on XLA where it is installed).
"""
import pytest
import torch

import xla_lora_pass as xlp
from graph_rewrites import BASE_WEIGHT, SAVED_PARAM, unrewritten_lora_weights
from graph_rewrites.passes.saved_modules import find_region, saved_param_inputs

from .helpers import (assert_golden, capture_graphs, check_rewrite, count_ops, normalize_gm, run_rewritten,
                      shrink_expand_counts)
from .models import TinyLM, peft_tiny_lm, per_row_eager
from .tiny_lm_rewrites import ROWS, SEQ, map_rows, registered, rewritten, tiny_ids

# Adapters trained on different target_modules: "sql" (active) on q only, "chat" on everything, "code" on the MLP.
DIFFERENT_TARGETS = [dict(name="sql", targets=["q"]),
                     dict(name="chat", targets=["embed", "q", "k", "v", "up", "down"], r=4, alpha=2),
                     dict(name="code", targets=["up", "down"], r=3, alpha=6, use_rslora=True)]
SAVED = [dict(name="sql", targets=["q", "v"], modules_to_save=["lm_head", "classifier"]),
         dict(name="chat", targets=["k"], modules_to_save=["lm_head"]),
         dict(name="code", targets=["q"], r=3, modules_to_save=["classifier", "embed"])]


def _assert_matches(new_gm, example_inputs, meta, rows, reference):
    """The rewritten graph, run on ``rows`` (SEQ tokens each), equals eager PEFT to 1e-4."""
    map_rows(meta, rows, SEQ)
    out = run_rewritten(new_gm, example_inputs, meta, (len(rows), SEQ))
    for got, want in zip(out, reference):
        assert (got - want).abs().max().item() < 1e-4


@pytest.mark.parametrize("kernel", ["masked", "auto"])
def test_sites_of_inactive_adapters_are_served(kernel):
    """Case 1 of the issue: layers holding only inactive adapters get the BGMV computation attached."""
    model = peft_tiny_lm(DIFFERENT_TARGETS)
    meta = registered(model)
    ids = tiny_ids()
    reference = per_row_eager(model, ids, ROWS)
    _, example_inputs, new_gm, report = rewritten(model, meta, ids, kernel)
    assert report.counts() == {"lora_linear": 1, "lora_attach": 5}, report.format()
    assert report.near_misses == []
    _assert_matches(new_gm, example_inputs, meta, ROWS, reference)


def test_attach_golden(update_golden, monkeypatch):
    monkeypatch.setattr(xlp.config, "kernel", "masked")  # the kernel the golden was made with
    model = peft_tiny_lm([dict(name="sql", targets=["q"]), dict(name="chat", targets=["embed", "down"], r=4)])
    meta = registered(model)
    ids = tiny_ids(ROWS[:2])
    map_rows(meta, ROWS[:2], SEQ)
    # q (the active adapter's branch) and down: a shrink each; embed: its own shrink and a masked expand.
    ops = shrink_expand_counts(2, 3, also={torch.ops.xla_lora.bgmv_embedding_shrink.default: 1})
    new_gm, _ = check_rewrite(model, [ids], meta, rewrites={"lora_linear": 1, "lora_attach": 2}, ops=ops,
                              reference=per_row_eager(model, ids, ROWS[:2])[0], token_dims=(2, SEQ))
    assert_golden("lora_attach", normalize_gm(new_gm), update_golden)


def test_attach_on_gpt2_conv1d_addmm():
    """GPT-2's Conv1D base op is ``addmm(b, x.view(-1, in), W)``: the attach reads x's token dims."""
    from xla_lora_pass.demo_models import tiny_peft_gpt2

    model, names = tiny_peft_gpt2(targets=("c_attn",), adapters=(("sql", 4, 8),))
    from peft import LoraConfig
    model.add_adapter("chat", LoraConfig(r=2, lora_alpha=4, target_modules=["c_proj", "c_fc"],
                                         init_lora_weights=False, fan_in_fan_out=True))
    model.set_adapter("sql")
    meta = registered(model)
    ids = torch.randint(0, 128, (2, 6), generator=torch.Generator().manual_seed(3))
    rows = ["chat", "sql"]
    with torch.no_grad():
        reference = model(input_ids=ids, adapter_names=rows).logits
    map_rows(meta, rows, 6)
    new_gm, report = check_rewrite(lambda i: model(input_ids=i).logits, [ids], meta,
                                   rewrites={"lora_linear": 2, "lora_attach": 6}, ops={}, reference=reference,
                                   token_dims=(2, 6))
    assert report.near_misses == []


def test_base_weights_are_marked_by_identity_only():
    model = peft_tiny_lm(DIFFERENT_TARGETS)
    meta = registered(model)
    (gm, example_inputs), = capture_graphs(model, tiny_ids())
    new_gm, _ = xlp.rewrite(gm, example_inputs, meta)
    marked = {r.site for n in new_gm.graph.find_nodes(op="placeholder") for r in n.meta.get(BASE_WEIGHT, ())}
    assert marked == set(meta.sites)
    # A copy of a base weight is not the site's weight.
    lm = model.base_model.model
    assert meta.lookup_base(lm.q.base_layer.weight) == ("base_model.model.q",)
    assert meta.lookup_base(lm.q.base_layer.weight.clone()) == ()


# ----------------------------------------------------------------------------------------- modules_to_save

@pytest.mark.parametrize("rows", [ROWS, ["code", "code", "sql", None]])
def test_saved_modules_are_served_per_token_and_per_row(rows):
    """Case 2: lm_head (a Linear copy per adapter), embed (an Embedding copy) and a pooled head."""
    model = peft_tiny_lm(SAVED)
    meta = registered(model)
    assert set(meta.saved_modules) == {"base_model.model.lm_head", "base_model.model.classifier",
                                       "base_model.model.embed"}
    ids = tiny_ids(rows)
    reference = per_row_eager(model, ids, rows)
    _, example_inputs, new_gm, report = rewritten(model, meta, ids)
    assert report.counts()["saved_module"] == 3, report.format()
    assert report.near_misses == []
    assert not any(n.users for n in new_gm.graph.find_nodes(op="placeholder") if SAVED_PARAM in n.meta)
    _assert_matches(new_gm, example_inputs, meta, rows, reference)


def test_saved_module_golden(update_golden, monkeypatch):
    monkeypatch.setattr(xlp.config, "kernel", "masked")  # the kernel the golden was made with
    model = peft_tiny_lm([dict(name="sql", targets=["q"], modules_to_save=["lm_head"]),
                          dict(name="chat", targets=["q"], modules_to_save=["classifier"])])
    meta = registered(model)
    ids = tiny_ids(ROWS[:2])
    map_rows(meta, ROWS[:2], SEQ)
    ops = shrink_expand_counts(1, 1, also={torch.where: 2})  # a where per adapter with a copy, per module
    new_gm, _ = check_rewrite(model, [ids], meta, rewrites={"lora_linear": 1, "saved_module": 2}, ops=ops,
                              reference=per_row_eager(model, ids, ROWS[:2])[0], token_dims=(2, SEQ))
    assert_golden("saved_module", normalize_gm(new_gm), update_golden)


def test_pooled_head_refuses_adapters_mixed_within_a_row():
    model = peft_tiny_lm(SAVED)
    meta = registered(model)
    compiled = torch.compile(model, backend=xlp.make_backend(meta, inner="aot_eager"))
    ids = tiny_ids()
    meta.set_token_adapters(["sql", "chat"] + ["sql"] * (SEQ - 2) + [None] * SEQ * 3)
    with pytest.raises(xlp.UnsupportedMappingError, match="saved module .* pools each row to one output"):
        with torch.no_grad():
            compiled(ids)
    rows = ["chat", "sql", "code", None]
    map_rows(meta, rows, SEQ)
    with torch.no_grad():
        out = compiled(ids)
    for got, want in zip(out, per_row_eager(model, ids, rows)):
        assert (got - want).abs().max().item() < 1e-4
    torch._dynamo.reset()


class _HeadReadsItsOutputTwice(torch.nn.Module):
    """A near miss: the saved lm_head's weight is also read outside the module (a tied use)."""

    def __init__(self):
        super().__init__()
        self.inner = peft_tiny_lm([dict(name="sql", targets=["q"], modules_to_save=["lm_head"]),
                                   dict(name="chat", targets=["q"])])

    def forward(self, ids):
        logits, pooled = self.inner(ids)
        head = self.inner.base_model.model.lm_head.modules_to_save["sql"]
        return logits + (pooled.sum() * head.weight.sum())


def test_saved_module_read_outside_its_region_is_a_near_miss_and_a_leftover():
    model = _HeadReadsItsOutputTwice().eval()
    meta = registered(model.inner)
    _, _, new_gm, report = rewritten(model, meta, tiny_ids())
    [miss] = [n for n in report.near_misses if n.site == "base_model.model.lm_head"]
    assert "also read outside the module" in miss.reason
    assert unrewritten_lora_weights(new_gm)["base_model.model.lm_head"].adapter == "sql"


def test_register_refuses_a_saved_module_it_cannot_serve():
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    cfg = LoraConfig(r=2, target_modules=["q"], trainable_token_indices={"embed": [1, 2]})
    try:
        model = get_peft_model(TinyLM(), cfg)
    except (TypeError, ValueError) as exc:  # a peft without trainable tokens
        pytest.skip(f"this peft has no trainable_token_indices: {exc}")
    meta = xlp.LoRAMetadata(max_num_tokens=64)
    with pytest.raises(ValueError, match=r"register_adapters: base_model.model.embed is a PEFT TrainableTokens"):
        meta.register_adapters(model)


def test_saved_copy_of_another_structure_is_refused():
    model = peft_tiny_lm([dict(name="sql", targets=["q"], modules_to_save=["lm_head"])])
    wrapper = model.base_model.model.lm_head
    wrapper.modules_to_save["sql"] = torch.nn.Linear(16, 32, bias=True)
    with pytest.raises(ValueError, match=r"modules_to_save base_model.model.lm_head: adapter 'sql'"):
        xlp.LoRAMetadata(max_num_tokens=64).register_adapters(model)


def test_region_is_found_through_the_wrapper_identity():
    """The region is the nodes whose nn_module_stack holds the wrapper's own key: the head's four ops."""
    model = peft_tiny_lm(SAVED)
    meta = registered(model)
    (gm, example_inputs), = capture_graphs(model, tiny_ids())
    from xla_lora_pass.backend.rewrite import annotate_lora_weights

    annotate_lora_weights(gm, example_inputs, meta)
    params = saved_param_inputs(gm)["base_model.model.classifier"]
    assert {p.meta[SAVED_PARAM].param for p in params} == {"dense.weight", "dense.bias", "out_proj.weight",
                                                           "out_proj.bias"}
    region, reason = find_region(gm, params)
    assert reason is None
    import operator
    assert [n.target for n in region.nodes] == [operator.getitem, torch._C._nn.linear, torch.tanh,
                                                torch._C._nn.linear]
    assert [a.op for a in region.activations] == ["call_function"]  # h, the output of the residual add
    for node in gm.graph.find_nodes(op="placeholder"):  # annotated a copy's tensors only: undo for Dynamo
        node.meta.pop(SAVED_PARAM, None)


@pytest.mark.parametrize("kernel", ["masked", "auto"])
def test_lora_bias_of_an_inactive_adapter_is_added(kernel):
    """The active adapter's branch has no bias, another adapter at the site has one: its slot gets it
    (found by the property test: the bias was dropped when the traced branch had none)."""
    model = peft_tiny_lm([dict(name="sql", targets=["q", "k"]), dict(name="chat", targets=["q"], lora_bias=True)])
    meta = registered(model)
    rows = ["chat", "sql", None, "chat"]
    ids = tiny_ids(rows)
    reference = per_row_eager(model, ids, rows)
    _, example_inputs, new_gm, report = rewritten(model, meta, ids, kernel)
    assert report.counts() == {"lora_linear": 2}
    assert count_ops(new_gm, torch.ops.xla_lora.bgmv_bias.default) == 1
    _assert_matches(new_gm, example_inputs, meta, rows, reference)


def test_load_adapter_refuses_an_adapter_with_saved_copies():
    model = peft_tiny_lm([dict(name="sql", targets=["q"], modules_to_save=["lm_head"]), dict(name="chat", targets=["q"])])
    meta = registered(model)
    q = model.base_model.model.q
    state = {"q.lora_A.weight": q.lora_A["sql"].weight.detach(), "q.lora_B.weight": q.lora_B["sql"].weight.detach()}
    with pytest.raises(ValueError, match=r"load_adapter\('sql'\): this adapter has PEFT modules_to_save copies"):
        meta.load_adapter("sql", state, scaling=1.0)
    assert meta.load_adapter("chat", state, scaling=1.0) == 1  # no saved copies: loaded
