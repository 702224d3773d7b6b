"""Where a Dynamo graph input comes from, read the same way on every torch version.

``Source.name`` is a method on torch 2.9 and a property on newer torch, and
the names themselves differ: torch 2.9 writes
``L['self']._modules['base_model']._modules['model']...``, newer torch
``L['self'].__dict__['_modules']['base_model'].__dict__['_modules']['model']...``.
``attribute_path`` reads either as the module attribute path
(``L.self.base_model.model...``), which is what callers match on.
"""
from __future__ import annotations

import re
from typing import Any, Optional

import torch.fx as fx


def source_name(source: Any) -> str:
    """``source.name``, whether the torch version made it a method or a property."""
    name = source.name
    return name() if callable(name) else name


# A placeholder's source name, kept in ``node.meta`` so that copies of the graph keep it (``keep_source_names``).
SOURCE_NAME = "dynamo_source_name"


def node_source_name(node: fx.Node) -> Optional[str]:
    """The name of the Dynamo source of a placeholder, or None for an input Dynamo did not make.

    Dynamo keeps the source in ``meta["grapharg"]`` while the backend runs
    and in ``node._dynamo_source`` after; a copy has neither, but the name
    ``keep_source_names`` recorded.
    """
    if SOURCE_NAME in node.meta:
        return node.meta[SOURCE_NAME]
    source = getattr(node, "_dynamo_source", None) or getattr(node.meta.get("grapharg"), "source", None)
    return source_name(source) if source is not None else None


def keep_source_names(original: fx.Graph, copy: fx.Graph) -> None:
    """Record each Dynamo placeholder's source name in the meta of its copy (placeholders pair up in order)."""
    for old, new in zip(original.find_nodes(op="placeholder"), copy.find_nodes(op="placeholder")):
        name = node_source_name(old)
        if name is not None:
            new.meta[SOURCE_NAME] = name


# ``.__dict__['_modules']['x']``, ``._modules['x']``, ``._parameters['x']``, ``._buffers['x']``: the attribute x.
_CONTAINER = re.compile(r"(?:\.__dict__\['_(?:modules|parameters|buffers)'\]|\._(?:modules|parameters|buffers))"
                        r"\['([^']*)'\]")
_ITEM = re.compile(r"\[(?:'([^']*)'|(\d+))\]")  # ['key'] or [0]


def attribute_path(name: str) -> str:
    """A source name as a dotted path: ``L['self']._modules['q']._parameters['weight']`` -> ``L.self.q.weight``.

    The same path for torch 2.9's and newer torch's spelling of one source.
    """
    name = _CONTAINER.sub(lambda m: "." + m.group(1), name)
    return _ITEM.sub(lambda m: "." + (m.group(1) if m.group(1) is not None else m.group(2)), name)
