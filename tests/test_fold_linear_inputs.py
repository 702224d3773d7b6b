"""graph_rewrites/fold_linear_inputs.py: a linear on a strided view of its tokens gets a contiguous input.

HF's generate computes ``lm_head(hidden[:, -1:, :])`` in every prompt step; the head is frozen (PEFT
freezes the base model), so ``matmul`` broadcast its weight to every row and ran ``bmm``, which XLA
materialises.  The pass must make that one ``mm`` and leave every linear that already folds alone.
"""
import pytest
import torch
import torch.nn as nn
from peft import LoraConfig, get_peft_model
from torch.fx.experimental.proxy_tensor import make_fx

import xla_lora_pass as xlp
from .helpers import (assert_golden, backend_rewrite, capture_graphs, count_ops, normalize_gm, rewritten_inputs,
                      run_rewritten)

B, S, H, V = 3, 5, 16, 40
ROWS = ["sql", None, "chat"]


class _Head(nn.Module):
    """A LoRA site (q) on every token, then a plain head on the rows ``select`` keeps."""

    def __init__(self, select):
        super().__init__()
        self.embed = nn.Embedding(V, H)
        self.q = nn.Linear(H, H)
        self.head = nn.Linear(H, V, bias=False)
        self.select = select

    def forward(self, ids):
        return self.head(self.select(self.q(self.embed(ids))))


SELECTIONS = {
    "last": lambda h: h[:, -1:, :],  # logits_to_keep=1
    "every_other": lambda h: h[:, ::2, :],
    "all": lambda h: h,  # contiguous: folds already
    "pooled": lambda h: h[:, -1],  # [B, H]: a matrix already
    "transposed": lambda h: h.transpose(0, 1).contiguous(),  # contiguous after the copy the model makes
}


def _model(select):
    torch.manual_seed(0)
    model = None
    for name, r in (("sql", 4), ("chat", 8)):
        cfg = LoraConfig(r=r, lora_alpha=2 * r, target_modules=["q"], init_lora_weights=False)
        if model is None:
            model = get_peft_model(_Head(SELECTIONS[select]), cfg, adapter_name=name)
        else:
            model.add_adapter(name, cfg)
    model.set_adapter("sql")
    assert not model.base_model.model.head.weight.requires_grad  # PEFT freezes the base model
    return model.eval()


def _rewrite(select, enabled=True):
    model = _model(select)
    meta = xlp.LoRAMetadata(max_num_tokens=64)
    meta.register_adapters(model)
    meta.set_request_adapters(ROWS)
    ids = torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(1))
    [(gm, example_inputs)] = capture_graphs(model, ids)
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(xlp.config.passes, "fold_linear_inputs", enabled)
        new_gm, report, _ = backend_rewrite(gm, example_inputs, meta, (B, S))
    assert report.counts() == {"lora_linear": 1}, report.format()
    with torch.no_grad():
        reference = model(ids, adapter_names=["__base__" if r is None else r for r in ROWS])
    return new_gm, example_inputs, meta, reference


def _head_matmuls(new_gm, example_inputs, meta):
    """(bmm, mm or addmm) counts in the graph as aot_autograd decomposes it (the LoRA kernels are opaque)."""
    with torch.no_grad():
        traced = make_fx(new_gm)(*rewritten_inputs(new_gm, example_inputs, meta, (B, S)))
    return (count_ops(traced, torch.ops.aten.bmm.default),
            count_ops(traced, torch.ops.aten.mm.default) + count_ops(traced, torch.ops.aten.addmm.default))


def test_last_position_head_is_one_mm_and_exact(update_golden):
    new_gm, example_inputs, meta, reference = _rewrite("last")
    clones = [n for n in new_gm.graph.nodes if n.op == "call_method" and n.target == "clone"]
    assert len(clones) == 1 and [u.target for u in clones[0].users] == [torch._C._nn.linear]
    assert _head_matmuls(new_gm, example_inputs, meta) == (0, 2)  # q's base linear and the head
    out = run_rewritten(new_gm, example_inputs, meta, (B, S))[0]
    torch.testing.assert_close(out, reference, atol=1e-5, rtol=0)
    assert_golden("fold_linear_inputs", normalize_gm(new_gm), update_golden)


