"""Pattern 2: embedding LoRA (PEFT ``lora.Embedding``).

    y = emb(ids) + (embedding(ids, A.T) @ B.T) * s     (PEFT; loralib's ``+=`` form too)

becomes

    t = bgmv_embedding_shrink(ids1d, stacked_A, idx)   (column ids[t] of slot idx[t]'s A)
    y = bgmv_expand(t, stacked_B, emb(ids)2d, idx)
"""
from __future__ import annotations

import functools

from typing import Optional, Tuple

import torch
import torch.fx as fx
import torch.nn.functional as F

from . import fx_utils
from .annotations import LORA_WEIGHT, LoRAWeightRef
from .kernels import stacks_and_base
from .lora_linear import COMBINE_FORMS, LinearMatch, apply_matches, find_matches, weights_reason
from .report import RewriteContext
from .site_inputs import device_of, site_indices

PATTERN_NAME = "lora_embedding"


def _make_pattern(combine_fn):
    def lora_embedding_pattern(x, base, lora_a, lora_b, scale):
        return combine_fn(base, F.embedding(x, lora_a.t()) @ lora_b.t(), scale)

    return lora_embedding_pattern


@functools.lru_cache(maxsize=None)  # traced once per process; the matcher only reads them
def lora_embedding_patterns() -> Tuple[fx.Graph, ...]:
    """Traced forms (F.embedding stays one call with its default kwargs, as Dynamo records it)."""
    return tuple(fx.symbolic_trace(_make_pattern(c)).graph for c in COMBINE_FORMS)


_FORWARD_NEUTRAL = {"padding_idx", "norm_type", "scale_grad_by_freq", "sparse"}
# F.embedding's defaults, as the traced pattern records them.
_DEFAULTS = {"padding_idx": None, "max_norm": None, "norm_type": 2.0, "scale_grad_by_freq": False, "sparse": False}


def canonicalize_lora_embeddings(gm: fx.GraphModule) -> int:
    """``embedding(ids, A.T, padding_idx=p, ...)`` -> the same call with F.embedding's defaults, for LoRA A.

    Those arguments change only gradients, so the forward value is the same;
    ``max_norm`` (which renormalises rows) is kept, and makes a near miss.
    """
    changed = 0
    for node in gm.graph.find_nodes(op="call_function", target=F.embedding):
        weight = node.args[1] if len(node.args) > 1 else node.kwargs.get("weight")
        # LoRA weight transposes are all ``.t()`` by now (fx_utils.canonicalize_weight_transposes).
        if not (isinstance(weight, fx.Node) and weight.op == "call_method" and weight.target == "t"
                and LORA_WEIGHT in getattr(weight.args[0], "meta", {})):
            continue
        extra = dict(zip(("padding_idx", "max_norm", "norm_type", "scale_grad_by_freq", "sparse"), node.args[2:]))
        extra.update(node.kwargs)
        if extra.get("max_norm") is not None or not set(extra) <= _FORWARD_NEUTRAL | {"max_norm"}:
            continue
        node.args, node.kwargs = node.args[:2], dict(_DEFAULTS)
        changed += 1
    return changed


def near_miss_reason(m: LinearMatch) -> Optional[str]:
    """None if the match may be rewritten, else why not."""
    return weights_reason(m, kind="embedding")


def lora_embedding_replacement(graph: fx.Graph, m: LinearMatch, ctx: RewriteContext):
    """Insert the embedding shrink and expand before ``m.output``."""
    ref: LoRAWeightRef = m.weight
    device = device_of(m.base)
    with graph.inserting_before(m.output):
        ids = fx_utils.call(graph, "call_method", "reshape", m.x, -1)
        idx, reason = site_indices(graph, ctx, m.x, ids, 0, device)
        if idx is None:
            graph.erase_node(ids)
            return None, reason
        stacked_a, stacked_b, base2d = stacks_and_base(graph, m, ref, device)
        shrunk = fx_utils.call(graph, "call_function", torch.ops.xla_lora.bgmv_embedding_shrink.default,
                               ids, stacked_a, idx)
        expanded = fx_utils.call(graph, "call_function", torch.ops.xla_lora.bgmv_expand.default,
                                 shrunk, stacked_b, base2d, idx, True)
        out = fx_utils.call(graph, "call_method", "view_as", expanded, m.base)
    return out, None


def rewrite_lora_embedding(gm: fx.GraphModule, ctx: RewriteContext) -> bool:
    """Rewrite every embedding LoRA site of ``gm`` in place."""
    canonicalize_lora_embeddings(gm)
    return apply_matches(gm, ctx, find_matches(gm, lora_embedding_patterns()), PATTERN_NAME, near_miss_reason,
                         lora_embedding_replacement)
