"""Floats of the model (not LoRA scalings) that Dynamo hands to the backend as 0-d tensor inputs.

torch 2.14's Dynamo lifts a Python float the model reads (``nn.Embedding``'s
``norm_type``, Llama's ``variance_epsilon``, its attention ``scaling``) to a
0-d tensor input read with ``.item()`` under ``dynamic=True``, and without it
once the float has had two values in calls of the same code.  The programs
are compiled per bucket outside Dynamo's tracing context, where that read
raised ``DataDependentOutputException`` (every such model failed to compile
under aot_eager and inductor).  Now the value is a constant of each program
and part of its key: a float changed between calls gets a program of its
own, never the old value's.  torch 2.9 bakes these floats in and guards on
them: the same tests hold there through Dynamo's retrace.
"""
import pytest
import torch
import torch.fx as fx

import xla_lora_pass as xlp
from xla_lora_pass.backend.program_inputs import ProgramInputs
from xla_lora_pass.demo_models import tiny_peft_llama
from xla_lora_pass.shapes.bucketing import GraphShapes

from .models import per_row_eager

ROWS = ["sql", None, "chat"]
# Whether Dynamo lifts the model's floats to inputs under dynamic=True, by torch version (measured).
LIFTS_FLOATS = {(2, 9): False, (2, 14): True}.get(tuple(int(p) for p in torch.__version__.split(".")[:2]))


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test traces Llama's forward anew: a float lifted in one test must not be a constant in the next."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _served(device, inner, dynamic, seed=0, **config_kw):
    model, _ = tiny_peft_llama(seed=seed, **config_kw)
    reference, _ = tiny_peft_llama(seed=seed, **config_kw)
    model.to(device)
    meta = xlp.LoRAMetadata(max_num_tokens=64)
    meta.register_adapters(model)
    backend = xlp.make_backend(meta, inner=inner)
    return model, reference, meta, backend, torch.compile(model, backend=backend, dynamic=dynamic)


def _error(compiled, meta, reference, ids, device):
    """max |compiled - PEFT's own mixed batch| of the logits, ``ROWS`` one per row."""
    meta.set_request_adapters(ROWS)
    with torch.no_grad():
        got = compiled(input_ids=ids.to(device)).logits.cpu()
    return (got - per_row_eager(reference, ids, ROWS).logits).abs().max().item()


def _ids(length, seed=1):
    return torch.randint(0, 128, (len(ROWS), length), generator=torch.Generator().manual_seed(seed))


def _lifted(backend) -> int:
    return sum(len(g.program_inputs.read_values) for g in backend.graphs)


def test_dynamic_compile_of_a_model_reading_floats_is_exact(device, inner):
    model, reference, meta, backend, compiled = _served(device, inner, dynamic=True)
    for length in (5, 8, 11, 3):
        assert _error(compiled, meta, reference, _ids(length), device) < 1e-4, length
    graph = backend.graphs[-1]
    assert sum(s.pattern == "lora_linear" for s in graph.report.sites) == 4  # q_proj, v_proj in 2 layers
    assert not graph.leftovers
    if LIFTS_FLOATS is not None:
        assert bool(_lifted(backend)) == LIFTS_FLOATS


def test_a_float_changed_between_calls_is_computed_with_its_new_value(device, inner):
    model, reference, meta, backend, compiled = _served(device, inner, dynamic=True)
    ids = _ids(6)
    assert _error(compiled, meta, reference, ids, device) < 1e-4
    norms = [model.base_model.model.model.norm, reference.base_model.model.model.norm]
    before = per_row_eager(reference, ids, ROWS).logits
    for eps in (0.5, 2.0):
        for norm in norms:
            norm.variance_epsilon = eps
        # The change is visible: a program run with the old value would be off by more than the tolerance.
        assert (per_row_eager(reference, ids, ROWS).logits - before).abs().max().item() > 1e-2
        assert _error(compiled, meta, reference, ids, device) < 1e-4, eps
    compiles = meta.stats["compiles"]
    for norm in norms:
        norm.variance_epsilon = 0.5  # a value already seen: its program (or Dynamo's graph of it) runs again
    assert _error(compiled, meta, reference, ids, device) < 1e-4
    if _lifted(backend):
        assert meta.stats["compiles"] == compiles


def test_two_configurations_of_one_model_class_in_one_process(device, inner):
    """Without dynamic=True: the second configuration's rms_norm_eps differs, so Dynamo lifts it (torch 2.14)."""
    first = _served(device, inner, dynamic=None, rms_norm_eps=1e-6)
    second = _served(device, inner, dynamic=None, seed=1, rms_norm_eps=1e-2)
    for length in (5, 7):
        for model, reference, meta, backend, compiled in (first, second):
            assert _error(compiled, meta, reference, _ids(length), device) < 1e-4, length


def _item_graph():
    """Dynamo's form of ``x * eps`` for a lifted float ``eps``: ``x * eps_tensor.item()``."""
    graph = fx.Graph()
    x, eps = graph.placeholder("x"), graph.placeholder("eps")
    item = graph.call_method("item", (eps,))
    graph.output(graph.call_function(torch.mul, (x, item)))
    return fx.GraphModule(torch.nn.Module(), graph)


def test_a_read_value_is_in_the_program_key_and_a_constant_of_its_program():
    gm = _item_graph()
    x = torch.randn(4)
    inputs = ProgramInputs(gm, 2, GraphShapes.analyze(gm, 2, None))
    assert inputs.read_values == (1,)
    assert inputs.key({}, [x, torch.tensor(2.0)]) != inputs.key({}, [x, torch.tensor(3.0)])
    program = inputs.program_graph(gm, [x, torch.tensor(3.0)])
    assert not any(n.op == "call_method" and n.target == "item" for n in program.graph.nodes)
    # The constant is the value it was made for, whatever the input of a later call (the key selects it).
    torch.testing.assert_close(program(x, torch.tensor(5.0)), x * 3.0)
    assert any(n.target == "item" for n in gm.graph.nodes)  # Dynamo's graph itself is left as it was
