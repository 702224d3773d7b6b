"""Shared test helpers: graph capture, golden files, and the one rewrite check."""
from __future__ import annotations

import re
from typing import Callable, Dict, Optional, Sequence

import torch
import torch.fx as fx

import xla_lora_pass as xlp

from .golden_graphs import GOLDEN_DIR, assert_golden, normalize_gm  # noqa: F401 (the tests import them from here)


def capture_graphs(fn: Callable, *args, **kwargs):
    """Every (GraphModule, example_inputs) Dynamo hands a backend for one call of ``fn``."""
    return xlp.capture_graphs(fn, *args, **kwargs)


def compile_lora(model, device, max_num_tokens: int, **backend_kw):
    """Move ``model`` to ``device``, register it with a new metadata, compile it with the backend.

    Returns (meta, backend, compiled model); ``backend_kw`` go to ``make_backend``.
    """
    model.to(device)
    meta = xlp.LoRAMetadata(max_num_tokens=max_num_tokens)
    meta.register_adapters(model)
    backend = xlp.make_backend(meta, **backend_kw)
    return meta, backend, torch.compile(model, backend=backend)


class ServedLlama:
    """A tiny PEFT Llama with LoRA on every linear, compiled with the backend on ``device``, and its eager CPU
    twin: the packed-batch tests serve token mappings through it and compare with a per-token reference."""

    TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

    def __init__(self, device, rows: int = 1, max_num_tokens: int = 256):
        from xla_lora_pass.demo_models import tiny_peft_llama

        model, _ = tiny_peft_llama(targets=self.TARGETS)
        self.cpu, _ = tiny_peft_llama(targets=self.TARGETS)
        self.cpu.load_state_dict(model.state_dict())
        self.meta, self.backend, self.compiled = compile_lora(model, device, max_num_tokens=max_num_tokens)
        self.ids = torch.randint(0, 128, (rows, 128), generator=torch.Generator().manual_seed(5))
        self.device = device

    def run(self, mapping, rows: int = 1):
        """(compiled logits, per-token eager logits) of the first ``rows`` rows under the flat ``mapping``."""
        from xla_lora_pass.demo_models import per_token_reference

        ids = self.ids[:rows, :len(mapping) // rows]
        self.meta.set_token_adapters(mapping)
        with torch.no_grad():
            got = self.compiled(input_ids=ids.to(self.device)).logits.cpu()
        return got, per_token_reference(self.cpu, ids, mapping)

    def dynamic_graph(self):
        """The Dynamo graph of the calls after the first (Dynamo's first, static trace may be another)."""
        return next(g for g in reversed(self.backend.graphs) if g.source is not None)


def packed(segments) -> list:
    """One entry per token from ``[(adapter, length), ...]``: requests as contiguous segments."""
    return [a for a, n in segments for _ in range(n)]


def kernel_op_case(idx, num_slots=3, rank=4, d=16, o=12, dtype=torch.float32, seed=0):
    """(x [T, d], A [N, rank, d], B [N, o, rank], y [T, o], int32 idx) for a kernel's op-level tests."""
    g = torch.Generator().manual_seed(seed)
    t = len(idx)
    x = torch.randn(t, d, generator=g).to(dtype)
    a = torch.randn(num_slots, rank, d, generator=g).to(dtype)
    b = torch.randn(num_slots, o, rank, generator=g).to(dtype)
    y = torch.randn(t, o, generator=g).to(dtype)
    return x, a, b, y, torch.tensor(idx, dtype=torch.int32)


def two_layer_per_token(model, x, mapping):
    """TwoLayer's proj is its only LoRA layer and tokens do not interact: a row-wise selection is the truth."""
    with torch.no_grad():
        outs = {}
        for name in {m for m in mapping if m is not None}:
            model.set_adapter(name)
            outs[name] = model(x)
        with model.disable_adapter():
            outs[None] = model(x)
        model.set_adapter("sql")
    return torch.stack([outs[m][i] for i, m in enumerate(mapping)])


def count_ops(gm: fx.GraphModule, target) -> int:
    """Nodes calling ``target`` (an op overload, function or method name)."""
    return sum(1 for n in gm.graph.nodes if n.op in ("call_function", "call_method") and n.target == target)


def lora_weight_uses(gm: fx.GraphModule) -> int:
    """Uses of registered LoRA weight placeholders left in the graph (0 when every site is rewritten)."""
    from graph_rewrites import LORA_WEIGHT

    return sum(len(n.users) for n in gm.graph.find_nodes(op="placeholder") if LORA_WEIGHT in n.meta)


def rewritten_inputs(gm: fx.GraphModule, example_inputs: Sequence, meta: xlp.LoRAMetadata, token_dims) -> list:
    """A rewritten graph's arguments: ``example_inputs`` then the metadata's extra inputs, as the backend feeds them."""
    from graph_rewrites import LORA_INPUT
    from xla_lora_pass.kernels.table import lora_graph_inputs

    device = next(t.device for t in example_inputs if isinstance(t, torch.Tensor))
    requests = [n.meta[LORA_INPUT] for n in gm.graph.find_nodes(op="placeholder") if LORA_INPUT in n.meta]
    return [*example_inputs, *lora_graph_inputs(meta, requests, device, tuple(token_dims), tuple(token_dims))]


def run_rewritten(gm: fx.GraphModule, example_inputs: Sequence, meta: xlp.LoRAMetadata, token_dims):
    """Run a rewritten graph eagerly, feeding the metadata's extra inputs as the backend would."""
    with torch.no_grad():
        return gm(*rewritten_inputs(gm, example_inputs, meta, token_dims))


def check_rewrite(fn: Callable, args: Sequence, meta: xlp.LoRAMetadata, *, rewrites: Dict[str, int],
                  ops: Dict, reference: torch.Tensor, token_dims, atol: float = 1e-4, rtol: float = 0.0,
                  output_index: int = 0):
    """The one shared check: rewrite counts, op counts in the new graph, and equality with eager.

    ``fn(*args)`` is captured by Dynamo (one graph expected), rewritten, and
    run with the metadata's current mapping; ``reference`` is the eager
    result that mapping stands for.  Returns (rewritten gm, report).
    """
    graphs = capture_graphs(fn, *args)
    assert len(graphs) == 1, f"expected one Dynamo graph, got {len(graphs)}"
    gm, example_inputs = graphs[0]
    new_gm, report, kernel = backend_rewrite(gm, example_inputs, meta, token_dims)
    assert report.error is None, report.error
    assert report.counts() == rewrites, report.format()
    if isinstance(ops, KernelCounts):
        ops = ops.resolve(kernel, report)
    for target, n in ops.items():
        assert count_ops(new_gm, target) == n, f"{target}: {count_ops(new_gm, target)} != {n}\n{new_gm.code}"
    out = run_rewritten(new_gm, example_inputs, meta, token_dims)[output_index]
    torch.testing.assert_close(out, reference, atol=atol, rtol=rtol)
    return new_gm, report


def backend_rewrite(gm: fx.GraphModule, example_inputs: Sequence, meta: xlp.LoRAMetadata, token_dims):
    """(rewritten graph, report, kernel name) the backend runs for this call: its own per-call choice
    (``CompiledLoRAGraph.graph_for_call``) over its rewrites of ``gm`` under ``config.kernel``."""
    from xla_lora_pass.backend.lora_backend import LoRABackend
    from xla_lora_pass.kernels.table import FALLBACK

    backend = LoRABackend(meta)
    chosen = backend.rewrite_and_wrap(gm, example_inputs, xlp.config.kernel)
    chosen = chosen.graph_for_call(tuple(token_dims), tuple(token_dims))
    return chosen.gm, chosen.report, next(iter(chosen.kernels), FALLBACK)


class KernelCounts:
    """Shrink/expand counts for the sites on the token layout, in whichever kernel the rewrite used.

    ``also``: counts of other ops, which win over those (an embedding's own shrink and masked expand).
    """

    def __init__(self, shrink: int, expand: int, also: Optional[Dict] = None):
        self.shrink, self.expand, self.also = shrink, expand, dict(also or {})

    def resolve(self, kernel: str, report) -> Dict:
        from xla_lora_pass.kernels.table import SPECS

        out = {}
        for spec in SPECS:
            mine = spec.name == kernel
            out[spec.shrink_op] = self.shrink if mine else 0
            out[spec.expand_op] = self.expand if mine else 0
        return {**out, **self.also}


def shrink_expand_counts(shrink: int, expand: int, also: Optional[Dict] = None) -> KernelCounts:
    """Op counts for ``check_rewrite`` in the kernel the backend would use (sites on the token layout)."""
    return KernelCounts(shrink, expand, also)


def count_shrinks(gm: fx.GraphModule) -> int:
    """Shrink calls of any kernel of the table."""
    from xla_lora_pass.kernels.table import SPECS

    return sum(count_ops(gm, spec.shrink_op) for spec in SPECS)


def strip_ids(text: str) -> str:
    return re.sub(r"0x[0-9a-f]+", "0x", text)


def per_adapter_reference(model, rows, run: Callable):
    """One eager run per adapter of a PEFT model, row i taken from adapter rows[i]'s run (None: base).

    For layers PEFT's own ``adapter_names=`` cannot serve (OPT's ``[B*S, H]``):
    ``run(model)`` returns the batch's output; the model itself is left as it was.
    """
    import copy

    model = copy.deepcopy(model)
    outs = {}
    with torch.no_grad():
        for name in set(rows):
            if name is None:
                with model.disable_adapter():
                    outs[name] = run(model)
            else:
                model.set_adapter(name)
                outs[name] = run(model)
    return torch.stack([outs[r][i] for i, r in enumerate(rows)])


def serve_stream(model, device, max_num_tokens: int, rows, batches, **backend_kw):
    """Run each batch (keyword inputs) through the compiled model with row i on adapter rows[i].

    Returns (worst abs error of the logits against PEFT eager run once per
    adapter, meta, backend); the model is back on the CPU afterwards.
    ``backend_kw`` go to ``make_backend``.
    """
    references = [per_adapter_reference(model, rows, lambda m, kw=kw: m(**kw).logits) for kw in batches]
    meta, backend, compiled = compile_lora(model, device, max_num_tokens, **backend_kw)
    worst = 0.0
    for batch, ref in zip(batches, references):
        s = batch["input_ids"].shape[1]
        meta.set_token_adapters([r for r in rows for _ in range(s)])
        with torch.no_grad():
            out = compiled(**{k: v.to(device) for k, v in batch.items()}).logits.cpu()
        worst = max(worst, (out - ref).abs().max().item())
    model.cpu()
    return worst, meta, backend
