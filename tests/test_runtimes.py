"""xla_lora_pass/runtimes/: the runtime of each device, the inner backend it gives (``inner=`` over it), the
static-shapes switch make_backend reads from it, and the package without torch_xla."""
import importlib.util
import os
import subprocess
import sys

import pytest
import torch
from torch._dynamo import lookup_backend

import xla_lora_pass as xlp
from xla_lora_pass import runtimes
from xla_lora_pass.backend.inner_backend import inductor_decomposing_kernels, inner_compiler

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
needs_xla = pytest.mark.skipif(importlib.util.find_spec("torch_xla") is None, reason="needs torch_xla")


def _run(script: str) -> str:
    """Run ``script`` in a fresh interpreter of this venv from the repository root (its stdout)."""
    env = dict(os.environ, PYTHONPATH=REPO)
    run = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout


def test_each_device_type_has_its_runtime_and_inner_backend():
    chosen = {name: runtimes.for_device(name) for name in ("cpu", "cuda:1", "xla:0", "tpu")}
    assert {name: r.inner_backend for name, r in chosen.items()} == {
        "cpu": "inductor", "cuda:1": "inductor", "xla:0": "openxla", "tpu": "tpu"}
    assert runtimes.for_device(torch.device("cuda", 0)) is chosen["cpu"] is runtimes.GENERIC
    assert runtimes.for_device(torch.device("xla")) is chosen["xla:0"]
    # Only TorchTPU's backend refuses symbolic shapes; only torch_xla places tensors by annotation.
    assert [name for name, r in chosen.items() if r.static_shapes] == ["tpu"]
    assert [name for name, r in chosen.items() if r.spmd] == ["xla:0"]


def test_cpu_inputs_compile_with_inductor_unless_inner_says():
    cpu = [torch.zeros(2, 3), 4]
    # Inductor, given every xla_lora op's decomposition (backend/inner_backend.py).
    assert inner_compiler(None, cpu) is inner_compiler("inductor", cpu) is inductor_decomposing_kernels
    assert inner_compiler("aot_eager", cpu) is lookup_backend("aot_eager")

    def mine(gm, example_inputs):
        return gm

    assert inner_compiler(mine, cpu) is mine


@needs_xla
def test_xla_inputs_compile_with_openxla_unless_inner_says(xla_device):
    # A graph on the XLA device may still take host tensors: the device one decides.
    inputs = [torch.zeros(2), torch.zeros(2, device=xla_device)]
    assert runtimes.for_inputs(inputs).name == "xla"
    assert inner_compiler(None, inputs) is lookup_backend("openxla")
    assert inner_compiler("aot_eager", inputs) is lookup_backend("aot_eager")


def test_static_shapes_follow_the_inner_backend_unless_make_backend_says():
    meta = xlp.LoRAMetadata(max_num_tokens=16)
    cpu = [torch.zeros(2)]
    assert not xlp.make_backend(meta).static_shapes_for(cpu)
    assert xlp.make_backend(meta, inner="tpu").static_shapes_for(cpu)  # TorchTPU's backend, named
    assert not xlp.make_backend(meta, inner="aot_eager").static_shapes_for(cpu)
    assert xlp.make_backend(meta, inner="aot_eager", static_shapes=True).static_shapes_for(cpu)
    assert not xlp.make_backend(meta, inner="tpu", static_shapes=False).static_shapes_for(cpu)


class _SetMarks(runtimes.Runtime):
    """A runtime whose storage marks the test sets (what XLA's data handles are to the watch)."""

    def __init__(self):
        self.marks = {}

    def storage_marks(self, tensors):
        return [self.marks.get(id(t), 0) for t in tensors]


class _NoValues:
    """A format whose layers hold no scaling outside their tensors."""

    def value_sources(self, site, adapter):
        return []


class _Site:
    """What the watch reads of a registered site: its name, adapters, layer, format and live tensors."""

    def __init__(self, name, tensors):
        self.name, self.adapters, self._tensors = name, set(tensors), tensors
        self.module, self.format = torch.nn.Module(), _NoValues()
        for adapter, ts in tensors.items():
            for i, t in enumerate(ts):
                self.module.register_buffer(f"{adapter}_{i}", t)

    def live_tensors(self):
        return [(t, (adapter, "A")) for adapter, ts in self._tensors.items() for t in ts]


def test_the_weight_watch_asks_each_tensor_s_runtime_for_its_storage(monkeypatch):
    from xla_lora_pass.metadata.weight_watch import WeightWatch

    device = _SetMarks()
    monkeypatch.setitem(runtimes.RUNTIMES, "meta", device)
    host, on_device, other = torch.zeros(2), torch.empty(2, device="meta"), torch.empty(3, device="meta")
    watch = WeightWatch()
    watch.watch([_Site("q", {"x": [host, on_device], "y": [other]})])
    assert watch.changed() == {}
    device.marks[id(other)] = 1  # new storage, as only its runtime can tell
    assert watch.changed() == {"y": ["q"]}
    watch.accept([("q", "y")])
    host.data.copy_(torch.ones(2))  # the host tensor through .data: seen by value
    assert watch.changed() == {"x": ["q"]}


