"""SPMD placement of the stacked adapter buffers (issue 8, docs/scale-out.md).

``meta.shard(mesh)`` (``LoRAMetadata.shard``) makes every device copy of a
site's stacked weights carry a ``torch_xla.distributed.spmd`` annotation that
matches how the site's BASE weight is split over the mesh, so the LoRA delta
is computed with the same tensor-parallel layout as the base matmul it is
added to.  No collective is written here: XLA's SPMD partitioner inserts the
all-reduce of a row-parallel shrink (and anything else it needs).

Layouts (a linear site, base weight ``[out, in]``):

=========  ======================  ==================  =====================
layout     base weight             A ``[N, R, in]``     B ``[N, out, R]``
=========  ======================  ==================  =====================
column     sharded on ``out``      replicated          sharded on ``out``
row        sharded on ``in``       sharded on ``in``   replicated
replicated not sharded             replicated          replicated
=========  ======================  ==================  =====================

LoRA bias rows ``[N, out]`` follow B.  Sites fused on one input (``q+k+v``)
get one concatenated A: sharded on ``in`` if every member is row-parallel,
else replicated.  Token index buffers are left unannotated, which under SPMD
means replicated on every device.

Where the layout comes from, per site: the ``layout`` rule the user passes
(``{"q_proj": "column", "o_proj": "row", ...}`` keyed by the last component
of the site's module path, or a callable ``site_name -> layout``), else the
base weight's own sharding spec (``Runtime.sharding_spec``, runtimes/xla.py),
read the first time the site's device copy is made, so shard the base
weights first.  Either way the layout only decides memory and communication:
any layout gives the same result (SPMD keeps the program's semantics).
"""
from __future__ import annotations

import logging
import re
from typing import Callable, Dict, Mapping, Optional, Sequence, Tuple, Union

import torch

from .. import runtimes

log = logging.getLogger(__name__)

COLUMN, ROW, REPLICATED = "column", "row", "replicated"
LAYOUTS = (COLUMN, ROW, REPLICATED)

# Megatron-LM's tensor-parallel split of a Llama decoder layer.
MEGATRON_LLAMA: Mapping[str, str] = {
    "q_proj": COLUMN, "k_proj": COLUMN, "v_proj": COLUMN, "gate_proj": COLUMN, "up_proj": COLUMN,
    "o_proj": ROW, "down_proj": ROW,
}

LayoutRule = Union[Mapping[str, str], Callable[[str], Optional[str]], None]


def _leaf(site_name: str) -> str:
    return site_name.rsplit(".", 1)[-1]


def megatron_shard_llama(model: torch.nn.Module, mesh, axis: str = "model") -> Dict[str, str]:
    """Shard a (PEFT) Llama's base linear weights Megatron-style in place; returns {module path: layout}.

    Column-parallel q/k/v/gate/up: weight ``[out, in]`` sharded on out (and
    their bias, if any); row-parallel o/down: sharded on in.  Everything else
    (embeddings, norms, lm_head, LoRA weights) is left replicated.
    """
    done = {}
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear) or ".lora_" in f".{name}":
            continue
        parts = name.split(".")
        leaf = parts[-2] if parts[-1] == "base_layer" else parts[-1]
        layout = MEGATRON_LLAMA.get(leaf)
        runtime = runtimes.for_device(module.weight.device)
        if layout == COLUMN:
            runtime.mark_sharding(module.weight, mesh, (axis, None))
            if module.bias is not None:
                runtime.mark_sharding(module.bias, mesh, (axis,))
        elif layout == ROW:
            runtime.mark_sharding(module.weight, mesh, (None, axis))
        else:
            continue
        done[name] = layout
    return done


def tile_dims(spec: str) -> Optional[Tuple[int, ...]]:
    """Tiles per tensor dim of an XLA sharding spec string; None if replicated or unannotated.

    ``"{devices=[4,1]0,1,2,3}"`` -> ``(4, 1)``; the trailing replication dim of
    ``last_tile_dim_replicate`` is dropped.
    """
    m = re.search(r"devices=\[([\d,]+)\]", spec or "")
    if m is None:
        return None
    dims = tuple(int(d) for d in m.group(1).split(","))
    if "last_tile_dim_replicate" in spec:
        dims = dims[:-1]
    return dims if any(d > 1 for d in dims) else None


