"""Which registered site each use of a base weight belongs to, and which uses no site can serve.

A site's base weight (``BASE_WEIGHT``, marked by tensor identity) is read by
its base op: ``linear(x, W)``, GPT-2's ``addmm(b, x2d, W)``, ``x @ W.T`` (then
``+ b``, Falcon's ``FalconLinear``), ``embedding(ids, W)``.  A tied tensor is
the base weight of several sites: each use goes to the site of its op's kind,
between sites of one kind to the one whose module the op runs in
(``nn_module_stack``).  A use outside every candidate site's module is the
model reading the weight itself, where PEFT computes no LoRA: no site's.  A
use of no known form, or one several sites could own, is unserved.
``lora_attach`` serves the bare base ops; ``unserved_base_sites`` lists what
the uniform-mapping guard must refuse.
"""
from __future__ import annotations

import operator
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.fx as fx
import torch.nn.functional as F

from .. import fx_utils
from ..annotations import BASE_WEIGHT, LORA_WEIGHT, LoRAWeightRef
from ..kernel_spec import is_expand
from ..transposes import is_matrix_transpose

_LINEAR = (torch._C._nn.linear, F.linear)
_MATMUL = (operator.matmul, torch.matmul)
_EMBEDDING = (F.embedding,)
_KINDS = ("linear", "embedding")
# Ops between a base output and the expand that adds the LoRA delta to it (patterns 1, 2, 5 and this one).
_PASS_THROUGH = {"reshape", "view", "to", "view_as", "contiguous", "flatten"}


def _arg(node: fx.Node, index: int, name: str):
    return node.args[index] if len(node.args) > index else node.kwargs.get(name)


class BaseOp:
    """One use of a site's base weight: the op, its token-carrying input and its flat activation."""

    def __init__(self, op: fx.Node, tokens: fx.Node, n_feature_dims: int):
        self.op, self.tokens, self.n_feature_dims = op, tokens, n_feature_dims


def _flat_source(x2d: fx.Node) -> fx.Node:
    """``x`` when ``x2d`` is ``x.view(-1, in)`` (Conv1D flattens before addmm), else ``x2d``."""
    if x2d.op == "call_method" and x2d.target in ("view", "reshape") and isinstance(x2d.args[0], fx.Node):
        source, flat = fx_utils.example_value(x2d.args[0]), fx_utils.example_value(x2d)
        if (isinstance(source, torch.Tensor) and isinstance(flat, torch.Tensor) and flat.dim() == 2
                and source.dim() >= 2 and source.shape[-1] == flat.shape[-1]):
            return x2d.args[0]
    return x2d


def _is_transpose(node: fx.Node, weight: fx.Node) -> bool:
    """``weight.t()`` / ``.T`` / ``.transpose(0, 1)`` ...: how loralib's ``fan_in_fan_out`` layers read [in, out]."""
    return bool(node.args) and node.args[0] is weight and is_matrix_transpose(node)


def base_op(use: fx.Node, weight: fx.Node, kind: str) -> Optional[BaseOp]:
    """The use as the site's base op (None if it is some other kind of use)."""
    if kind == "linear" and _is_transpose(use, weight) and len(use.users) == 1:
        # linear(x, W.T) with W stored [in, out]: the linear is the base op, whatever layout W has.
        return base_op(next(iter(use.users)), use, kind)
    if use.op != "call_function":
        return None
    if kind == "linear" and use.target in _LINEAR and _arg(use, 1, "weight") is weight:
        x = _arg(use, 0, "input")
        return BaseOp(use, x, 1) if isinstance(x, fx.Node) else None
    if kind == "linear" and use.target in _MATMUL and len(use.args) == 2 and use.args[1] is weight \
            and not use.kwargs and isinstance(use.args[0], fx.Node) and _same_token_dims(use.args[0], use):
        # x @ W.T (W [out, in]) or x @ W (W [in, out]): linear(x, W), with its bias added after if any.
        return BaseOp(_with_bias(use), use.args[0], 1)
    if kind == "linear" and use.target is torch.addmm and len(use.args) >= 3 and use.args[2] is weight \
            and not use.kwargs and isinstance(use.args[1], fx.Node):
        return BaseOp(use, _flat_source(use.args[1]), 1)
    if kind == "embedding" and use.target in _EMBEDDING and _arg(use, 1, "weight") is weight:
        if _arg(use, 3, "max_norm") is not None:  # renormalises W's rows in place: not a plain lookup
            return None
        ids = _arg(use, 0, "input")
        return BaseOp(use, ids, 0) if isinstance(ids, fx.Node) else None
    return None


def _with_bias(y: fx.Node) -> fx.Node:
    """``y + b`` when that is ``y``'s only use and ``b`` a vector (a linear's bias, added after a matmul), else
    ``y``: the base output the LoRA delta is added to."""
    if len(y.users) != 1:
        return y
    user = next(iter(y.users))
    if user.op != "call_function" or user.target not in (operator.add, torch.add) or len(user.args) != 2 \
            or user.kwargs or user.args[0] is not y:
        return y
    bias = fx_utils.example_value(user.args[1]) if isinstance(user.args[1], fx.Node) else None
    return user if isinstance(bias, torch.Tensor) and bias.dim() == 1 else y


