"""Whether zero-padding a graph's token dims could change a real result.

Knows nothing of LoRA: it reads a Dynamo graph's ops and the size symbols
on their fake values.  Padding is exact when padded tokens never reach real
ones.  Ops that mix tokens break that unless the padded ones are provably
left out:

- a reduction or scan-free mix over a token dim (``sum``, ``mean``, ``max``, ...);
- attention over padded keys (``scaled_dot_product_attention``, or a
  ``softmax`` over a token dim and the contraction of its probabilities with
  the values) unless the keys past the real length are masked, which is
  proven one of two ways:

  * a causal construction over positions: ``is_causal=True``, ``tril``/
    ``triu``, or a comparison of two position tensors built with ``arange``
    (every HF mask builder, the vmapped ``kv_idx <= q_idx`` of transformers
    4.5x/5.x included): a real query never sees a later key, and every
    padded key comes after every real one;
  * a mask read from a graph input that carries a padded dim: the backend
    pads it with zeros, which HF's masks (and SDPA's boolean ones) read as
    "masked";

- any other contraction over a token dim (``x.transpose(1, 2) @ x``);
- indexing a token dim from its end (after padding, the end is padding);
- indices with a token dim into a dim whose size is another symbol, one not
  padded (an index built over the padded size points past its end);
- writes and held tensors (``writes.py``): an in-place write into a graph
  input or a held tensor that involves a token dim, an in-place write at
  indices with a token dim, a held tensor (lifted into the graph, or an
  input marked static-address: transformers' static KV cache) tied to a
  padded dim.

What it cannot see: a mask input that uses another convention (1 = masked,
or ids compared with a non-zero pad id) is trusted as HF's; a causal buffer
(GPT-2's ``bias``) counts only alongside another proof, since its values are
not in the graph.
"""
from __future__ import annotations

import operator
from typing import Callable, Dict, List, Optional

import torch
import torch.fx as fx

from graph_rewrites.fx_values import example_value, size_expr

from .writes import held_tensor_hazard, op_name, token_dims, write_hazard

# Ops that mix tokens along a dim: padding that dim would feed padded tokens into real ones.
# Left out on purpose: cumsum/cumprod (prefix scans: padding after the real
# tokens never reaches them); softmax is attention's, checked with its mask.
_MIXING = {"sum", "mean", "amax", "amin", "max", "min", "prod", "logsumexp", "norm", "var",
           "std", "argmax", "argmin", "topk", "sort", "nansum", "nanmean", "median", "all", "any", "count_nonzero"}
_SOFTMAX = {"softmax", "log_softmax", "_softmax"}
_SDPA = {"scaled_dot_product_attention"}
_CONTRACT = {"matmul", "bmm", "baddbmm", "einsum", "mm"}
_COMPARE = {"lt", "le", "gt", "ge", "__lt__", "__le__", "__gt__", "__ge__"}
_CAUSAL = {"tril", "triu", "tril_", "triu_"}
_COMPARE_OPS = {operator.lt, operator.le, operator.gt, operator.ge, torch.lt, torch.le, torch.gt, torch.ge}
# Where a mask's provenance stops: ops that read weights or hidden states, not positions or masks.
_DATA_OPS = _CONTRACT | _SOFTMAX | _SDPA | {"linear", "embedding", "addmm", "conv1d", "conv2d", "layer_norm",
                                          "rms_norm", "group_norm"}
# Ops whose result depends on their tensor input's shape (and dtype, device) only.
_SHAPE_ONLY = {"new_ones", "new_zeros", "new_full", "new_empty", "ones_like", "zeros_like", "full_like",
               "empty_like", "rand_like", "randn_like", "size"}
# Ops a softmax's probabilities pass through on their way to the values, unchanged where they are zero.
_PROBS_PASS = {"dropout", "to", "type", "type_as", "float", "half", "bfloat16", "contiguous", "view", "reshape",
               "transpose", "permute", "unsqueeze", "expand", "clone"}


