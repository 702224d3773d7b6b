"""Issue 29: PEFT's float ``scaling`` however Dynamo hands it to the backend.

torch 2.9 bakes the float into the graph as a constant (and guards on it);
torch 2.14 with ``dynamic=True`` makes it a 0-d tensor input read with
``.item()``, which the rewrite used to refuse ("the delta is scaled by a
tensor").  Either way the mixed batch must be served exactly, and a later
change of the float must be served exactly or refused naming the adapter,
never computed with the old scaling (measured before the per-call check: 0.46
off).
"""
import pytest
import torch

import xla_lora_pass as xlp
from xla_lora_pass.backend.scaling_inputs import SCALING_INPUT

from .models import peft_two_layer, per_row_reference

ROWS = ["sql", None, "chat"]
SITE = "base_model.model.proj"
# How each torch version hands PEFT's float scaling to the backend under dynamic=True (measured).
LIFTS_FLOAT = {(2, 9): False, (2, 14): True}.get(tuple(int(p) for p in torch.__version__.split(".")[:2]))


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Every test compiles PEFT's forward anew: each scaling change retraces a graph of a constant scaling,
    and the tests together would pass Dynamo's recompile limit for that one code object."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _compiled(dynamic, inner="aot_eager"):
    model = peft_two_layer()
    meta = xlp.LoRAMetadata(max_num_tokens=64)
    meta.register_adapters(model)
    backend = xlp.make_backend(meta, inner=inner)
    meta.set_request_adapters(ROWS)
    return model, meta, backend, torch.compile(model, backend=backend, dynamic=dynamic)


def _scaling_inputs(backend):
    return [n.meta[SCALING_INPUT] for g in backend.graphs for n in g.gm.graph.find_nodes(op="placeholder")
            if SCALING_INPUT in n.meta]


def _error(compiled, model, x):
    """max |compiled - eager PEFT| on the mixed batch."""
    with torch.no_grad():
        return (compiled(x) - per_row_reference(model, x, ROWS)).abs().max().item()


@pytest.mark.parametrize("inner", ["aot_eager", "inductor"])
def test_dynamic_compile_serves_the_mixed_batch_at_every_length(inner):
    model, meta, backend, compiled = _compiled(dynamic=True, inner=inner)
    for length in (5, 3, 7):
        assert _error(compiled, model, torch.randn(3, length, 16)) < 1e-5
    assert len(backend.graphs) == 1  # one trace (dynamic) serves every length
    graph = backend.graphs[0]
    assert [(s.site, s.pattern, s.adapter) for s in graph.report.sites] == [(SITE, "lora_linear", "sql")]
    assert not graph.leftovers and not graph.report.near_misses
    if LIFTS_FLOAT is not None:
        assert bool(_scaling_inputs(backend)) == LIFTS_FLOAT
    if _scaling_inputs(backend):
        assert _scaling_inputs(backend) == [(SITE, "sql")]
        # The program reads the stacks, not the input (the .item() read went with the site).
        node = next(n for n in graph.gm.graph.find_nodes(op="placeholder") if SCALING_INPUT in n.meta)
        assert not node.users


@pytest.mark.parametrize("dynamic", [True, None, False])
def test_a_float_scaling_change_after_compiling_is_served_exactly(dynamic):
    model, meta, backend, compiled = _compiled(dynamic)
    x = torch.randn(3, 5, 16)
    assert _error(compiled, model, x) < 1e-5
    layer = model.base_model.model.proj
    for scaling in (3.0, 2.0, 5.0, 3.0):  # back and forth: a graph of an earlier value runs again
        layer.scaling["sql"] = scaling
        before = meta.stats["weight_refreshes"]
        assert _error(compiled, model, x) < 1e-5, scaling
        assert meta.stats["weight_refreshes"] == before + 1  # re-stacked from the model, once
        assert meta.sites[SITE].adapters["sql"].scaling == scaling
    assert all(g.report.sites and not g.leftovers for g in backend.graphs)
    if dynamic and LIFTS_FLOAT:
        assert len(backend.graphs) == 1  # the value is an input: the one program follows it


def test_a_scaling_the_stacks_cannot_hold_is_refused_naming_the_adapter():
    model, meta, backend, compiled = _compiled(dynamic=True)
    x = torch.randn(3, 5, 16)
    assert _error(compiled, model, x) < 1e-5
    # A value the model does not hold: reading the model again cannot bring the stacks to it.
    with pytest.raises(xlp.UnsupportedAdapterError, match=rf"adapter 'sql' at {SITE}: this call scales its delta "
                                                          r"by 7.0 .* the stacks hold 2.0"):
        meta.follow_scalings({(SITE, "sql"): 7.0})
    assert meta.sites[SITE].adapters["sql"].scaling == 2.0
    layer = model.base_model.model.proj
    layer.scaling["sql"] = float("nan")  # Dynamo specializes on a NaN: the site is left alone and the guard refuses
    with pytest.raises((xlp.UnsupportedAdapterError, xlp.UnsupportedMappingError), match="'sql'"):
        with torch.no_grad():
            compiled(x)
    layer.scaling["sql"] = 2.0
    assert _error(compiled, model, x) < 1e-5


def test_an_adapter_loaded_over_the_model_keeps_its_own_scaling():
    model, meta, backend, compiled = _compiled(dynamic=True)
    x = torch.randn(3, 5, 16)
    assert _error(compiled, model, x) < 1e-5
    layer = model.base_model.model.proj
    state = {f"{SITE}.lora_A.weight": layer.lora_A["sql"].weight.detach().clone(),
             f"{SITE}.lora_B.weight": layer.lora_B["sql"].weight.detach().clone()}
    meta.load_adapter("sql", state, scaling=2.0)  # the slot holds the state now, not the model's adapter
    layer.scaling["sql"] = 3.0  # the model's float no longer says what "sql" is
    if _scaling_inputs(backend):
        with torch.no_grad():  # an input: the graph runs on, the stacks' own scaling unchanged
            out = compiled(x)
        layer.scaling["sql"] = 2.0
        torch.testing.assert_close(out, per_row_reference(model, x, ROWS), atol=1e-5, rtol=0)
    else:
        # A constant: Dynamo retraces with 3.0, which is not the loaded adapter's scaling: that site is left
        # alone and the mixed batch refused, naming it.
        with pytest.raises(xlp.UnsupportedMappingError, match=r"\(adapter 'sql'\): the graph scales the delta by 3.0"):
            with torch.no_grad():
                compiled(x)
        layer.scaling["sql"] = 2.0
        assert _error(compiled, model, x) < 1e-5
    assert meta.sites[SITE].adapters["sql"].scaling == 2.0
