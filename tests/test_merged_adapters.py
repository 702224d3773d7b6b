"""An adapter merged into the base weights is refused, never served: every row, the base model's too, would get it.

PEFT's ``merge_adapter`` before ``register_adapters`` (refused there) and after it (the layers' forwards
branch on the merge, so Dynamo traces again, and that graph is refused; after ``unmerge_adapter`` the rows
equal eager PEFT again), and loralib's ``eval()`` of a layer built with ``merge_weights=True`` after it was
registered in train mode.  Before the refusal both were served off by 0.1-5.7 on every row.
"""
import copy

import pytest
import torch

import xla_lora_pass as xlp
from xla_lora_pass import UnsupportedAdapterError
from xla_lora_pass.demo_models import eager_reference, tiny_peft_llama

ROWS = ["sql", "chat", None]
IDS = torch.randint(0, 128, (3, 8), generator=torch.Generator().manual_seed(4))
MERGED = "adapters are merged into the base weights"


def _serve(model, device, inner):
    meta = xlp.LoRAMetadata(max_num_tokens=64)
    meta.register_adapters(model.to(device))
    compiled = torch.compile(model, backend=xlp.make_backend(meta, inner=inner))
    meta.set_request_adapters(ROWS)
    return meta, compiled


def _run(compiled, device):
    with torch.no_grad():
        return compiled(input_ids=IDS.to(device)).logits.cpu()


def test_peft_adapter_merged_before_register_adapters_is_refused(device):
    model, _ = tiny_peft_llama(adapters=(("sql", 4, 8), ("chat", 4, 8)))
    model.merge_adapter()  # the active adapter, sql, into q_proj and v_proj of both layers
    with pytest.raises(UnsupportedAdapterError, match=MERGED + r" of 4 layers .*\['sql'\].*unmerge_adapter"):
        xlp.LoRAMetadata(max_num_tokens=64).register_adapters(model.to(device))


def test_peft_adapter_merged_after_compiling_is_refused_and_served_again_once_unmerged(device, inner):
    model, _ = tiny_peft_llama(adapters=(("sql", 4, 8), ("chat", 4, 8)))
    reference = copy.deepcopy(model)
    meta, compiled = _serve(model, device, inner)
    want = eager_reference(reference, IDS, ROWS)
    assert (_run(compiled, device) - want).abs().max().item() < 1e-4
    model.merge_adapter()
    with pytest.raises(Exception, match=MERGED):  # Dynamo's BackendCompilerFailed around it
        _run(compiled, device)
    model.unmerge_adapter()
    assert (_run(compiled, device) - want).abs().max().item() < 1e-4


@pytest.mark.needs("loralib")
def test_loralib_layer_merged_by_eval_after_register_adapters_is_refused():
    import loralib

    torch.manual_seed(0)
    model = torch.nn.Sequential(loralib.Linear(8, 8, r=2, lora_alpha=4))  # merge_weights=True by default
    torch.nn.init.normal_(model[0].lora_B)
    meta = xlp.LoRAMetadata(max_num_tokens=16)
    assert meta.register_adapters(model) == ["default"]  # in train mode: not merged yet
    compiled = torch.compile(model, backend=xlp.make_backend(meta, inner="aot_eager"))
    meta.set_request_adapters(["default", None])
    x = torch.randn(2, 3, 8)
    with torch.no_grad():
        compiled(x)
    model.eval()  # merges B @ A into the weight
    with pytest.raises(Exception, match=MERGED + r" of 1 layers \(0: \['default'\]\).*merge_weights=False"), \
            torch.no_grad():
        compiled(x)
