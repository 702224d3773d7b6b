"""Issue 12: every registered adapter at every site, and PEFT's modules_to_save, served per token or row.

The pass alone on the CPU (golden graphs, numbers against eager PEFT, near
misses); tests/test_heads_and_target_modules.py runs the same cases end to end (on XLA where it is installed).
"""
import pytest
import torch
import torch.fx as fx

import xla_lora_pass as xlp
from graph_rewrites import BASE_WEIGHT, SAVED_PARAM, unrewritten_lora_weights
from graph_rewrites.passes.saved_modules import find_region, saved_param_inputs

from .helpers import (assert_golden, capture_graphs, check_rewrite, count_ops, normalize_gm, run_rewritten,
                      shrink_expand_counts)
from .models import TinyLM, peft_tiny_lm, per_row_around, per_row_eager

ROWS = ["sql", "chat", None, "code"]
SEQ = 5
# Adapters trained on different target_modules: "sql" (active) on q only, "chat" on everything, "code" on the MLP.
DIFFERENT_TARGETS = [dict(name="sql", targets=["q"]),
                     dict(name="chat", targets=["embed", "q", "k", "v", "up", "down"], r=4, alpha=2),
                     dict(name="code", targets=["up", "down"], r=3, alpha=6, use_rslora=True)]
SAVED = [dict(name="sql", targets=["q", "v"], modules_to_save=["lm_head", "classifier"]),
         dict(name="chat", targets=["k"], modules_to_save=["lm_head"]),
         dict(name="code", targets=["q"], r=3, modules_to_save=["classifier", "embed"])]


def _ids(rows=ROWS, seq=SEQ, seed=0):
    return torch.randint(0, 32, (len(rows), seq), generator=torch.Generator().manual_seed(seed))


def _registered(model):
    meta = xlp.LoRAMetadata(max_num_tokens=64)
    meta.register_adapters(model)
    return meta


def _mapped(meta, rows, seq):
    meta.set_token_adapters([r for r in rows for _ in range(seq)])


def _assert_matches(new_gm, example_inputs, meta, rows, reference):
    """The rewritten graph, run on ``rows`` (SEQ tokens each), equals eager PEFT to 1e-4."""
    _mapped(meta, rows, SEQ)
    out = run_rewritten(new_gm, example_inputs, meta, (len(rows), SEQ))
    for got, want in zip(out, reference):
        assert (got - want).abs().max().item() < 1e-4


def _rewritten(model, meta, ids, kernel="masked"):
    (gm, example_inputs), = capture_graphs(model, ids)
    new_gm, report = xlp.rewrite(gm, example_inputs, meta, kernel=kernel)
    assert report.error is None, report.error
    return gm, example_inputs, new_gm, report


@pytest.mark.parametrize("kernel", ["masked", "auto"])
def test_sites_of_inactive_adapters_are_served(kernel):
    """Case 1 of the issue: layers holding only inactive adapters get the BGMV computation attached."""
    model = peft_tiny_lm(DIFFERENT_TARGETS)
    meta = _registered(model)
    ids = _ids()
    reference = per_row_eager(model, ids, ROWS)
    _, example_inputs, new_gm, report = _rewritten(model, meta, ids, kernel)
    assert report.counts() == {"lora_linear": 1, "lora_attach": 5}, report.format()
    assert report.near_misses == []
    _assert_matches(new_gm, example_inputs, meta, ROWS, reference)


def test_attach_golden(update_golden, monkeypatch):
    monkeypatch.setattr(xlp.config, "kernel", "masked")  # the kernel the golden was made with
    model = peft_tiny_lm([dict(name="sql", targets=["q"]), dict(name="chat", targets=["embed", "down"], r=4)])
    meta = _registered(model)
    ids = _ids(ROWS[:2])
    _mapped(meta, ROWS[:2], SEQ)
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
    meta = _registered(model)
    ids = torch.randint(0, 128, (2, 6), generator=torch.Generator().manual_seed(3))
    rows = ["chat", "sql"]
    with torch.no_grad():
        reference = model(input_ids=ids, adapter_names=rows).logits
    _mapped(meta, rows, 6)
    new_gm, report = check_rewrite(lambda i: model(input_ids=i).logits, [ids], meta,
                                   rewrites={"lora_linear": 2, "lora_attach": 6}, ops={}, reference=reference,
                                   token_dims=(2, 6))
    assert report.near_misses == []


class _MatmulLinear(torch.nn.Linear):
    """Falcon's ``FalconLinear``: an ``nn.Linear`` whose forward is ``x @ W.T + b`` (PEFT wraps it as a Linear)."""

    def forward(self, x):
        return x @ self.weight.T + self.bias


