"""Issue 28: a base weight shared by several sites (tied embeddings: ``embed`` and ``lm_head`` read one tensor).

Each site is found by its own op (an embedding lookup or a linear; linears sharing a weight by the module
the op runs in) or by its LoRA branch, and served; a use of the shared weight no site can be told for is a
near miss the mapping guard refuses by name.  The pass alone on the CPU, where the tie made before PEFT
wraps the model holds; on XLA (the tie made again on the device):
tests/test_heads_and_target_modules.py::test_tied_embeddings_retied_on_the_device.
"""
import pytest
import torch
import torch.nn.functional as F

import xla_lora_pass as xlp
from graph_rewrites import BASE_WEIGHT
from xla_lora_pass.adapters.records import SiteSpec
from xla_lora_pass.metadata.param_index import ParamIndex

from .helpers import assert_golden, capture_graphs, check_rewrite, normalize_gm, run_rewritten, shrink_expand_counts
from .models import TinyLM, peft_tiny_lm, per_row_around, per_row_eager

pytestmark = pytest.mark.compat  # how PEFT wraps a tied pair (and warns about it) changes between releases

SEQ = 5
EMBED, HEAD, Q, K = ("base_model.model." + n for n in ("embed", "lm_head", "q", "k"))
# "both" has LoRA on both tied sites, "emb" and "head" on one of them each, "sql" on neither.
TIED_HEAD = [dict(name="sql", targets=["q"]), dict(name="both", targets=["embed", "lm_head"], r=4, alpha=2),
             dict(name="emb", targets=["embed"], r=3), dict(name="head", targets=["lm_head"], r=2, alpha=8)]
ROWS = ["both", "sql", None, "emb", "head"]


def _tied(*pairs):
    """A TinyLM maker whose ``(a, b)`` pairs share one weight: ``a.weight = b.weight``, as HF's tie_weights does."""
    def make():
        lm = TinyLM()
        for a, b in pairs:
            getattr(lm, a).weight = getattr(lm, b).weight
        return lm
    return make


def _ids(rows, seed=0):
    return torch.randint(0, 32, (len(rows), SEQ), generator=torch.Generator().manual_seed(seed))


def _registered(model):
    meta = xlp.LoRAMetadata(max_num_tokens=64)
    meta.register_adapters(model)
    return meta


def _mapped(meta, rows):
    meta.set_token_adapters([r for r in rows for _ in range(SEQ)])


def test_param_index_keeps_every_site_of_a_shared_base_weight():
    embed, head, q = torch.nn.Embedding(32, 16), torch.nn.Linear(16, 32, bias=False), torch.nn.Linear(16, 16)
    head.weight = embed.weight
    sites = [SiteSpec(name, kind, 16, 32, {}, module=m, base_weight_attr="weight")
             for name, kind, m in (("embed", "embedding", embed), ("q", "linear", q), ("lm_head", "linear", head))]
    index = ParamIndex()
    index.refresh(sites, [])
    assert index.lookup_base(embed.weight) == ("embed", "lm_head")  # every site, in registration order
    assert index.weight_ref(head.weight).bases == ("embed", "lm_head")
    assert index.lookup_base(q.weight) == ("q",)
    assert index.lookup_base(embed.weight.clone()) == ()


@pytest.mark.parametrize("kernel", ["masked", "auto"])
@pytest.mark.parametrize("active", ["sql", "both", "emb", "head"])
def test_tied_embed_and_lm_head_are_both_served(active, kernel):
    """Whatever adapter is active (its branch at both, one or neither tied site), every row equals PEFT."""
    model = peft_tiny_lm(TIED_HEAD, base=_tied(("lm_head", "embed")))
    lm = model.base_model.model
    assert lm.lm_head.base_layer.weight is lm.embed.base_layer.weight
    model.set_adapter(active)
    meta = _registered(model)
    ids = _ids(ROWS)
    reference = per_row_eager(model, ids, ROWS)
    (gm, example_inputs), = capture_graphs(model, ids)
    new_gm, report = xlp.rewrite(gm, example_inputs, meta, kernel=kernel)
    assert report.error is None and report.near_misses == [], report.format()
    assert {EMBED, HEAD} <= {s.site for s in report.sites}, report.format()
    marked = [n.meta[BASE_WEIGHT] for n in new_gm.graph.find_nodes(op="placeholder") if BASE_WEIGHT in n.meta]
    assert sorted(tuple(r.site for r in refs) for refs in marked) == [(EMBED, HEAD), (Q,)]
    _mapped(meta, ROWS)
    for got, want in zip(run_rewritten(new_gm, example_inputs, meta, (len(ROWS), SEQ)), reference):
        assert (got - want).abs().max().item() < 1e-4


