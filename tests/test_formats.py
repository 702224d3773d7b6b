"""LoRA that PEFT did not make, served in a mixed batch on the ``device`` fixture's device (XLA, else the CPU with
aot_eager): torchtune, loralib, hand-written modules.

Each client: the model's own adapter ("default") and a second one loaded
with ``load_adapter`` in the module's own state-dict keys, mixed with the
base model row by row, against running the module once per adapter
(eager, on the CPU); then a remap and a reload, with no compile.
"""
import copy

import pytest
import torch

import xla_lora_pass as xlp
from xla_lora_pass.demo_models import per_sequence_mapping
from xla_lora_pass import UnsupportedAdapterError

from . import format_models as fm
from .helpers import lora_weight_uses
from .xla_utils import device_compiles

ROWS = ["default", "second", None]
SEQ = 5


def _logits(out):
    return out.logits if hasattr(out, "logits") else out


def _eager(model, state, ids):
    """The module itself, run once with ``state`` loaded over its LoRA weights."""
    m = copy.deepcopy(model)
    m.load_state_dict(state, strict=False)
    with torch.no_grad():
        return _logits(m(ids))


def _expected(per_adapter, rows):
    return torch.stack([per_adapter[r][i] for i, r in enumerate(rows)])


CLIENTS = {
    "torchtune": (fm.torchtune_llama, {"lora_linear": 10}),  # q, v, w1, w2, w3 x 2 layers
    "loralib": (fm.loralib_net, {"lora_linear": 2, "lora_embedding": 1}),
    "loralib_merged": (fm.loralib_merged_net, {"lora_merged": 2}),
    "handwritten": (fm.handwritten_net, {"lora_linear": 2}),
}


# The optional clients' models: skipped, naming the package, where it is not installed.
NEEDS = {"torchtune": "torchtune", "loralib": "loralib", "loralib_merged": "loralib"}


@pytest.fixture(scope="module", params=[pytest.param(name, marks=[pytest.mark.needs(NEEDS[name])] if name in NEEDS
                                                     else []) for name in sorted(CLIENTS)])
def client(request, device, inner):
    torch._dynamo.reset()
    factory, rewrites = CLIENTS[request.param]
    model = factory()
    ids = torch.randint(0, fm.VOCAB, (len(ROWS), SEQ), generator=torch.Generator().manual_seed(0))
    second, third = fm.randomize_lora(model, 2), fm.randomize_lora(model, 3)
    per_adapter = {"default": _eager(model, {}, ids), "second": _eager(model, second, ids),
                   None: _eager(model, fm.without_lora(model), ids), "third": _eager(model, third, ids)}
    model.to(device)
    meta = xlp.LoRAMetadata(max_num_tokens=64, max_slots=2)
    assert meta.register_adapters(model) == ["default"]
    assert meta.load_adapter("second", second) == 1
    backend = xlp.make_backend(meta, inner=inner)
    compiled = torch.compile(model, backend=backend)
    yield dict(name=request.param, rewrites=rewrites, meta=meta, backend=backend, compiled=compiled, ids=ids,
               per_adapter=per_adapter, third=third, device=device)
    torch._dynamo.reset()


def _run(c, rows):
    c["meta"].set_token_adapters(per_sequence_mapping(rows, SEQ))
    with torch.no_grad():
        return _logits(c["compiled"](c["ids"].to(c["device"]))).cpu()


def test_mixed_batch_matches_one_eager_run_per_adapter(client):
    c = client
    out = _run(c, ROWS)
    diff = (out - _expected(c["per_adapter"], ROWS)).abs().max().item()
    assert diff < 1e-4, f"{c['name']}: {diff}"
    assert c["meta"].stats["rewrites"] == c["rewrites"]
    assert all(lora_weight_uses(g.gm) == 0 for g in c["backend"].graphs)


def test_remap_and_reload_do_not_compile(client):
    c = client
    _run(c, ROWS)
    before = device_compiles(c["device"], c["meta"])
    rows = ROWS[::-1]
    out = _run(c, rows)
    assert (out - _expected(c["per_adapter"], rows)).abs().max().item() < 1e-4
    all_base = _run(c, [None] * len(ROWS))  # the output is the base model's, not an adapter's
    assert (all_base - c["per_adapter"][None]).abs().max().item() < 1e-4
    c["meta"].load_adapter("second", c["third"])  # new weights into the same slot
    out = _run(c, ROWS)
    expected = _expected({**c["per_adapter"], "second": c["per_adapter"]["third"]}, ROWS)
    assert (out - expected).abs().max().item() < 1e-4
    assert device_compiles(c["device"], c["meta"]) == before


def test_loralib_layer_merged_into_its_weight_is_refused():
    import loralib

    torch.manual_seed(0)
    model = torch.nn.Sequential(loralib.Linear(8, 8, r=2, lora_alpha=4))  # merge_weights=True by default
    model.eval()  # merges B @ A into the weight
    with pytest.raises(UnsupportedAdapterError, match="'0' has merged its adapter into its weight"):
        xlp.LoRAMetadata(max_num_tokens=16).register_adapters(model)


def test_handwritten_layer_without_a_scaling_is_refused():
    layer = fm.MatmulLoRA(8, 8, rank=2, scaling=1.0)
    del layer.scaling
    with pytest.raises(UnsupportedAdapterError, match="no scaling: give it a number attribute `scaling`"):
        xlp.LoRAMetadata(max_num_tokens=16).register_adapters(torch.nn.Sequential(layer))


@pytest.mark.needs("torchtune")
def test_load_adapter_refuses_keys_of_another_format():
    meta = xlp.LoRAMetadata(max_num_tokens=16, max_slots=2)
    meta.register_adapters(fm.torchtune_llama())
    state = {"layers.0.attn.q_proj.lora_A.weight": torch.zeros(4, 32)}  # PEFT's spelling, torchtune model
    with pytest.raises(KeyError, match="is not a lora_A / lora_B weight.*lora_a.weight"):
        meta.load_adapter("x", state)
    assert meta.slots == ["default", None]
