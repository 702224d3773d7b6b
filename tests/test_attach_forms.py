"""The base-op forms ``lora_attach`` serves, and the ones it leaves alone.

Falcon's ``x @ W.T + b`` is a linear base op; a base weight on the left of a
matmul is a form the attach does not know (a near miss, refused by name);
the model reading a LoRA layer's base weight itself, outside the layer, is
no site's (PEFT computes no LoRA there).  The pass alone on the CPU, against
eager PEFT.
"""
import pytest
import torch

import xla_lora_pass as xlp
from graph_rewrites import unrewritten_lora_weights

from .helpers import assert_golden, check_rewrite, normalize_gm, run_rewritten
from .models import TinyLM, peft_tiny_lm, per_row_around, per_row_eager
from .tiny_lm_rewrites import ROWS, SEQ, map_rows, registered, rewritten, tiny_ids


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
    meta = registered(model)
    rows = ["chat", "sql", None]
    ids = tiny_ids(rows)
    map_rows(meta, rows, SEQ)
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
        meta = registered(only_inactive)
        map_rows(meta, rows, SEQ)
        new_gm, report = check_rewrite(only_inactive, [ids], meta, rewrites={"lora_linear": 1, "lora_attach": 1},
                                       ops={}, reference=per_row_eager(only_inactive, ids, rows)[0],
                                       token_dims=(3, SEQ))
        assert report.near_misses == []
    assert_golden("lora_attach_matmul", normalize_gm(new_gm), update_golden)


def test_base_weight_in_an_unknown_form_is_a_near_miss_and_a_leftover():
    model = peft_tiny_lm([dict(name="sql", targets=["q"]), dict(name="chat", targets=["k"])],
                         base=_tiny_lm_with_k(_LeftMatmulLinear))
    meta = registered(model)
    gm, example_inputs, new_gm, report = rewritten(model, meta, tiny_ids())
    [miss] = [n for n in report.near_misses if n.site == "base_model.model.k"]
    assert "a form the pass cannot attach" in miss.reason
    leftovers = unrewritten_lora_weights(new_gm)
    assert leftovers["base_model.model.k"].adapter is None  # computes the base model for every token
    compiled = torch.compile(model, backend=xlp.make_backend(meta, inner="aot_eager"))
    map_rows(meta, ["sql", "chat", None, "sql"], SEQ)
    with pytest.raises(xlp.UnsupportedMappingError, match=r"base_model.model.k \(the base model\): its base weight"):
        with torch.no_grad():
            compiled(tiny_ids())
    meta.set_token_adapters([None] * (len(ROWS) * SEQ))  # the one mapping k computes: the base model
    with torch.no_grad(), model.disable_adapter():
        want = model(tiny_ids())[0]
    with torch.no_grad():
        assert (compiled(tiny_ids())[0] - want).abs().max().item() < 1e-4
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
    meta = registered(model.inner)
    rows = ["chat", "sql", None, "chat"]
    ids = tiny_ids(rows)
    want = per_row_around(model, model.inner, ids, rows)
    model.inner.set_adapter("sql")
    _, example_inputs, new_gm, report = rewritten(model, meta, ids)
    assert report.counts() == {"lora_linear": 1}, report.format()  # q's own branch, nothing attached
    assert report.near_misses == []
    map_rows(meta, rows, SEQ)
    out = run_rewritten(new_gm, example_inputs, meta, (len(rows), SEQ))
    assert (out[0] - want).abs().max().item() < 1e-4