class _MatmulLinearMethod(torch.nn.Linear):
    """The same with ``W.t()``, which Dynamo records alike on every torch (``W.T`` is ``getattr`` on torch 2.9,
    ``aten.numpy_T`` after): the golden's graph."""

    def forward(self, x):
        return x @ self.weight.t() + self.bias


class _LeftMatmulLinear(torch.nn.Linear):
    """A near miss: the base weight on the left, ``(W @ x^T)^T + b``, a form the attach does not know."""

    def forward(self, x):
        return (self.weight @ x.transpose(-1, -2)).transpose(-1, -2) + self.bias


def _tiny_lm_with_k(kind):
    class _Base(TinyLM):
        def __init__(self):
            super().__init__()
            self.k = kind(16, 16)

    return _Base


def test_attach_on_a_matmul_base_op(update_golden, monkeypatch):
    """k's base op is ``x @ W.T`` (Falcon's form) and k holds only an inactive adapter: the attach serves it.
    Before, the form was a near miss at every such site, also after patterns 1-5 had rewritten its active
    branch, and every mixed batch of a PEFT Falcon was refused."""
    monkeypatch.setattr(xlp.config, "kernel", "masked")
    model = peft_tiny_lm([dict(name="sql", targets=["q", "k"]), dict(name="chat", targets=["k"], r=4)],
                         base=_tiny_lm_with_k(_MatmulLinear))
    meta = _registered(model)
    rows = ["chat", "sql", None]
    ids = _ids(rows)
    _mapped(meta, rows, SEQ)
    new_gm, report = check_rewrite(model, [ids], meta, rewrites={"lora_linear": 2}, ops={},
                                   reference=per_row_eager(model, ids, rows)[0], token_dims=(3, SEQ))
    assert report.near_misses == []
    model.set_adapter("chat")  # k's branch is the only one traced: q gets the attach, k the pattern
    new_gm, report = check_rewrite(model, [ids], meta, rewrites={"lora_linear": 1, "lora_attach": 1}, ops={},
                                   reference=per_row_eager(model, ids, rows)[0], token_dims=(3, SEQ))
    assert report.near_misses == []
    for kind in (_MatmulLinear, _MatmulLinearMethod):
        only_inactive = peft_tiny_lm([dict(name="sql", targets=["q"]), dict(name="chat", targets=["k"], r=4)],
                                     base=_tiny_lm_with_k(kind))
        meta = _registered(only_inactive)
        _mapped(meta, rows, SEQ)
        new_gm, report = check_rewrite(only_inactive, [ids], meta, rewrites={"lora_linear": 1, "lora_attach": 1},
                                       ops={}, reference=per_row_eager(only_inactive, ids, rows)[0],
                                       token_dims=(3, SEQ))
        assert report.near_misses == []
    assert_golden("lora_attach_matmul", normalize_gm(new_gm), update_golden)


def test_base_weight_in_an_unknown_form_is_a_near_miss_and_a_leftover():
    model = peft_tiny_lm([dict(name="sql", targets=["q"]), dict(name="chat", targets=["k"])],
                         base=_tiny_lm_with_k(_LeftMatmulLinear))
    meta = _registered(model)
    gm, example_inputs, new_gm, report = _rewritten(model, meta, _ids())
    [miss] = [n for n in report.near_misses if n.site == "base_model.model.k"]
    assert "a form the pass cannot attach" in miss.reason
    leftovers = unrewritten_lora_weights(new_gm)
    assert leftovers["base_model.model.k"].adapter is None  # computes the base model for every token
    compiled = torch.compile(model, backend=xlp.make_backend(meta, inner="aot_eager"))
    _mapped(meta, ["sql", "chat", None, "sql"], SEQ)
    with pytest.raises(xlp.UnsupportedMappingError, match=r"base_model.model.k \(the base model\): its base weight"):
        with torch.no_grad():
            compiled(_ids())
    meta.set_token_adapters([None] * (len(ROWS) * SEQ))  # the one mapping k computes: the base model
    with torch.no_grad(), model.disable_adapter():
        want = model(_ids())[0]
    with torch.no_grad():
        assert (compiled(_ids())[0] - want).abs().max().item() < 1e-4
    torch._dynamo.reset()


class _ReadsBaseWeightsItself(torch.nn.Module):
    """The model reads k's and q's base weights itself, outside their LoRA layers, where PEFT computes no LoRA."""

    def __init__(self):
        super().__init__()
        self.inner = peft_tiny_lm([dict(name="sql", targets=["q"]), dict(name="chat", targets=["k", "q"])])

    def forward(self, ids):
        lm = self.inner.base_model.model
        h = lm.embed(ids)
        return lm.q(h) + torch.nn.functional.linear(h, lm.k.base_layer.weight) + h @ lm.q.base_layer.weight.t()


