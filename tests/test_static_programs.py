"""Static programs (backend/static_programs.py) and inductor given the kernels' decompositions
(backend/inner_backend.py), on the CPU.

A stand-in for a static-shapes-only inner backend (TorchTPU's "tpu") refuses
any symbolic size and any op outside ATen, then compiles with aot_eager: a
PEFT model with adapters mixed per row runs through it at several lengths,
exact against PEFT's own mixed batch, one program per bucket.
"""
import operator

import pytest
import torch
import torch.fx as fx

import xla_lora_pass as xlp
from xla_lora_pass.backend.inner_backend import inductor_decomposing_kernels
from xla_lora_pass.demo_models import eager_reference, tiny_peft_llama
from xla_lora_pass.kernels.table import decompositions

ROWS = ["sql", "chat", None, "code"]


class StaticOnly:
    """An inner backend that takes static ATen graphs only: raises on a SymInt in an example input or a node's
    meta, or on a call of anything but an ATen op; compiles the rest with aot_eager and counts its calls."""

    def __init__(self):
        self.calls = 0
        self.sizes = []  # the token count of each compiled program's input_ids

    def __call__(self, gm: fx.GraphModule, example_inputs):
        for value in example_inputs:
            _refuse_symbolic(value, "an example input")
        for node in gm.graph.nodes:
            for key in ("val", "example_value"):
                if key in node.meta:
                    _refuse_symbolic(node.meta[key], f"{node.format_node()} meta[{key!r}]")
            if node.op == "call_function" and node.target is not operator.getitem:
                if not (isinstance(node.target, torch._ops.OpOverload) and node.target.namespace == "aten"):
                    raise AssertionError(f"not an ATen op: {node.format_node()}")
            if node.op in ("call_module", "call_method"):
                raise AssertionError(f"not an ATen op: {node.format_node()}")
        self.calls += 1
        self.sizes.append(example_inputs[0].shape)
        from torch._dynamo import lookup_backend

        return lookup_backend("aot_eager")(gm, example_inputs)


def _refuse_symbolic(value, where):
    values = value if isinstance(value, (list, tuple)) else [value]
    for v in values:
        if isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            raise AssertionError(f"symbolic value in {where}: {v}")
        if isinstance(v, torch.Tensor):
            if any(isinstance(d, torch.SymInt) for d in (*v.shape, *v.stride())):
                raise AssertionError(f"symbolic size in {where}: {tuple(v.shape)}")


@pytest.fixture(scope="module")
def model():
    peft_model, _ = tiny_peft_llama(targets=("q_proj", "v_proj", "o_proj"))
    return peft_model


def _serve(model, **backend_kw):
    meta = xlp.LoRAMetadata(max_num_tokens=256)
    meta.register_adapters(model)
    backend = xlp.make_backend(meta, **backend_kw)
    meta.set_request_adapters(ROWS)
    return meta, backend, torch.compile(model, backend=backend)


def _check(model, compiled, ids):
    with torch.no_grad():
        got = compiled(input_ids=ids).logits
    torch.testing.assert_close(got, eager_reference(model, ids, ROWS), rtol=0, atol=1e-4)


def test_every_xla_lora_op_has_its_decomposition():
    ops = {name for name in dir(torch.ops.xla_lora) if name.startswith("bgmv_")}
    assert ops and {op.name().split("::")[1].split(".")[0] for op in decompositions()} == ops


def test_a_static_only_backend_gets_one_static_aten_program_per_bucket(model):
    inner = StaticOnly()
    meta, backend, compiled = _serve(model, inner=inner, static_shapes=True)
    ids = torch.randint(0, 128, (len(ROWS), 16), generator=torch.Generator().manual_seed(0))
    # Dynamo's first graph is static at 5; then the bucketed graph: 7 -> 8, 11 and 16 -> 16, 1 -> Dynamo's
    # size-1 specialisation.
    for n in (5, 7, 11, 16, 1):
        _check(model, compiled, ids[:, :n])
    assert all(g.static for g in backend.graphs)
    programs = sum(len(g.programs) for g in backend.graphs)
    assert inner.calls == meta.stats["compiles"] == programs
    assert sorted(s[-1] for s in inner.sizes) == [1, 5, 8, 16]  # one per bucket: 11 and 16 share one
    for n in (6, 13, 16):  # seen buckets: nothing compiles
        _check(model, compiled, ids[:, :n])
    assert inner.calls == programs


def test_inductor_fuses_the_decomposed_kernels_exactly(model):
    from torch._inductor.utils import run_and_get_code

    meta, backend, compiled = _serve(model)  # CPU inputs: inductor, given the decompositions
    ids = torch.randint(0, 128, (len(ROWS), 16), generator=torch.Generator().manual_seed(1))
    for n in (5, 7):
        _, code = run_and_get_code(_check, model, compiled, ids[:, :n])
        # Inductor's comments name the ops a fused kernel came from; a call is code, not a comment.
        calls = [line for c in code for line in c.splitlines()
                 if "xla_lora" in line and not line.strip().startswith("#")]
        assert code and not calls, calls
    assert meta.stats["rewrites"] and all(g.inner is inductor_decomposing_kernels for g in backend.graphs)