class AdapterSharding:
    """Per-site layouts over one mesh, and the annotations they imply on the stacked buffers."""

    def __init__(self, meta, mesh, layout: LayoutRule = None, axis: Optional[str] = None, both: bool = False):
        names = tuple(mesh.axis_names) if mesh.axis_names is not None else tuple(range(len(mesh.mesh_shape)))
        if axis is None:
            sharded = [a for a, size in zip(names, mesh.mesh_shape) if size > 1]
            axis = "model" if "model" in names else (sharded[-1] if sharded else names[-1])
        if axis not in names:
            raise ValueError(f"meta.shard: axis {axis!r} is not an axis of the mesh {names}")
        if layout is not None and not callable(layout):
            bad = {k: v for k, v in dict(layout).items() if v not in LAYOUTS}
            if bad:
                raise ValueError(f"meta.shard: layouts must be one of {LAYOUTS}, got {bad}")
        self.meta = meta
        self.mesh = mesh
        self.axis = axis
        self.rule = layout
        # both: also split the stack the base layout leaves whole (A of a column site on its input
        # dim, B of a row site on its output dim): 1/devices of the memory, one more collective.
        self.both = both
        self._layouts: Dict[str, str] = {}

    # ------------------------------------------------------------- layouts
    def layout(self, site_name: str) -> str:
        """``column``, ``row`` or ``replicated`` for one registered site (cached)."""
        if site_name not in self._layouts:
            self._layouts[site_name] = self._resolve(site_name)
        return self._layouts[site_name]

    def layouts(self) -> Dict[str, str]:
        """{site: layout} for every registered site."""
        return {name: self.layout(name) for name in self.meta.sites}

    def forget(self) -> None:
        """Drop cached layouts (after ``register_adapters``: the sites may be new)."""
        self._layouts.clear()

    def _resolve(self, site_name: str) -> str:
        if callable(self.rule):
            got = self.rule(site_name)
            if got is not None:
                if got not in LAYOUTS:
                    raise ValueError(f"meta.shard: layout rule gave {got!r} for {site_name}; expected one of "
                                     f"{LAYOUTS}")
                return got
        elif self.rule is not None:
            for key in (site_name, _leaf(site_name)):
                if key in self.rule:
                    return self.rule[key]
        return self._from_base_weight(site_name)

    def _from_base_weight(self, site_name: str) -> str:
        """Read the layout off the base layer's weight sharding spec (replicated if it has none)."""
        site = self.meta.sites[site_name]
        weight = site.base_weight()
        if weight is None or weight.dim() != 2:
            return REPLICATED
        tiles = tile_dims(runtimes.for_device(weight.device).sharding_spec(weight))
        if tiles is None:
            return REPLICATED
        out_dim = _out_dim(site, weight)
        in_dim = 1 - out_dim
        size = dict(zip(self._axis_names(), self.mesh.mesh_shape))[self.axis]
        if tiles[out_dim] > 1 and tiles[in_dim] == 1:
            found, n = COLUMN, tiles[out_dim]
        elif tiles[in_dim] > 1 and tiles[out_dim] == 1:
            found, n = ROW, tiles[in_dim]
        else:
            log.warning("meta.shard: %s base weight is tiled %s on both dims; its adapters stay replicated "
                        "(pass layout= to choose)", site_name, tiles)
            return REPLICATED
        if n != size:
            log.warning("meta.shard: %s base weight is split %d ways but mesh axis %r has %d devices; its "
                        "adapters stay replicated (pass layout= and axis= to choose)", site_name, n, self.axis, size)
            return REPLICATED
        return found

    def _axis_names(self) -> Sequence:
        return tuple(self.mesh.axis_names) if self.mesh.axis_names is not None else tuple(
            range(len(self.mesh.mesh_shape)))

    # --------------------------------------------------------- annotations
    def partition_specs(self, site_name: Union[str, Tuple[str, ...]]) -> Tuple[tuple, Optional[tuple]]:
        """Partition specs of the site's stacked (A, B); B None for a fused group (a tuple of sites; no B)."""
        if isinstance(site_name, tuple):
            split = all(self._splits_a(self.layout(n)) for n in site_name)
            return (None, None, self.axis if split else None), None
        layout = self.layout(site_name)
        a = (None, None, self.axis) if self._splits_a(layout) else (None, None, None)
        b = (None, self.axis, None) if self._splits_b(layout) else (None, None, None)
        return a, b

    def _splits_a(self, layout: str) -> bool:
        return layout == ROW or (self.both and layout == COLUMN)

    def _splits_b(self, layout: str) -> bool:
        return layout == COLUMN or (self.both and layout == ROW)

    def bias_spec(self, site_name: str) -> tuple:
        return (None, self.axis) if self._splits_b(self.layout(site_name)) else (None, None)

    def place_stacks(self, site_name: Union[str, Tuple[str, ...]], stack_a: Optional[torch.Tensor],
                     stack_b: Optional[torch.Tensor], transposed: bool = False) -> None:
        """Annotate a site's fresh device stacks (in place; the tensors keep their identity).

        ``transposed``: the row kernel's copies, last two dims swapped, so their specs are too.
        """
        spec_a, spec_b = self.partition_specs(site_name)
        if transposed:
            spec_a = None if spec_a is None else (*spec_a[:-2], spec_a[-1], spec_a[-2])
            spec_b = None if spec_b is None else (*spec_b[:-2], spec_b[-1], spec_b[-2])
        if stack_a is not None:
            runtimes.for_device(stack_a.device).mark_sharding(stack_a, self.mesh, spec_a)
        if stack_b is not None and spec_b is not None:
            runtimes.for_device(stack_b.device).mark_sharding(stack_b, self.mesh, spec_b)

    def place_bias(self, site_name: str, bias: torch.Tensor) -> None:
        runtimes.for_device(bias.device).mark_sharding(bias, self.mesh, self.bias_spec(site_name))


def _out_dim(site, weight: torch.Tensor) -> int:
    """Which dim of the base weight is the site's output: 0 for Linear ``[out, in]``, 1 for
    Conv1D (``fan_in_fan_out``) and Embedding ``[vocab, dim]``."""
    if site.kind == "embedding" or getattr(site.module, "fan_in_fan_out", False):
        return 1
    shape = tuple(weight.shape)
    if shape == (site.in_features, site.out_features) and shape != (site.out_features, site.in_features):
        return 1
    return 0


def shard_bytes(tensor: torch.Tensor) -> Tuple[int, int]:
    """(bytes of the largest local shard of ``tensor``, bytes of the whole tensor), from the device buffers."""
    whole = tensor.numel() * tensor.element_size()
    shards = runtimes.for_device(tensor.device).local_shards(tensor)
    if shards is None:
        return whole, whole  # not annotated: replicated under SPMD, or a single device
    return max(s.numel() * s.element_size() for s in shards), whole
