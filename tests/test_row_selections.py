"""graph_rewrites/passes/row_selections.py: a pooled head (BERT's pooler and classifier) reads the rows of its
selection ``hidden[:, 0]``, accepted only where the graph's row-wise ops prove it."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import xla_lora_pass as xlp
from graph_rewrites.passes.row_selections import row_selections

from .golden_graphs import assert_golden, normalize_gm
from .helpers import capture_graphs, check_rewrite, lora_weight_uses, per_adapter_reference
from .models import with_peft_adapters

B, S, H = 3, 5, 16
ROWS = ["sql", None, "chat"]
ADAPTERS = (("sql", 4, 8), ("chat", 8, 16))  # (name, rank, alpha), the first active


class _PooledHead(nn.Module):
    """BERT's shape in small: q/k on [B, S, H], then the pooler (``h[:, 0]``, dense, tanh) and a classifier
    on [B, H]; ``transposed`` pools ``h.transpose(0, 1)[:, 0]`` instead, the tokens of the first row."""

    def __init__(self, transposed=False):
        super().__init__()
        self.q, self.k = nn.Linear(H, H), nn.Linear(H, H)
        self.dense, self.classifier = nn.Linear(H, H), nn.Linear(H, 3)
        self.transposed = transposed

    def forward(self, x):
        h = self.q(x) + self.k(x)
        pooled = torch.tanh(self.dense(h.transpose(0, 1)[:, 0] if self.transposed else h[:, 0]))
        return self.classifier(F.dropout(pooled, 0.1, training=False))


def _model(**kw):
    return with_peft_adapters(lambda: _PooledHead(**kw), ["q", "k", "dense", "classifier"], ADAPTERS, 0)


def _meta(model):
    meta = xlp.LoRAMetadata(max_num_tokens=64)
    meta.register_adapters(model)
    meta.set_token_adapters([r for r in ROWS for _ in range(S)])  # per token: the kernels that read token indices
    return meta


@pytest.mark.parametrize("kernel", ["masked", "segments", "sorted", "auto"])
def test_a_pooled_head_is_rewritten_golden_and_exact(update_golden, monkeypatch, kernel):
    """Every kernel: the ones that read token indices give the pooled sites the selection's indices (the
    golden graph is the masked kernel's); "auto" runs the row kernel, which gives them their row's slot."""
    monkeypatch.setattr(xlp.config, "kernel", kernel)
    model = _model()
    x = torch.randn(B, S, H, generator=torch.Generator().manual_seed(1))
    reference = per_adapter_reference(model, ROWS, lambda m: m(x))
    with torch.no_grad():  # PEFT's own mixed batch agrees
        mixed = model(x, adapter_names=["__base__" if r is None else r for r in ROWS])
    torch.testing.assert_close(mixed, reference, atol=1e-6, rtol=0)
    meta = _meta(model)
    new_gm, report = check_rewrite(model, [x], meta, rewrites={"lora_linear": 4}, ops={}, reference=reference,
                                   token_dims=(B, S))
    assert report.near_misses == [] and lora_weight_uses(new_gm) == 0
    if kernel == "masked":
        assert_golden("pooled_head", normalize_gm(new_gm), update_golden)


def test_a_selection_across_rows_is_a_near_miss_and_refused():
    model = _model(transposed=True)
    meta = _meta(model)
    x = torch.randn(B, S, H, generator=torch.Generator().manual_seed(1))
    (gm, example_inputs), = capture_graphs(model, x)
    _, report = xlp.rewrite(gm, example_inputs, meta)
    assert sorted(s.site for s in report.sites) == [f"base_model.model.{n}" for n in ("k", "q")]
    missed = {n.site: n.reason for n in report.near_misses}
    assert set(missed) == {"base_model.model.dense", "base_model.model.classifier"}, missed
    assert all("row selection" in reason for reason in missed.values())
    compiled = torch.compile(model, backend=xlp.make_backend(meta, inner="aot_eager"))
    with pytest.raises(xlp.UnsupportedMappingError, match="base_model.model.dense"):
        with torch.no_grad():
            compiled(x)
    torch._dynamo.reset()


def test_row_selections_follow_row_wise_ops_of_one_selection_only():
    def fn(x, w):
        first = x[:, 0]
        kept = torch.tanh(F.layer_norm(first, (H,)) + first)
        last = x[:, -2:, :]
        return kept @ w, kept + x[:, 1], kept.flip(0) + kept, F.relu(last)

    (gm, _), = capture_graphs(fn, torch.randn(B, S, H), torch.randn(H, H))
    x = next(iter(gm.graph.find_nodes(op="placeholder")))
    layout = tuple(x.meta["example_value"].shape[:2])
    found = {n.name: p.name for n, p in row_selections(gm, layout).items()}
    assert found == {"first": "first", "layer_norm": "first", "add": "first", "kept": "first",
                     "last": "last", "relu": "last", "getitem_2": "getitem_2"}
    # not: the matmul (not a row-wise op here), add_1 (two selections), flip (moves rows) and add_2 (of it)
    assert row_selections(gm, None) == {}
