"""Issue 2 end to end: a tiny PEFT Llama, 3 adapters and the base model mixed in one batch, on XLA (the ``device``
fixture: the CPU with aot_eager where torch_xla is not installed)."""
import subprocess
import sys
import textwrap

import pytest
import torch

import xla_lora_pass as xlp
from xla_lora_pass.demo_models import eager_reference, per_sequence_mapping, tiny_peft_llama

from .helpers import lora_weight_uses
from .xla_utils import device_compiles

ROWS = ["sql", "chat", "code", None]
SEQ = 6


@pytest.fixture(scope="module")
def setup(device, inner):
    torch._dynamo.reset()
    model, names = tiny_peft_llama()
    ids = torch.randint(0, 128, (len(ROWS), SEQ), generator=torch.Generator().manual_seed(0))
    refs = {tuple(ROWS): eager_reference(model, ids, ROWS)}
    rotated = ROWS[2:] + ROWS[:2]
    refs[tuple(rotated)] = eager_reference(model, ids, rotated)
    model.to(device)
    meta = xlp.LoRAMetadata(max_num_tokens=256, max_slots=4)
    meta.register_adapters(model)
    backend = xlp.make_backend(meta, inner=inner)
    compiled = torch.compile(model, backend=backend)
    return dict(model=model, ids=ids, refs=refs, meta=meta, backend=backend, compiled=compiled,
                device=device, rotated=rotated)


def _run(s):
    with torch.no_grad():
        return s["compiled"](input_ids=s["ids"].to(s["device"])).logits.cpu()


@pytest.mark.compat
def test_mixed_batch_equals_eager_peft_and_every_layer_is_rewritten(setup):
    s = setup
    s["meta"].set_token_adapters(per_sequence_mapping(ROWS, SEQ))
    logits = _run(s)
    diff = (logits - s["refs"][tuple(ROWS)]).abs().max().item()
    assert diff < 1e-4, diff
    peft_layers = len(s["meta"].sites)  # PEFT's own LoRA layers: q_proj, v_proj x 2 decoder layers
    assert peft_layers == 4
    assert s["meta"].stats["rewrites"] == {"lora_linear": peft_layers}
    [graph] = s["backend"].graphs
    assert lora_weight_uses(graph.gm) == 0  # no LoRA A or B matmul left in the graph
    assert s["meta"].stats["compiles"] == 1


def test_new_mapping_and_new_slot_weights_do_not_recompile(setup):
    s = setup
    s["meta"].set_token_adapters(per_sequence_mapping(ROWS, SEQ))
    _run(s)
    before = device_compiles(s["device"], s["meta"])
    s["meta"].set_token_adapters(per_sequence_mapping(s["rotated"], SEQ))
    logits = _run(s)
    assert (logits - s["refs"][tuple(s["rotated"])]).abs().max().item() < 1e-4
    assert device_compiles(s["device"], s["meta"]) == before

    # A new adapter into the free slot: the tokens that use it change, nothing compiles.
    q0 = "base_model.model.model.layers.0.self_attn.q_proj"
    g = torch.Generator().manual_seed(7)
    state = {f"{q0}.lora_A.weight": torch.randn(3, 32, generator=g),
             f"{q0}.lora_B.weight": torch.randn(32, 3, generator=g)}
    slot = s["meta"].load_adapter("fresh", state, scaling=1.5)
    s["meta"].set_token_adapters(per_sequence_mapping([None, None, None, "fresh"], SEQ))
    with_fresh = _run(s)
    s["meta"].set_token_adapters(per_sequence_mapping([None] * 4, SEQ))
    base = _run(s)
    assert slot == 3
    assert device_compiles(s["device"], s["meta"]) == before
    assert torch.equal(with_fresh[:3], base[:3])
    assert (with_fresh[3] - base[3]).abs().max().item() > 1e-3
    assert s["meta"].stats["compiles"] == 1


def test_mapping_of_the_wrong_length_is_refused(setup):
    s = setup
    s["meta"].set_token_adapters(["sql"] * (len(ROWS) * SEQ - 1))
    with pytest.raises(xlp.UnsupportedMappingError, match="23 entries but this call has 24 tokens"):
        _run(s)


def test_near_miss_graph_refuses_a_mixed_mapping(xla_device):
    """A layer left alone computes the active adapter: only an all-active mapping is exact."""
    torch._dynamo.reset()
    model, _ = tiny_peft_llama(num_hidden_layers=1)
    ids = torch.randint(0, 128, (2, 4))
    meta = xlp.LoRAMetadata(max_num_tokens=64)
    meta.register_adapters(model)
    reference = eager_reference(model, ids, ["sql", "sql"])
    # A nonlinearity before the shrink: B(A(tanh(x))) is not a LoRA delta of x, so no pattern may match.
    model.base_model.model.model.layers[0].self_attn.q_proj.lora_dropout["sql"] = torch.nn.Tanh()
    reference_now = eager_reference(model, ids, ["sql", "sql"])
    assert not torch.allclose(reference, reference_now)
    model.to(xla_device)
    compiled = torch.compile(model, backend=xlp.make_backend(meta))
    meta.set_token_adapters(["sql"] * 4 + ["chat"] * 4)
    with pytest.raises(xlp.UnsupportedMappingError, match=r"q_proj \(adapter 'sql'\): "):
        with torch.no_grad():
            compiled(input_ids=ids.to(xla_device))
    meta.set_token_adapters(["sql"] * 8)
    with torch.no_grad():
        logits = compiled(input_ids=ids.to(xla_device)).logits.cpu()
    assert (logits - reference_now).abs().max().item() < 1e-4
    assert meta.stats["rewrites"] == {"lora_linear": 1}  # v_proj still rewritten


def test_backend_name_works_without_importing_the_package():
    """setup.py's torch_dynamo_backends entry point: backend="xla_lora" from a fresh interpreter."""
    code = textwrap.dedent("""
        import sys, torch
        from peft import LoraConfig, get_peft_model
        torch.manual_seed(0)
        model = get_peft_model(torch.nn.Sequential(torch.nn.Linear(8, 8)),
                               LoraConfig(r=2, target_modules=["0"], init_lora_weights=False)).eval()
        assert "xla_lora_pass" not in sys.modules
        compiled = torch.compile(model, backend="xla_lora")  # found through the entry point
        with torch.no_grad():
            compiled(torch.randn(3, 8))
        import xla_lora_pass as xlp
        meta = xlp.default_metadata()
        print(len(meta.sites), meta.stats["compiles"])
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[-2:] == ["0", "1"], out.stdout