def padding_hazard(gm: fx.GraphModule, symbols) -> Optional[str]:
    """Why padding ``symbols`` could change a real result, or None (see the module docstring)."""
    symbols = set(symbols)
    why = held_tensor_hazard(gm, symbols)
    if why:
        return why
    masks = _MaskProof(symbols)
    for node in gm.graph.nodes:
        if node.op not in ("call_function", "call_method") or not node.args:
            continue
        name = _name(node)
        why = write_hazard(node, symbols)
        if why:
            return f"{node.format_node()} {why}"
        if name in _SDPA:
            why = _sdpa_hazard(node, symbols, masks)
        elif name in _SOFTMAX:
            why = _softmax_hazard(node, symbols, masks)
        elif name in _CONTRACT:
            why = _contraction_hazard(node, name, symbols)
        else:
            why = _gather_hazard(node, name, symbols) or _indexing_or_reduction_hazard(node, name, symbols)
        if why:
            return f"{node.format_node()} {why}"
    return None


_name, _token_dims = op_name, token_dims


def _arg(node: fx.Node, i: int, key: str, default=None):
    return node.kwargs.get(key, node.args[i] if len(node.args) > i else default)


def _sdpa_hazard(node, symbols, masks) -> Optional[str]:
    keys = _token_dims(_arg(node, 1, "key"), symbols)
    if not keys or not keys[-2]:
        return None
    if _arg(node, 5, "is_causal", False) is True or masks.proves(_arg(node, 3, "attn_mask")):
        return None
    return "attends over padded keys with no causal mask and no mask from a graph input"


def _softmax_hazard(node, symbols, masks) -> Optional[str]:
    on_tokens = _token_dims(node.args[0], symbols)
    dim = _arg(node, 1, "dim")
    if not on_tokens or not any(on_tokens):
        return None
    if not isinstance(dim, int):
        return "takes a softmax over an unknown dim of a tensor with a token dim"
    if not on_tokens[dim]:
        return None
    if masks.proves(node.args[0]):
        return None
    return "takes a softmax over a token dim with no causal mask and no mask from a graph input"


def _contraction_hazard(node, name, symbols) -> Optional[str]:
    """A matmul summing over a token dim is safe only as attention's probabilities times its values."""
    if name == "einsum":
        return _einsum_hazard(node, symbols)
    # Bloom calls torch.baddbmm(input=alibi, batch1=query, batch2=key_t, ...) with keywords only.
    left = _arg(node, 1, "batch1") if name == "baddbmm" else _arg(node, 0, "input")
    on_tokens = _token_dims(left, symbols)
    if not on_tokens or not on_tokens[-1] or _from_masked_softmax(left):
        return None
    return "contracts over a token dim"


def _einsum_hazard(node, symbols) -> Optional[str]:
    equation, operands = node.args[0], node.args[1:]
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = operands[0]
    if not isinstance(equation, str) or "->" not in equation or "." in equation:
        if any(any(_token_dims(o, symbols) or ()) for o in operands):
            return "is an einsum without an explicit output over a tensor with a token dim"
        return None
    inputs, output = equation.replace(" ", "").split("->")
    for letters, operand in zip(inputs.split(","), operands):
        on_tokens = _token_dims(operand, symbols) or []
        for letter, padded in zip(letters, on_tokens):
            if padded and letter not in output and not _from_masked_softmax(operand):
                return "contracts over a token dim"
    return None


def _from_masked_softmax(node) -> bool:
    """``node`` is a softmax's probabilities (the softmax itself is checked where it is visited)."""
    while isinstance(node, fx.Node) and _name(node) in _PROBS_PASS and node.args:
        node = node.args[0]
    return isinstance(node, fx.Node) and _name(node) in _SOFTMAX


def _unpadded_varying_dims(node, symbols) -> List[bool]:
    """Per dim of ``node``'s tensor, whether its size varies per call but is not padded (another symbol)."""
    value = example_value(node) if isinstance(node, fx.Node) else None
    if not isinstance(value, torch.Tensor):
        return []
    return [isinstance(d, torch.SymInt) and not (size_expr(d).free_symbols & symbols) for d in value.shape]


