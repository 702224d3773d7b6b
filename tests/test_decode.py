"""Decoding: one token per row ([B, 1], Dynamo's size-1 graph) runs the row kernel, and a static-cache
decode loop equals eager PEFT's mixed batch for every batch size, base rows included."""
import pytest
import torch

import xla_lora_pass as xlp
from xla_lora_pass.demo_models import per_sequence_mapping, tiny_peft_llama

from .golden_graphs import transformers_variant
from .helpers import assert_golden, capture_graphs, count_ops, lora_weight_uses, normalize_gm

ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PROMPT, STEPS = 8, 3
ROW_CYCLE = ["sql", "chat", None, "code", "chat"]  # mixed adapters and base rows


def _static_cache(model, max_len):
    from transformers import StaticCache

    return StaticCache(config=model.config, max_cache_len=max_len)


def _rows(batch):
    return [ROW_CYCLE[(i * 3 + 1) % len(ROW_CYCLE)] for i in range(batch)]


def test_decode_graph_runs_the_row_kernel_with_fused_qkv_shrink(update_golden):
    """The [B, 1] graph: each row's one token gathers its slot's weights (Punica's BGMV case)."""
    model, _ = tiny_peft_llama(targets=("q_proj", "k_proj", "v_proj"), num_hidden_layers=1)
    meta = xlp.LoRAMetadata(max_num_tokens=64)
    meta.register_adapters(model)
    (gm, example_inputs), = capture_graphs(model, input_ids=torch.randint(0, 128, (4, 1)))
    new_gm, report = xlp.rewrite(gm, example_inputs, meta, kernel="auto")
    assert report.counts() == {"lora_linear": 3} and report.shrinks_fused == 2
    assert count_ops(new_gm, torch.ops.xla_lora.bgmv_shrink_rows.default) == 1  # q/k/v share one shrink
    assert count_ops(new_gm, torch.ops.xla_lora.bgmv_expand_rows.default) == 3
    assert count_ops(new_gm, torch.ops.xla_lora.bgmv_shrink.default) == 0
    assert lora_weight_uses(new_gm) == 0
    # The whole Llama graph: transformers 5 builds masks and rotary embeddings with other ops than 4.
    assert_golden("lora_linear_decode", normalize_gm(new_gm), update_golden, variant=transformers_variant())


def test_row_kernel_min_tokens_still_sends_short_rows_to_the_masked_kernel(monkeypatch):
    """The setting stays a switch: rows shorter than it keep the masked kernel."""
    model, _ = tiny_peft_llama()
    meta = xlp.LoRAMetadata(max_num_tokens=64)
    meta.register_adapters(model)
    monkeypatch.setattr(xlp.config, "row_kernel_min_tokens", 2)
    (gm, example_inputs), = capture_graphs(model, input_ids=torch.randint(0, 128, (4, 1)))
    new_gm, _ = xlp.rewrite(gm, example_inputs, meta, kernel="auto")
    assert count_ops(new_gm, torch.ops.xla_lora.bgmv_shrink_rows.default) == 0
    assert count_ops(new_gm, torch.ops.xla_lora.bgmv_shrink.default) == 2


@pytest.fixture(scope="module")
def served(device, inner):
    torch._dynamo.reset()
    model, names = tiny_peft_llama(targets=ALL_LINEAR, seed=5)
    cpu_model, _ = tiny_peft_llama(targets=ALL_LINEAR, seed=5)
    model.to(device)
    meta = xlp.LoRAMetadata(max_num_tokens=32 * PROMPT)
    meta.register_adapters(model)
    backend = xlp.make_backend(meta, inner=inner)
    return dict(compiled=torch.compile(model, backend=backend), meta=meta, backend=backend, cpu=cpu_model,
                device=device)


def _eager_steps(cpu_model, prompt, rows, steps):
    """Eager PEFT's mixed batch (``adapter_names=``) with its own static cache: logits of every decode
    step, greedy tokens fed back."""
    names = ["__base__" if a is None else a for a in rows]
    cache = _static_cache(cpu_model, PROMPT + steps)
    out = []
    with torch.no_grad():
        logits = cpu_model(input_ids=prompt, past_key_values=cache, use_cache=True, adapter_names=names,
                           cache_position=torch.arange(PROMPT)).logits
        for i in range(steps):
            token = logits[:, -1:].argmax(-1)
            logits = cpu_model(input_ids=token, past_key_values=cache, use_cache=True, adapter_names=names,
                               cache_position=torch.tensor([PROMPT + i])).logits
            out.append(logits)
    return out


def _compiled_steps(s, prompt, rows, steps):
    """The same loop through the compiled model, the mapping set per call (prompt rows, then one token)."""
    dev, meta = s["device"], s["meta"]
    cache = _static_cache(s["compiled"], PROMPT + steps)
    out = []
    with torch.no_grad():
        meta.set_token_adapters(per_sequence_mapping(rows, PROMPT))
        logits = s["compiled"](input_ids=prompt.to(dev), past_key_values=cache, use_cache=True,
                               cache_position=torch.arange(PROMPT, device=dev)).logits.cpu()
        meta.set_token_adapters(per_sequence_mapping(rows, 1))
        for i in range(steps):
            token = logits[:, -1:].argmax(-1)
            logits = s["compiled"](input_ids=token.to(dev), past_key_values=cache, use_cache=True,
                                   cache_position=torch.tensor([PROMPT + i], device=dev)).logits.cpu()
            out.append(logits)
    return out