def _same_token_dims(x: fx.Node, y: fx.Node) -> bool:
    """``y = x @ M`` keeps ``x``'s leading (token) dims: x has some, and M is a matrix, not a batch of them."""
    xv, yv = fx_utils.example_value(x), fx_utils.example_value(y)
    return (isinstance(xv, torch.Tensor) and isinstance(yv, torch.Tensor) and xv.dim() >= 2
            and yv.dim() == xv.dim() and tuple(xv.shape[:-1]) == tuple(yv.shape[:-1]))


def feeds_lora_expand(node: fx.Node, depth: int = 4) -> bool:
    """Whether ``node`` is the base output an expand adds a delta to (through reshapes and casts)."""
    for user in node.users:
        target = user.target
        if user.op == "call_function" and is_expand(target) and len(user.args) > 2 and user.args[2] is node:
            return True
        if depth and user.op == "call_method" and target in _PASS_THROUGH and user.args[0] is node:
            if feeds_lora_expand(user, depth - 1):
                return True
    return False


def lora_weight_sites(gm: fx.GraphModule) -> set:
    """Sites whose LoRA weights are still read by the graph: their branch is there (left alone or not)."""
    return {n.meta[LORA_WEIGHT].site for n in gm.graph.find_nodes(op="placeholder")
            if LORA_WEIGHT in n.meta and n.users}


def base_weight_inputs(gm: fx.GraphModule) -> Iterator[Tuple[fx.Node, Tuple[LoRAWeightRef, ...]]]:
    """Each base weight the graph reads, with a ref per site it is the base weight of."""
    for node in gm.graph.find_nodes(op="placeholder"):
        refs = node.meta.get(BASE_WEIGHT)
        if refs and node.users:
            yield node, refs


class SiteUses:
    """One site's uses of its base weight: base ops with no LoRA computation, and uses it cannot serve."""

    def __init__(self):
        self.bare: List[BaseOp] = []
        self.unserved: List[Tuple[fx.Node, str]] = []  # (use, why)


def _in_module(node: fx.Node, ref: LoRAWeightRef) -> bool:
    """Whether ``node`` runs inside the site's own module (Dynamo records its key in nn_module_stack)."""
    return ref.module_key is not None and ref.module_key in (node.meta.get("nn_module_stack") or {})


def _outside(node: fx.Node, ref: LoRAWeightRef) -> bool:
    """Whether ``node`` is known to run outside the site's own module (False when the graph does not say).

    Dynamo records the modules an op runs in (``nn_module_stack``), and none
    for an op of the root module's own forward: an empty record means the
    root only in a graph that records them.
    """
    if ref.module_key is None:
        return False
    stack = node.meta.get("nn_module_stack")
    if not stack and not any(n.meta.get("nn_module_stack") for n in node.graph.nodes):
        return False
    return ref.module_key not in (stack or {})


def site_uses(weight: fx.Node, refs: Sequence[LoRAWeightRef]) -> Dict[str, SiteUses]:
    """Each site's uses of ``weight``, the base weight of every site in ``refs`` (several when tied).

    A use belongs to the site whose kind its op has (the embedding lookup
    to ``embed_tokens``, the linear to ``lm_head``); between sites of one
    kind, to the one whose module the op runs in.  A base op of a kind no site has
    (the tied table read by a layer without LoRA), or one that runs outside
    every candidate site's module (the model reading the weight itself, where
    PEFT computes no LoRA either), is no site's.  A use of
    no known form, or one several sites could own, is unserved at each of
    them: served at a guessed site it would be silently wrong.
    """
    uses = {ref.site: SiteUses() for ref in refs}
    for use in weight.users:
        kinds = [(op, ref) for ref in refs if (op := base_op(use, weight, ref.kind)) is not None]
        # A base op outside the site's LoRA layer (the model reading the weight itself) computes no LoRA in
        # eager PEFT either: left alone, it is exact for every mapping.
        found = [(op, ref) for op, ref in kinds if not _outside(op.op, ref)]
        if kinds and not found:
            continue
        if not found:
            if not any(base_op(use, weight, kind) is not None for kind in _KINDS):
                for ref in refs:
                    uses[ref.site].unserved.append((use, (
                        f"its base weight is read by {use.format_node()}, a form the pass cannot attach the "
                        "LoRA computation to")))
            continue
        owners = found if len(found) == 1 else [(op, ref) for op, ref in found if _in_module(op.op, ref)]
        if len(owners) != 1:
            names = ", ".join(ref.site for _, ref in found)
            for op, ref in found:
                uses[ref.site].unserved.append((use, (
                    f"its base weight is shared by {names}, and {op.op.format_node()} runs in the module of "
                    f"{'more than one' if owners else 'none'} of them: the pass cannot tell whose it is")))
            continue
        op, ref = owners[0]
        if not feeds_lora_expand(op.op):
            uses[ref.site].bare.append(op)
    return uses


def unserved_base_sites(gm: fx.GraphModule) -> Dict[str, LoRAWeightRef]:
    """Registered sites in the graph that compute no LoRA for any token (the base op alone).

    Sites whose LoRA branch is in the graph are not listed: that branch
    names them (``unrewritten_lora_weights``) with the adapter it computes.
    """
    branches = lora_weight_sites(gm)
    left: Dict[str, LoRAWeightRef] = {}
    for weight, refs in base_weight_inputs(gm):
        uses = site_uses(weight, refs)
        for ref in refs:
            if ref.site not in branches and (uses[ref.site].bare or uses[ref.site].unserved):
                left[ref.site] = ref
    return left


__all__ = ["BaseOp", "SiteUses", "base_op", "base_weight_inputs", "feeds_lora_expand", "lora_weight_sites",
           "site_uses", "unserved_base_sites"]