def _gather_hazard(node, name, symbols) -> Optional[str]:
    """Indices with a padded dim reading a dim of another, unpadded size (T5's mask ``m[batch_arange, kv]``
    with the batch padded and ``m``'s own batch symbol not): an index built over the padded size points
    past the real end."""
    if name == "getitem" and isinstance(node.args[1], tuple) and not any(
            e is None or e is Ellipsis for e in node.args[1]):
        pairs = list(enumerate(node.args[1]))
    elif name in ("index_select", "gather") and len(node.args) > 2 and isinstance(node.args[1], int):
        pairs = [(node.args[1], node.args[2])]
    else:
        return None
    varying = _unpadded_varying_dims(node.args[0], symbols)
    for d, index in pairs:
        if -len(varying) <= d < len(varying) and varying[d] and any(_token_dims(index, symbols) or ()):
            return "indexes a dim of another, unpadded size with indices that have a token dim"
    return None


def _indexing_or_reduction_hazard(node, name, symbols) -> Optional[str]:
    on_tokens = _token_dims(node.args[0], symbols)
    if not on_tokens or not any(on_tokens):
        return None
    if name in _MIXING:
        if name in ("max", "min") and isinstance(example_value(_arg(node, 1, "other")), torch.Tensor):
            return None  # torch.max(a, b): elementwise
        dim = _arg(node, 1, "dim")
        dims = [dim] if isinstance(dim, int) else list(dim) if isinstance(dim, (tuple, list)) else None
        if dims is None or any(on_tokens[d] for d in dims if isinstance(d, int)):
            return "reduces over a token dim"
    elif name == "getitem" and isinstance(node.args[1], tuple):
        index = node.args[1]
        if Ellipsis in index or None in index:
            return None  # positions no longer line up with dims; these index no token dim from its end here
        for d, entry in enumerate(index[: len(on_tokens)]):
            if on_tokens[d] and _from_end(entry):
                return "indexes a token dim from its end"
    elif name in ("narrow", "select") and len(node.args) > 2:
        d, start = node.args[1], node.args[2]
        if isinstance(d, int) and on_tokens[d] and isinstance(start, int) and start < 0:
            return "indexes a token dim from its end"
    return None


class _MaskProof:
    """Whether a tensor's provenance masks the keys past the real length (memoized per node)."""

    def __init__(self, symbols):
        self.symbols = symbols
        self._proves: Dict[fx.Node, bool] = {}
        self._positional: Dict[fx.Node, bool] = {}

    def proves(self, node) -> bool:
        return self._walk(node, self._proves, self._is_proof)

    def _is_proof(self, node: fx.Node) -> bool:
        if node.op == "placeholder":
            value = example_value(node)
            return not isinstance(value, torch.nn.Parameter) and any(_token_dims(node, self.symbols) or ())
        name = _name(node)
        if name in _CAUSAL:
            return True
        if name in _COMPARE or node.target in _COMPARE_OPS:
            tensors = [a for a in node.args[:2] if isinstance(example_value(a), torch.Tensor)]
            return len(tensors) == 2 and all(self._walk(a, self._positional, _is_arange) for a in tensors)
        return False

    def _walk(self, node, memo, found: Callable[[fx.Node], bool]) -> bool:
        """``found`` holds at ``node`` or an ancestor, not looking past ops on weights or hidden states."""
        stack, seen = [node], set()
        while stack:
            n = stack.pop()
            if not isinstance(n, fx.Node) or n in seen:
                continue
            seen.add(n)
            if n in memo:
                if memo[n]:
                    break
                continue
            if found(n):
                break
            if _name(n) not in _DATA_OPS and not any(isinstance(example_value(a), torch.nn.Parameter)
                                                     for a in n.all_input_nodes):
                # Sizes and ``*_like`` shapes carry no values: ``torch.ones(ids.size())`` masks nothing.
                stack.extend(a for a in n.all_input_nodes
                             if isinstance(example_value(a), torch.Tensor) and _name(n) not in _SHAPE_ONLY)
        else:
            for n in seen:
                memo.setdefault(n, False)
            return False
        memo[node] = True
        return True


def _is_arange(node: fx.Node) -> bool:
    return _name(node) == "arange"


def _from_end(entry) -> bool:
    if isinstance(entry, int):
        return entry < 0
    if isinstance(entry, slice):
        return any(isinstance(v, int) and v < 0 for v in (entry.start, entry.stop))
    return False