@pytest.mark.parametrize("batch", [1, 8, 32])
def test_static_cache_decode_equals_eager_peft(served, batch):
    s = served
    rows = _rows(batch)
    prompt = torch.randint(0, 128, (batch, PROMPT), generator=torch.Generator().manual_seed(batch))
    want = _eager_steps(s["cpu"], prompt, rows, STEPS)
    got = _compiled_steps(s, prompt, rows, STEPS)
    for step, (g, w) in enumerate(zip(got, want)):
        assert (g - w).abs().max().item() < 1e-4, f"decode step {step}, batch {batch}"
    decode_graphs = [g for g in s["backend"].graphs if g.report.sites and _one_token_rows(g)]
    assert decode_graphs and all("rows" in g.kernels and "masked" not in g.variants for g in decode_graphs)


def _one_token_rows(graph) -> bool:
    layout = graph.report.token_layout
    return layout is not None and len(layout) == 2 and not isinstance(layout[-1], torch.SymInt) and \
        int(layout[-1]) == 1


CPU_PROMPT = 6  # not a bucket size: the prompt's graph would pad it to 8


def _cpu_steps(model, cache, prompt, rows, steps, meta=None):
    """Prompt then ``steps`` greedy decode steps on ``cache``: logits of each.  With ``meta``, the compiled
    model's mapping is set per row; without, eager PEFT's own mixed batch (``adapter_names=``)."""
    kw = {} if meta is not None else {"adapter_names": ["__base__" if a is None else a for a in rows]}
    if meta is not None:
        meta.set_request_adapters(rows)
    out = []
    with torch.no_grad():
        logits = model(input_ids=prompt, past_key_values=cache, use_cache=True,
                       cache_position=torch.arange(prompt.shape[1]), **kw).logits
        out.append(logits)
        for i in range(steps):
            logits = model(input_ids=logits[:, -1:].argmax(-1), past_key_values=cache, use_cache=True,
                           cache_position=torch.tensor([prompt.shape[1] + i]), **kw).logits
            out.append(logits)
    return out


def test_static_cache_decode_on_the_cpu_equals_eager_peft_per_row():
    """The StaticCache's tensors are static-address (``mark_static_address``): torch 2.9 lifts or passes them
    (transformers 4.57 makes them in the prompt's graph, written at ``cache_position``), torch 2.14 passes
    them as inputs, its ``cumulative_length`` too.  Padding a graph that writes them would write padded
    positions (0.5 off before), so those graphs run at their exact sizes; every row exact either way."""
    torch._dynamo.reset()
    model, _ = tiny_peft_llama(targets=ALL_LINEAR, seed=5)
    twin, _ = tiny_peft_llama(targets=ALL_LINEAR, seed=5)
    meta = xlp.LoRAMetadata(max_num_tokens=64)
    meta.register_adapters(model)
    backend = xlp.make_backend(meta, inner="aot_eager")
    compiled = torch.compile(model, backend=backend)
    reused = _static_cache(model, CPU_PROMPT + STEPS)
    for batch in (3, 4, 2):  # the second batch retraces with a dynamic batch dim
        rows = _rows(batch)
        prompt = torch.randint(0, 128, (batch, CPU_PROMPT), generator=torch.Generator().manual_seed(batch))
        want = _cpu_steps(twin, _static_cache(twin, CPU_PROMPT + STEPS), prompt, rows, STEPS)
        got = _cpu_steps(compiled, _static_cache(model, CPU_PROMPT + STEPS), prompt, rows, STEPS, meta)
        for step, (g, w) in enumerate(zip(got, want)):
            assert (g - w).abs().max().item() < 1e-4, f"batch {batch}, step {step} (0: the prompt)"
    # One cache for two runs: transformers 5 writes at the layer's own count of tokens, so reset it between.
    rows = _rows(2)
    prompt = torch.randint(0, 128, (2, CPU_PROMPT), generator=torch.Generator().manual_seed(7))
    want = _cpu_steps(twin, _static_cache(twin, CPU_PROMPT + STEPS), prompt, rows, STEPS)
    for run in range(2):
        got = _cpu_steps(compiled, reused, prompt, rows, STEPS, meta)
        reused.reset()
        assert max((g - w).abs().max().item() for g, w in zip(got, want)) < 1e-4, f"run {run} on one cache"
    assert all(g.report.counts() == {"lora_linear": 14} and not g.leftovers for g in backend.graphs)
    # Graphs with a dynamic batch that write the cache are not padded (and say why); no graph pads a cache.
    dynamic = [g for g in backend.graphs if g.shapes.sources and g.report.token_layout is not None
               and any(isinstance(d, torch.SymInt) for d in g.report.token_layout)]
    assert dynamic and all(not g.shapes.padded_symbols and "writes" in g.shapes.not_bucketable
                           for g in dynamic), [g.shapes.not_bucketable for g in dynamic]