# Measured: whether aten's matmul folds the head's strided input to one mm by itself, per torch version.  The
# last position ([B, 1, H] sliced from [B, S, H]) has a stride only on its size-1 dim: torch 2.14 views it as
# [B, H] (a size-1 dim's stride does not matter), torch 2.9 broadcasts the weight and runs bmm.  Every other
# position (stride 2) is a bmm on both.
FOLDS_ALONE = {(2, 9): {"last": False, "every_other": False},
               (2, 14): {"last": True, "every_other": False}}.get(
    tuple(int(p) for p in torch.__version__.split(".")[:2]))


@pytest.mark.parametrize("select", ["last", "every_other"])
def test_without_the_pass_the_head_is_a_bmm_over_a_broadcast_weight(select):
    """What the pass removes where torch does not fold the input itself: the checks above can fail."""
    if FOLDS_ALONE is None:
        pytest.skip(f"torch {torch.__version__}: matmul folding not measured (torch 2.9 and 2.14 are)")
    new_gm, example_inputs, meta, reference = _rewrite(select, enabled=False)
    assert count_ops(new_gm, "clone") == 0
    assert _head_matmuls(new_gm, example_inputs, meta) == ((0, 2) if FOLDS_ALONE[select] else (1, 1))
    torch.testing.assert_close(run_rewritten(new_gm, example_inputs, meta, (B, S))[0], reference, atol=1e-5, rtol=0)


def test_strided_rows_are_cloned_too():
    new_gm, example_inputs, meta, reference = _rewrite("every_other")
    assert count_ops(new_gm, "clone") == 1
    assert _head_matmuls(new_gm, example_inputs, meta) == (0, 2)
    torch.testing.assert_close(run_rewritten(new_gm, example_inputs, meta, (B, S))[0], reference, atol=1e-5, rtol=0)


@pytest.mark.parametrize("select", ["all", "pooled", "transposed"])
def test_inputs_that_fold_are_left_alone(select):
    """Near misses: a contiguous [B, S, H], a [B, H] matrix, a transposed copy: the graph gets no clone."""
    new_gm, example_inputs, meta, reference = _rewrite(select)
    assert count_ops(new_gm, "clone") == 0
    assert _head_matmuls(new_gm, example_inputs, meta)[0] == 0
    torch.testing.assert_close(run_rewritten(new_gm, example_inputs, meta, (B, S))[0], reference, atol=1e-5, rtol=0)


def test_symbolic_sizes_clone_only_the_slice():
    """In a graph traced with symbolic sizes a contiguous [b, s, H] is provably foldable and the
    last-position slice is not: q's linear is left alone, the head's input cloned."""
    model = _model("last")
    meta = xlp.LoRAMetadata(max_num_tokens=64)
    meta.register_adapters(model)
    meta.set_request_adapters(ROWS)
    graphs = []

    def record(gm, example_inputs):
        graphs.append((gm, list(example_inputs)))
        return gm.forward

    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(model, backend=record, dynamic=True)(torch.zeros(B, S, dtype=torch.long))
    [(gm, example_inputs)] = graphs
    assert any(isinstance(a, torch.SymInt) for n in gm.graph.find_nodes(op="placeholder")
               for a in getattr(n.meta.get("example_value"), "shape", ()))
    new_gm, _, _ = backend_rewrite(gm, example_inputs, meta, (B, S))
    clones = [n for n in new_gm.graph.nodes if n.op == "call_method" and n.target == "clone"]
    assert len(clones) == 1 and clones[0].args[0].meta["example_value"].shape[1] == 1
