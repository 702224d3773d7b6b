"""Pattern 2: embedding LoRA (PEFT ``lora.Embedding``).

    y = emb(ids) + (embedding(ids, A.T) @ B.T) * s     (PEFT; loralib's ``+=`` form too)

becomes

    t = bgmv_embedding_shrink(ids1d, stacked_A, idx)   (column ids[t] of slot idx[t]'s A)
    y = bgmv_expand(t, stacked_B, emb(ids)2d, idx)
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.fx as fx
import torch.nn.functional as F

from .. import fx_utils
from ..annotations import LoRAWeightRef
from ..emit import stacks_and_base
from .lora_linear import COMBINE_FORMS, input_reason, weights_reason
from ..pattern_matcher import LinearMatch, Pattern
from ..context import RewriteContext
from ..site_inputs import device_of, site_indices

def _make_pattern(combine_fn):
    def lora_embedding_pattern(x, base, lora_a, lora_b, scale):
        return combine_fn(base, F.embedding(x, lora_a.t()) @ lora_b.t(), scale)

    return lora_embedding_pattern


# F.embedding stays one call with its default kwargs, as Dynamo records it
# (normalize's canonicalize_lora_embeddings drops the forward-neutral ones).
SEARCH_FORMS = tuple(_make_pattern(c) for c in COMBINE_FORMS)


def near_miss_reason(m: LinearMatch) -> Optional[str]:
    """None if the match may be rewritten, else why not."""
    return weights_reason(m, kind="embedding") or input_reason(m)


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


LORA_EMBEDDING = Pattern("lora_embedding", SEARCH_FORMS, near_miss_reason, lora_embedding_replacement)