# TorchTPU stood in for: PrivateUse1 renamed "tpu" with a device module, fake tensors on it, and a "tpu"
# compile backend registered as torch_tpu registers its own.
FAKE_TPU = """
import types, torch
torch.utils.rename_privateuse1_backend("tpu")
device_module = types.ModuleType("stand_in_tpu")
device_module.is_initialized = lambda: True
device_module.is_available = lambda: True
device_module.current_device = lambda: 0
device_module.device_count = lambda: 1
torch._register_device_module("tpu", device_module)

@torch._dynamo.register_backend(name="tpu")
def stand_in(gm, example_inputs):
    return gm

from torch._subclasses.fake_tensor import FakeTensorMode
import xla_lora_pass as xlp
from xla_lora_pass import runtimes
from xla_lora_pass.backend.lora_backend import inner_compiler
from torch._dynamo import lookup_backend

with FakeTensorMode():
    on_tpu = [torch.zeros(2), torch.empty(4, 8, device="tpu")]
assert on_tpu[1].device.type == "tpu"
assert runtimes.for_inputs(on_tpu) is runtimes.for_device(on_tpu[1].device) is runtimes.RUNTIMES["tpu"]
assert inner_compiler(None, on_tpu) is stand_in
assert inner_compiler("aot_eager", on_tpu) is lookup_backend("aot_eager")
meta = xlp.LoRAMetadata(max_num_tokens=16)
assert xlp.make_backend(meta).static_shapes_for(on_tpu)
assert not xlp.make_backend(meta).static_shapes_for(on_tpu[:1])
assert not xlp.make_backend(meta, inner="aot_eager").static_shapes_for(on_tpu)
print("ok")
"""


def test_a_tpu_device_gets_torch_tpu_s_backend_and_static_shapes():
    assert _run(FAKE_TPU).strip() == "ok"


# torch_xla as if not installed: the path finder does not find it (import fails, find_spec says None).
HIDDEN_TORCH_XLA = """
import importlib.machinery, sys
find = importlib.machinery.PathFinder.find_spec
importlib.machinery.PathFinder.find_spec = classmethod(
    lambda cls, name, path=None, target=None: None if name.split(".")[0] == "torch_xla" else find(name, path, target))
import torch
import xla_lora_pass as xlp
from xla_lora_pass.runtimes import xla_layer_norm
backend = xlp.make_backend(xlp.LoRAMetadata(max_num_tokens=16))
assert backend.static_shapes_for([torch.zeros(2)]) is False
assert "torch_xla" not in sys.modules
print(xla_layer_norm.status())
"""


HIDE_TORCH_XLA = HIDDEN_TORCH_XLA[:HIDDEN_TORCH_XLA.index("import torch\n")]


def test_the_package_imports_and_makes_a_backend_without_torch_xla():
    assert _run(HIDDEN_TORCH_XLA).strip() == "skipped: torch_xla is not installed"


def test_the_demo_runs_on_the_cpu_with_inductor_without_torch_xla():
    """The README's demo where torch_xla is not installed: mixed rows and generate exact against eager PEFT."""
    out = _run(HIDE_TORCH_XLA + "from xla_lora_pass.demo import main\nraise SystemExit(main())\n")
    assert "device, inner backend: cpu, inductor" in out and out.strip().endswith("OK"), out


def test_the_default_cpu_path_compiles_with_inductor_exact_against_peft():
    """No inner=: CPU inputs go to inductor; mixed rows at two lengths and a remap exact against PEFT's own
    mixed batch (fp32), the remap compiling nothing."""
    from xla_lora_pass.demo_models import eager_reference, per_sequence_mapping, tiny_peft_llama

    model, _ = tiny_peft_llama(targets=("q_proj", "v_proj", "down_proj"))
    ids = torch.randint(0, 128, (4, 12), generator=torch.Generator().manual_seed(1))
    calls = [(["sql", "chat", "code", None], 12), (["chat", "code", None, "sql"], 12),
             (["code", None, "sql", "sql"], 5)]
    want = [eager_reference(model, ids[:, :n], rows) for rows, n in calls]
    meta = xlp.LoRAMetadata(max_num_tokens=256)
    meta.register_adapters(model)
    backend = xlp.make_backend(meta)
    compiled = torch.compile(model, backend=backend)
    compiles = []
    for (rows, n), expected in zip(calls, want):
        meta.set_token_adapters(per_sequence_mapping(rows, n))
        with torch.no_grad():
            got = compiled(input_ids=ids[:, :n]).logits
        assert (got - expected).abs().max().item() < 1e-4, rows
        compiles.append(meta.stats["compiles"])
    assert compiles[1] == compiles[0]  # a new mapping is new inputs, not a new program
    assert meta.stats["rewrites"] and backend.graphs
    assert all(g.inner is inductor_decomposing_kernels for g in backend.graphs)