def test_tied_attach_golden(update_golden, monkeypatch):
    monkeypatch.setattr(xlp.config, "kernel", "masked")  # the kernel the golden was made with
    model = peft_tiny_lm(TIED_HEAD[:2], base=_tied(("lm_head", "embed")))
    meta = _registered(model)
    rows = ["both", "sql"]
    ids = _ids(rows)
    _mapped(meta, rows)
    # q (the active adapter's branch) and lm_head (attached): a shrink each; embed (attached): its own shrink.
    ops = shrink_expand_counts(2, 3, also={torch.ops.xla_lora.bgmv_embedding_shrink.default: 1})
    new_gm, _ = check_rewrite(model, [ids], meta, rewrites={"lora_linear": 1, "lora_attach": 2}, ops=ops,
                              reference=per_row_eager(model, ids, rows)[0], token_dims=(2, SEQ))
    assert_golden("lora_attach_tied", normalize_gm(new_gm), update_golden)


QK = [dict(name="sql", targets=["v"]), dict(name="chat", targets=["q", "k"], r=4, alpha=2),
      dict(name="code", targets=["k"], r=3)]


@pytest.mark.parametrize("kernel", ["masked", "auto"])
def test_linears_sharing_a_base_weight_are_told_apart_by_their_module(kernel):
    """q and k read one weight with one op each: each op is its own site's (its nn_module_stack)."""
    model = peft_tiny_lm(QK, base=_tied(("k", "q")))
    meta = _registered(model)
    rows = ["chat", "sql", None, "code"]
    ids = _ids(rows)
    reference = per_row_eager(model, ids, rows)
    (gm, example_inputs), = capture_graphs(model, ids)
    new_gm, report = xlp.rewrite(gm, example_inputs, meta, kernel=kernel)
    assert report.near_misses == [], report.format()
    assert report.counts() == {"lora_linear": 1, "lora_attach": 2}
    _mapped(meta, rows)
    for got, want in zip(run_rewritten(new_gm, example_inputs, meta, (len(rows), SEQ)), reference):
        assert (got - want).abs().max().item() < 1e-4


class _SharedWeightReadOutside(torch.nn.Module):
    """The weight q and k share is also read by a linear in neither module (the model's own read)."""

    def __init__(self):
        super().__init__()
        self.inner = peft_tiny_lm(QK, base=_tied(("k", "q")))

    def forward(self, ids):
        lm = self.inner.base_model.model
        logits, _ = self.inner(ids)
        return logits, F.linear(lm.embed(ids), lm.q.base_layer.weight)


def test_a_shared_base_weight_read_outside_every_site_is_left_alone():
    """PEFT computes no LoRA at the model's own read of the weight: left alone, a mixed batch is exact.  (It
    was a near miss that refused every mixed batch: "the pass cannot tell whose it is".)"""
    model = _SharedWeightReadOutside().eval()
    meta = _registered(model.inner)
    rows = ["chat", "sql", None, "code"]
    ids = _ids(rows)
    want = per_row_around(model, model.inner, ids, rows)
    (gm, example_inputs), = capture_graphs(model, ids)
    _, report = xlp.rewrite(gm, example_inputs, meta, kernel="masked")
    assert report.near_misses == [], report.format()
    assert report.counts() == {"lora_linear": 1, "lora_attach": 2}  # v's branch; q and k in their modules
    compiled = torch.compile(model, backend=xlp.make_backend(meta, inner="aot_eager"))
    _mapped(meta, rows)
    with torch.no_grad():
        for got, w in zip(compiled(ids), want):
            assert (got - w).abs().max().item() < 1e-4
    torch._dynamo.reset()
