"""What differs between torch versions, read one way by the pass: Dynamo's source names and the forms a
transpose is recorded in.  Each test runs on torch 2.9 and on the newest torch."""
import pytest
import torch
import torch.fx as fx
import torch.nn as nn

import xla_lora_pass as xlp
from graph_rewrites.dynamo_sources import SOURCE_NAME, attribute_path, node_source_name, source_name
from graph_rewrites.transposes import is_matrix_transpose, reorders_dims
from xla_lora_pass.adapters.formats.peft import lora_param_from_source
from xla_lora_pass.backend.rewrite import copy_graph_module

from .helpers import capture_graphs, check_rewrite, lora_weight_uses, shrink_expand_counts

# One PEFT LoRA weight's source, as torch 2.9 and torch 2.14 spell it.
SOURCE_2_9 = ("L['self']._modules['base_model']._modules['model']._modules['q']._modules['lora_A']._modules['sql']"
              "._parameters['weight']")
SOURCE_2_14 = ("L['self'].__dict__['_modules']['base_model'].__dict__['_modules']['model']._modules['q']"
               "._modules['lora_A']._modules['sql']._parameters['weight']")


class _PropertyName:
    name = "L['x']"  # newer torch: a property


class _MethodName:
    def name(self):  # torch 2.9: a method
        return "L['x']"


def test_source_name_reads_a_method_and_a_property():
    assert source_name(_PropertyName()) == source_name(_MethodName()) == "L['x']"


def test_attribute_path_is_the_same_for_both_spellings():
    assert attribute_path(SOURCE_2_9) == attribute_path(SOURCE_2_14) == "L.self.base_model.model.q.lora_A.sql.weight"
    assert attribute_path("L['args'][0]") == "L.args.0"


@pytest.mark.parametrize("source", [SOURCE_2_9, SOURCE_2_14])
def test_peft_weight_found_from_either_spelling(source):
    assert lora_param_from_source(source) == ("base_model.model.q", "sql", "A")


def test_copies_of_a_dynamo_graph_keep_its_source_names():
    """Dynamo's placeholders carry their source; the pass's copies keep the name in meta."""
    model = nn.Linear(4, 3)
    (gm, _), = capture_graphs(model, torch.randn(2, 4))
    names = [node_source_name(n) for n in gm.graph.find_nodes(op="placeholder")]
    assert sorted(attribute_path(n) for n in names) == ["L.args.0", "L.fn.bias", "L.fn.weight"]
    copied = copy_graph_module(copy_graph_module(gm))
    assert [n.meta.get(SOURCE_NAME) for n in copied.graph.find_nodes(op="placeholder")] == names


# ------------------------------------------------------------------ transposes
TRANSPOSES = {
    "T": lambda w: w.T, "mT": lambda w: w.mT, "H": lambda w: w.H, "mH": lambda w: w.mH,
    "t": lambda w: w.t(), "torch.t": torch.t, "adjoint": lambda w: w.adjoint(),
    "transpose": lambda w: w.transpose(0, 1), "transpose(-1, -2)": lambda w: w.transpose(-1, -2),
    "torch.transpose": lambda w: torch.transpose(w, 1, 0), "swapaxes": lambda w: w.swapaxes(0, 1),
    "swapdims": lambda w: torch.swapdims(w, 0, 1), "permute": lambda w: w.permute(1, 0),
    "permute(list)": lambda w: w.permute([1, 0]), "torch.permute": lambda w: torch.permute(w, (1, 0)),
}
NOT_TRANSPOSES = {"identity permute": lambda w: w.permute(0, 1), "transpose(0, 0)": lambda w: w.transpose(0, 0),
                  "view": lambda w: w.view(-1), "neg": lambda w: -w}


def _first_op(fn):
    (gm, _), = capture_graphs(lambda w: fn(w) * 2, torch.randn(5, 4))
    return next(n for n in gm.graph.nodes if n.op in ("call_function", "call_method"))


@pytest.mark.parametrize("form", list(TRANSPOSES))
def test_every_recorded_transpose_form_is_one(form):
    """As this torch's Dynamo records it (``getattr(w, "T")`` on 2.9, ``aten.numpy_T`` on newer torch)."""
    node = _first_op(TRANSPOSES[form])
    assert is_matrix_transpose(node) and reorders_dims(node), node.format_node()


@pytest.mark.parametrize("form", list(NOT_TRANSPOSES))
def test_other_ops_are_not_transposes(form):
    assert not is_matrix_transpose(_first_op(NOT_TRANSPOSES[form]))


@pytest.mark.parametrize("target", [torch.ops.aten.numpy_T, torch.ops.aten.numpy_T.default, torch.ops.aten.mT,
                                    torch.ops.aten.mT.default, torch.ops.aten.matrix_H, torch.ops.aten.mH])
def test_newer_dynamo_aten_forms_are_transposes(target):
    """The aten forms newer Dynamo records ``.T`` / ``.mT`` / ``.H`` / ``.mH`` as, built by hand on any torch."""
    graph = fx.Graph()
    w = graph.placeholder("w")
    w.meta["example_value"] = torch.empty(5, 4, device="meta")
    node = graph.call_function(target, (w,))
    assert is_matrix_transpose(node)
    w.meta["example_value"] = torch.empty(2, 5, 4, device="meta")
    assert not is_matrix_transpose(node)  # a batch of matrices: not a 2-d weight's transpose


class _HandwrittenLoRA(nn.Module):
    """``base(x) + (x @ A^T @ B^T) * s`` with the transposes written in a chosen form."""

    def __init__(self, transpose_a, transpose_b):
        super().__init__()
        torch.manual_seed(0)
        self.base = nn.Linear(16, 8)
        self.lora_A = nn.Parameter(torch.randn(4, 16) * 0.1)
        self.lora_B = nn.Parameter(torch.randn(8, 4) * 0.1)
        self.scaling = 0.5
        self.transpose_a, self.transpose_b = transpose_a, transpose_b

    def forward(self, x):
        return self.base(x) + (x @ self.transpose_a(self.lora_A) @ self.transpose_b(self.lora_B)) * self.scaling


@pytest.mark.parametrize("form_a, form_b", [("T", "T"), ("mT", "permute"), ("transpose(-1, -2)", "swapaxes"),
                                            ("torch.t", "mT")])
def test_handwritten_lora_with_any_transpose_form_is_rewritten(form_a, form_b):
    model = _HandwrittenLoRA(TRANSPOSES[form_a], TRANSPOSES[form_b]).eval()
    meta = xlp.LoRAMetadata(max_num_tokens=64)
    meta.register_adapters(model)
    x = torch.randn(2, 3, 16)
    meta.set_token_adapters([None, None, None] + [meta.slots[0]] * 3)
    with torch.no_grad():
        base = model.base(x)
        reference = torch.cat([base[:1], model(x)[1:]])
    new_gm, _ = check_rewrite(model, [x], meta, rewrites={"lora_linear": 1}, ops=shrink_expand_counts(1, 1),
                              reference=reference, token_dims=(2, 3))
    assert lora_weight_uses(new_gm) == 0