def test_a_base_weight_read_outside_its_lora_layer_is_left_alone():
    """Before, the attach added k's LoRA to the model's own ``linear(h, W_k)``: rows on "chat" were 2.9 off."""
    model = _ReadsBaseWeightsItself().eval()
    meta = _registered(model.inner)
    rows = ["chat", "sql", None, "chat"]
    ids = _ids(rows)
    want = per_row_around(model, model.inner, ids, rows)
    model.inner.set_adapter("sql")
    _, example_inputs, new_gm, report = _rewritten(model, meta, ids)
    assert report.counts() == {"lora_linear": 1}, report.format()  # q's own branch, nothing attached
    assert report.near_misses == []
    _mapped(meta, rows, SEQ)
    out = run_rewritten(new_gm, example_inputs, meta, (len(rows), SEQ))
    assert (out[0] - want).abs().max().item() < 1e-4


def test_base_weights_are_marked_by_identity_only():
    model = peft_tiny_lm(DIFFERENT_TARGETS)
    meta = _registered(model)
    (gm, example_inputs), = capture_graphs(model, _ids())
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
    meta = _registered(model)
    assert set(meta.saved_modules) == {"base_model.model.lm_head", "base_model.model.classifier",
                                       "base_model.model.embed"}
    ids = _ids(rows)
    reference = per_row_eager(model, ids, rows)
    _, example_inputs, new_gm, report = _rewritten(model, meta, ids)
    assert report.counts()["saved_module"] == 3, report.format()
    assert report.near_misses == []
    assert not any(n.users for n in new_gm.graph.find_nodes(op="placeholder") if SAVED_PARAM in n.meta)
    _assert_matches(new_gm, example_inputs, meta, rows, reference)


def test_saved_module_golden(update_golden, monkeypatch):
    monkeypatch.setattr(xlp.config, "kernel", "masked")  # the kernel the golden was made with
    model = peft_tiny_lm([dict(name="sql", targets=["q"], modules_to_save=["lm_head"]),
                          dict(name="chat", targets=["q"], modules_to_save=["classifier"])])
    meta = _registered(model)
    ids = _ids(ROWS[:2])
    _mapped(meta, ROWS[:2], SEQ)
    ops = shrink_expand_counts(1, 1, also={torch.where: 2})  # a where per adapter with a copy, per module
    new_gm, _ = check_rewrite(model, [ids], meta, rewrites={"lora_linear": 1, "saved_module": 2}, ops=ops,
                              reference=per_row_eager(model, ids, ROWS[:2])[0], token_dims=(2, SEQ))
    assert_golden("saved_module", normalize_gm(new_gm), update_golden)


def test_pooled_head_refuses_adapters_mixed_within_a_row():
    model = peft_tiny_lm(SAVED)
    meta = _registered(model)
    compiled = torch.compile(model, backend=xlp.make_backend(meta, inner="aot_eager"))
    ids = _ids()
    meta.set_token_adapters(["sql", "chat"] + ["sql"] * (SEQ - 2) + [None] * SEQ * 3)
    with pytest.raises(xlp.UnsupportedMappingError, match="saved module .* pools each row to one output"):
        with torch.no_grad():
            compiled(ids)
    rows = ["chat", "sql", "code", None]
    _mapped(meta, rows, SEQ)
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
    meta = _registered(model.inner)
    _, _, new_gm, report = _rewritten(model, meta, _ids())
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
    meta = _registered(model)
    (gm, example_inputs), = capture_graphs(model, _ids())
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
    meta = _registered(model)
    rows = ["chat", "sql", None, "chat"]
    ids = _ids(rows)
    reference = per_row_eager(model, ids, rows)
    _, example_inputs, new_gm, report = _rewritten(model, meta, ids, kernel)
    assert report.counts() == {"lora_linear": 2}
    assert count_ops(new_gm, torch.ops.xla_lora.bgmv_bias.default) == 1
    _assert_matches(new_gm, example_inputs, meta, rows, reference)


def test_load_adapter_refuses_an_adapter_with_saved_copies():
    model = peft_tiny_lm([dict(name="sql", targets=["q"], modules_to_save=["lm_head"]), dict(name="chat", targets=["q"])])
    meta = _registered(model)
    q = model.base_model.model.q
    state = {"q.lora_A.weight": q.lora_A["sql"].weight.detach(), "q.lora_B.weight": q.lora_B["sql"].weight.detach()}
    with pytest.raises(ValueError, match=r"load_adapter\('sql'\): this adapter has PEFT modules_to_save copies"):
        meta.load_adapter("sql", state, scaling=1.0)
    assert meta.load_adapter("chat", state, scaling=1.0) == 1  # no saved copies: loaded
