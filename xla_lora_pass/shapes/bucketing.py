"""Shape bucketing: pad the token dims to a few sizes so XLA compiles a few programs.

Knows nothing of LoRA.  ``GraphShapes`` reads the symbolic sizes (sympy
expressions on SymInts) Dynamo recorded on a graph's inputs and outputs, finds
which input arguments carry each symbol, and at call time binds the symbols,
pads inputs to the bucket and slices outputs back.

Padding is exact for graphs whose tokens do not interact, or interact only
through causal attention or an attention mask padded with zeros: padded
positions sit after every real one, padded rows are separate sequences, and
every output is sliced back.  ``padding_hazard`` (its own module) finds the
graphs where that does not hold; those are compiled per exact shape.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import sympy
import torch
import torch.fx as fx

from graph_rewrites.fx_values import example_value, size_expr

from .padding_hazard import padding_hazard

Dim = Any  # an int or a sympy expression


class Buckets:
    """A sorted set of sizes a dim is padded up to."""

    def __init__(self, sizes: Sequence[int]):
        sizes = sorted({int(s) for s in sizes})
        if not sizes or sizes[0] < 1:
            raise ValueError(f"bucket sizes must be positive integers, got {sizes}")
        self.sizes: Tuple[int, ...] = tuple(sizes)

    @classmethod
    def pow2(cls, min: int = 8, max: int = 8192) -> "Buckets":
        """Powers of two from ``min`` (itself rounded up to one) to ``max`` (always included)."""
        if min < 1 or max < min:
            raise ValueError(f"pow2 needs 1 <= min <= max, got min={min}, max={max}")
        sizes, s = [], 1 << (min - 1).bit_length()
        while s < max:
            sizes.append(s)
            s *= 2
        return cls(sizes + [max])

    @classmethod
    def pow2_then_gap(cls, min: int = 8, gap: int = 512, max: int = 8192) -> "Buckets":
        """Powers of two up to ``gap``, then every multiple of ``gap`` (vLLM's ``padding_gap``)."""
        if gap < min:
            raise ValueError(f"gap={gap} must be >= min={min}")
        if gap >= max:
            return cls.pow2(min, max)
        return cls(list(cls.pow2(min, gap).sizes) + list(range(2 * gap, max, gap)) + [max])

    @property
    def max(self) -> int:
        return self.sizes[-1]

    def pad(self, n: int) -> int:
        """The smallest bucket >= n; a clear error above the largest."""
        if n > self.max:
            raise ValueError(f"size {n} exceeds the largest bucket {self.max}; "
                             f"raise the bucket policy's max (buckets: {list(self.sizes)})")
        for s in self.sizes:
            if s >= n:
                return s
        raise AssertionError("unreachable")

    def pad_length(self, n: int) -> int:
        """A KV cache's length for ``n`` positions: ``pad(n)`` up to the largest bucket, then powers of two.

        A generate's cache holds prompt + new tokens of one row, which no
        bound on the tokens of one call limits; past the largest bucket,
        powers of two keep a long generation to O(log n) cache lengths, so
        O(log n) decode programs.
        """
        if n < 1:
            raise ValueError(f"a cache length must be >= 1, got {n}")
        return self.pad(n) if n <= self.max else 1 << (n - 1).bit_length()

    def waste(self, n: int) -> float:
        """Fraction of a padded batch of size n that is padding."""
        return 1.0 - n / self.pad(n)

    def table(self) -> List[Tuple[int, int, float]]:
        """(bucket, smallest size it serves, worst-case padding fraction) per bucket."""
        rows, lo = [], 1
        for s in self.sizes:
            rows.append((s, lo, 1.0 - lo / s))
            lo = s + 1
        return rows

    def __iter__(self) -> Iterator[int]:
        return iter(self.sizes)

    def __len__(self) -> int:
        return len(self.sizes)

    def __repr__(self) -> str:
        return f"Buckets({list(self.sizes)})"


def _dims_of(value) -> Optional[Tuple[Dim, ...]]:
    if isinstance(value, torch.Tensor):
        return tuple(size_expr(s) for s in value.shape)
    return None


def _expr_of(value) -> Optional[Dim]:
    if isinstance(value, torch.SymInt):
        return size_expr(value)
    return None


def evaluate(expr: Dim, bindings: Dict[sympy.Symbol, int]) -> int:
    """An int dim, or a sympy expression evaluated at ``bindings``."""
    if isinstance(expr, int):
        return expr
    return int(expr.xreplace({k: sympy.Integer(v) for k, v in bindings.items()}))


@dataclasses.dataclass
class GraphShapes:
    """Where each size symbol of a graph comes from and where it goes."""

    inputs: List[Tuple[str, Any]]  # per argument: ("tensor", dims) | ("symint", expr) | ("other", None)
    outputs: List[Tuple[str, Any]]
    sources: Dict[sympy.Symbol, Tuple[int, Optional[int]]]  # symbol -> (arg, dim or None)
    token_layout: Optional[Tuple[Dim, ...]]  # the LoRA sites' leading dims, if any
    padded_symbols: Tuple[sympy.Symbol, ...]
    not_bucketable: Optional[str]

    @classmethod
    def analyze(cls, gm: fx.GraphModule, num_args: int, token_layout: Optional[Sequence[Any]]) -> "GraphShapes":
        """Read the symbolic sizes of the first ``num_args`` placeholders and of every output."""
        inputs, sources = [], {}
        for i, node in enumerate(list(gm.graph.find_nodes(op="placeholder"))[:num_args]):
            value = example_value(node)
            if _dims_of(value) is not None:
                dims = _dims_of(value)
                inputs.append(("tensor", dims))
                for d, e in enumerate(dims):
                    if isinstance(e, sympy.Symbol):
                        sources.setdefault(e, (i, d))
            elif _expr_of(value) is not None:
                inputs.append(("symint", _expr_of(value)))
                if isinstance(_expr_of(value), sympy.Symbol):
                    sources[_expr_of(value)] = (i, None)
            else:
                inputs.append(("other", None))
        outputs = []
        for out in _flat_outputs(gm):
            value = example_value(out) if isinstance(out, fx.Node) else out
            if _dims_of(value) is not None:
                outputs.append(("tensor", _dims_of(value)))
            elif _expr_of(value) is not None:
                outputs.append(("symint", _expr_of(value)))
            else:
                outputs.append(("other", None))
        layout = None
        if token_layout is not None:
            layout = tuple(size_expr(e) for e in token_layout)
        padded, why_not = cls._plan(inputs, outputs, sources, layout)
        if why_not is None and padded:
            why_not = padding_hazard(gm, set(padded))
        if why_not is not None:
            padded = ()
        return cls(inputs, outputs, sources, layout, padded, why_not)

    @staticmethod
    def _plan(inputs, outputs, sources, layout):
        """Which symbols get padded, or why this graph cannot be padded at all."""
        if layout is not None:
            symbols = set()
            for d in layout:
                if not isinstance(d, (int, sympy.Symbol)):
                    return (), f"token dim {d} is not a plain size symbol"
                if isinstance(d, sympy.Symbol):
                    symbols.add(d)
        else:
            symbols = {s for s, (_, dim) in sources.items() if dim is not None}
        missing = [s for s in symbols if s not in sources]
        if missing:
            return (), f"no input carries the size symbols {missing}"
        for kind, dims in inputs + outputs:
            exprs = dims if kind == "tensor" else ((dims,) if kind == "symint" else ())
            for e in exprs:
                if isinstance(e, sympy.Expr) and not isinstance(e, sympy.Symbol) and e.free_symbols & symbols:
                    if kind == "tensor":
                        return (), f"a graph input or output has the size {e}, which padding cannot slice back"
        return tuple(sorted(symbols, key=str)), None

    def bind(self, args: Sequence[Any]) -> Dict[sympy.Symbol, int]:
        """The value of every size symbol in this call."""
        out = {}
        for sym, (i, d) in self.sources.items():
            out[sym] = int(args[i]) if d is None else int(args[i].shape[d])
        return out

    def token_dims(self, bindings) -> Optional[Tuple[int, ...]]:
        if self.token_layout is None:
            return None
        return tuple(evaluate(d, bindings) for d in self.token_layout)

    def pad_args(self, args: Sequence[Any], padded: Dict[sympy.Symbol, int], on_host: bool = False) -> List[Any]:
        """Inputs zero-padded along every padded symbol's dims (zero: a valid id, a masked position).

        ``on_host``: pad a copy on the host and send it back, for a device
        whose writes are compiled programs (XLA's lazy tensors: padding there
        would be one more program to compile per distinct input size; a host
        round trip is only transfers).
        """
        out = list(args)
        for i, (kind, dims) in enumerate(self.inputs):
            if kind == "symint":
                out[i] = evaluate(dims, padded)
            elif kind == "tensor":
                target = tuple(evaluate(d, padded) for d in dims)
                if target != tuple(args[i].shape):
                    out[i] = _zero_pad(args[i], target, on_host)
        return out

    def slice_outputs(self, outs, bindings: Dict[sympy.Symbol, int]):
        """Outputs narrowed back to the real sizes of this call."""
        flat = list(outs)
        for i, (kind, dims) in enumerate(self.outputs):
            if kind == "tensor" and isinstance(flat[i], torch.Tensor):
                for d, e in enumerate(dims):
                    real = evaluate(e, bindings)
                    if flat[i].shape[d] != real:
                        flat[i] = flat[i].narrow(d, 0, real)
            elif kind == "symint":
                flat[i] = evaluate(dims, bindings)
        return type(outs)(flat) if isinstance(outs, tuple) else flat


def _flat_outputs(gm: fx.GraphModule) -> List[Any]:
    result = gm.graph.output_node().args[0]
    return list(result) if isinstance(result, (tuple, list)) else [result]


def _zero_pad(t: torch.Tensor, target: Tuple[int, ...], on_host: bool) -> torch.Tensor:
    """``t`` in a zero tensor of shape ``target`` (made on the host and sent back if ``on_host``)."""
    host = t.detach().cpu() if on_host else t
    out = torch.zeros(target, dtype=host.dtype, device=host.device)
    out[tuple(slice(0, s) for s in host.shape)] = host
    return out.to(t.device) if on_host else out
