"""The golden files' canonical form: one text for a graph whatever torch version named and ordered its
inputs, and a different text for any other graph."""
import torch
import torch.fx as fx

from graph_rewrites.dynamo_sources import SOURCE_NAME

from .golden_graphs import normalize_gm

# Two inputs of one model, as torch 2.9 and newer torch name them (source, placeholder name).
INPUTS_2_9 = [("L['self']._modules['q']._parameters['weight']", "l_self_modules_q_parameters_weight_"),
              ("L['x']", "l_x_")]
INPUTS_2_14 = [("L['x']", "l_x_"),
               ("L['self'].__dict__['_modules']['q']._parameters['weight']", "l_self_dict_modules_q_parameters_weight_")]


def _graph(inputs, op=torch.add):
    """x @ W.T  then ``op`` with 1, over placeholders named and ordered as ``inputs`` say."""
    graph = fx.Graph()
    nodes = {}
    for source, name in inputs:
        node = graph.placeholder(name)
        node.meta[SOURCE_NAME] = source
        nodes["x" if source == "L['x']" else "w"] = node
    linear = graph.call_function(torch._C._nn.linear, (nodes["x"], nodes["w"]))
    graph.output((graph.call_function(op, (linear, 1)),))
    return fx.GraphModule(torch.nn.Module(), graph)


def test_both_torch_spellings_and_orders_print_alike():
    text = normalize_gm(_graph(INPUTS_2_9))
    assert text == normalize_gm(_graph(INPUTS_2_14))
    assert "def forward(self, l_self_q_weight, l_x)" in text and "_modules" not in text and "dict" not in text


def test_another_graph_prints_otherwise():
    assert normalize_gm(_graph(INPUTS_2_9)) != normalize_gm(_graph(INPUTS_2_9, op=torch.mul))
