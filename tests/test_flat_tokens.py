"""graph_rewrites/flat_tokens.py: OPT's [B*S, H] token layout, accepted only where the graph's reshapes prove it."""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import xla_lora_pass as xlp
from graph_rewrites.passes.flat_tokens import flat_token_nodes

from .helpers import (assert_golden, capture_graphs, check_rewrite, lora_weight_uses, normalize_gm,
                      per_adapter_reference, shrink_expand_counts)
from .models import with_peft_adapters

B, S, H = 3, 4, 16
ROWS = ["sql", None, "chat"]
ADAPTERS = (("sql", 4, 8), ("chat", 8, 16))  # (name, rank, alpha), the first active


class _FlatMLP(nn.Module):
    """OPT's decoder layer in small: q/k/v on [B, S, H] (the layout most sites use), then fc1/fc2 on
    the tokens flattened to [B*S, H]."""

    def __init__(self, transpose_before_flatten=False):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(H, H), nn.Linear(H, H), nn.Linear(H, H)
        self.norm = nn.LayerNorm(H)
        self.fc1, self.fc2 = nn.Linear(H, 2 * H), nn.Linear(2 * H, H)
        self.transpose_before_flatten = transpose_before_flatten

    def forward(self, x):
        h = self.q(x) + self.k(x) * self.v(x)
        shape = h.shape
        if self.transpose_before_flatten:  # [S, B, H] flattened: tokens no longer in the mapping's order
            h = h.transpose(0, 1)
        h = h.reshape(-1, h.size(-1))
        residual = h
        h = self.fc2(F.relu(self.fc1(self.norm(h))))
        return (residual + h).view(shape)


def _model(**kw):
    return with_peft_adapters(lambda: _FlatMLP(**kw), ["q", "k", "v", "fc1", "fc2"], ADAPTERS, 0)


def _meta(model):
    meta = xlp.LoRAMetadata(max_num_tokens=64)
    meta.register_adapters(model)
    meta.set_token_adapters([r for r in ROWS for _ in range(S)])
    return meta


@pytest.mark.compat
def test_flattened_sites_rewritten_golden_and_exact(update_golden):
    model = _model()
    x = torch.randn(B, S, H, generator=torch.Generator().manual_seed(1))
    reference = per_adapter_reference(model, ROWS, lambda m: m(x))  # PEFT's own mixed batch refuses it:
    with pytest.raises(ValueError, match="adapter_names"):
        with torch.no_grad():
            copy.deepcopy(model)(x, adapter_names=["__base__" if r is None else r for r in ROWS])
    meta = _meta(model)
    # q/k/v on the [B, S] layout share one shrink; fc1 and fc2 read the [B*S, H] flattening: the masked kernel.
    masked = {torch.ops.xla_lora.bgmv_shrink.default: 2, torch.ops.xla_lora.bgmv_expand.default: 2}
    new_gm, report = check_rewrite(model, [x], meta, rewrites={"lora_linear": 5},
                                   ops=shrink_expand_counts(1, 3, also=masked),
                                   reference=reference, token_dims=(B, S))
    assert report.near_misses == [] and lora_weight_uses(new_gm) == 0
    assert_golden("flat_tokens", normalize_gm(new_gm), update_golden)


def test_transposed_flattening_is_a_near_miss_and_refused():
    model = _model(transpose_before_flatten=True)
    meta = _meta(model)
    x = torch.randn(B, S, H, generator=torch.Generator().manual_seed(1))
    (gm, example_inputs), = capture_graphs(model, x)
    new_gm, report = xlp.rewrite(gm, example_inputs, meta)
    assert sorted(s.site for s in report.sites) == [f"base_model.model.{n}" for n in "kqv"]
    missed = {n.site: n.reason for n in report.near_misses}
    assert set(missed) == {"base_model.model.fc1", "base_model.model.fc2"}
    assert all("flattened row-major" in r for r in missed.values())
    compiled = torch.compile(model, backend=xlp.make_backend(meta, inner="aot_eager"))
    with pytest.raises(xlp.UnsupportedMappingError, match="base_model.model.fc1"):
        with torch.no_grad():
            compiled(x)
    torch._dynamo.reset()


def test_flat_token_nodes_marks_row_wise_ops_of_a_flattening_only():
    def fn(x, w):
        flat = x.reshape(-1, H)
        kept = F.relu(F.layer_norm(flat, (H,)) + flat)
        moved = x.transpose(0, 1).reshape(-1, H)
        return kept @ w, moved + kept, flat.flip(0)

    (gm, _), = capture_graphs(fn, torch.randn(B, S, H), torch.randn(H, H))
    x = next(iter(gm.graph.find_nodes(op="placeholder")))
    layout = tuple(x.meta["example_value"].shape[:2])
    marked = {n.name for n in flat_token_nodes(gm, layout)}
    names = {n.name: n for n in gm.graph.nodes}
    assert {"flat", "layer_norm", "add", "kept"} <= marked
    # the transposed flattening, anything mixing it in, the flip and the matmul (not a row-wise op here)
    assert not marked & {n for n in names if n.startswith(("transpose", "reshape_1", "add_1", "flip", "matmul"))}
    assert flat_token_nodes(gm, layout[:1]) == set()  # a flat layout has nothing to flatten
