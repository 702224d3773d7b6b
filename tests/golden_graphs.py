"""Golden files: a graph printed in one canonical form, so one file serves every supported torch version.

Dynamo names a graph input after its source, and spells the source by
version: ``L_self_modules_q_parameters_weight_`` on torch 2.9,
``L_self_dict_modules_..._modules_q_parameters_weight_`` on newer torch, and
the order of the inputs differs too.  ``normalize_gm`` prints the graph with
each input named by its module attribute path (``L_self_q_weight``) and
Dynamo's inputs sorted by that name, followed by the pass's own inputs in the
order the pass added them.  Everything else (ops, arguments, shapes, the
names of computed values) prints as it is, so any real change still shows.
"""
from __future__ import annotations

import copy
import os
import re

import torch.fx as fx

from graph_rewrites.annotations import LORA_INPUT
from graph_rewrites.dynamo_sources import attribute_path, node_source_name

GOLDEN_DIR = os.path.join(os.path.dirname(__file__), "golden")


def canonical_input_name(node: fx.Node) -> str:
    """A placeholder's name from its Dynamo source's attribute path (the same on every torch version)."""
    source = node_source_name(node)
    if source is None:
        return node.name  # an input the pass added: named by the pass
    return re.sub(r"\W+", "_", attribute_path(source)).strip("_").lower()  # FX lower-cases placeholder names


def canonical_graph(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``gm`` whose inputs have canonical names, Dynamo's sorted by name, then the pass's in order."""
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    dynamo = sorted((p for p in placeholders if LORA_INPUT not in p.meta), key=canonical_input_name)
    added = [p for p in placeholders if LORA_INPUT in p.meta]
    graph = fx.Graph()
    env = {}
    for old in dynamo + added:
        env[old] = graph.placeholder(canonical_input_name(old), type_expr=old.type)
        env[old].meta = copy.copy(old.meta)
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            env[node] = graph.node_copy(node, lambda n: env[n])
    return fx.GraphModule(gm, graph)


def normalize_gm(gm: fx.GraphModule) -> str:
    """The readable canonical graph without source paths and line numbers, for golden files."""
    text = canonical_graph(gm).print_readable(print_output=False, include_stride=False, include_device=False)
    keep = []
    for line in text.splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("# File:") or stripped.startswith("# No stacktrace"):
            continue
        keep.append(line.rstrip())
    return "\n".join(keep) + "\n"


def transformers_variant() -> str:
    """The golden variant for a graph of a whole transformers model: its code (masks, rotary embeddings,
    attention) differs between transformers 4 and 5, so such a graph has one golden per major version."""
    import transformers

    major = int(transformers.__version__.split(".")[0])
    return "" if major < 5 else f"transformers{major}"


def assert_golden(name: str, text: str, update: bool, variant: str = "") -> None:
    """Compare ``text`` with tests/golden/<name>.txt (<name>.<variant>.txt); ``--update-golden`` rewrites it."""
    path = os.path.join(GOLDEN_DIR, f"{name}.{variant}.txt" if variant else f"{name}.txt")
    if update or not os.path.exists(path):
        if not update:
            raise AssertionError(f"missing golden file {path}: run pytest --update-golden and review it")
        os.makedirs(GOLDEN_DIR, exist_ok=True)
        with open(path, "w") as f:
            f.write(text)
        return
    with open(path) as f:
        expected = f.read()
    assert text == expected, f"graph differs from {path} (run pytest --update-golden and review the diff)"
