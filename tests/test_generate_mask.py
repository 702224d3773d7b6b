"""Each generate step's mask made inside the compiled forward (serving/generate_mask.py): HF builds none on
the host, the tokens stay eager PEFT's, and the in-program mask is HF's growing mask padded with zeros."""
import pytest
import torch

import xla_lora_pass as xlp
from xla_lora_pass.demo_models import tiny_peft_llama

from .generate_cases import ROWS, generate_rows, left_padded_prompts


def test_generate_builds_no_mask_on_the_host_and_matches_eager_peft(device, inner, monkeypatch):
    """A static-cache generate's 4-d masks are made inside the compiled forward: HF's create_masks_for_generate
    never runs (it ran once per step before), and the tokens of left-padded rows stay eager PEFT's."""
    import transformers
    from transformers.generation import utils as generation_utils

    from xla_lora_pass.serving.generate_mask import applies_to

    torch._dynamo.reset()
    model, _ = tiny_peft_llama(seed=3)
    if not applies_to(model.get_base_model()):
        # Only transformers 5 may refuse a Llama: its generate passes no cache_position, and HF's mask is kept.
        assert int(transformers.__version__.split(".")[0]) >= 5, transformers.__version__
        pytest.skip("transformers 5: generate passes no cache_position, HF builds the mask")
    ids, mask = left_padded_prompts()
    reference = generate_rows(model, ids, mask, ROWS, "static")
    model.to(device)
    meta = xlp.LoRAMetadata(max_num_tokens=256)
    meta.register_adapters(model)
    compiled = torch.compile(model, backend=xlp.make_backend(meta, inner=inner))
    calls = []
    original = generation_utils.create_masks_for_generate  # the name HF's prepare_inputs_for_generation calls
    monkeypatch.setattr(generation_utils, "create_masks_for_generate",
                        lambda *a, **k: calls.append(1) or original(*a, **k))
    out = generate_rows(compiled, ids, mask, ROWS, "static", device)
    assert torch.equal(out, reference), f"{out}\n{reference}"
    assert calls == [], f"HF built {len(calls)} masks on the host"
    assert "create_masks_for_generate" not in model.get_base_model().__dict__  # removed after the generate


def test_step_mask_is_hf_growing_mask_padded_with_zeros():
    from xla_lora_pass.serving.generate_mask import step_mask

    prompt = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    padded = torch.nn.functional.pad(prompt, (0, 6), value=1)
    for length in range(4, 11):  # HF's mask after length - 4 generated tokens: ones appended
        grown = torch.cat([prompt, torch.ones(2, length - 4, dtype=prompt.dtype)], dim=1)
        want = torch.nn.functional.pad(grown, (0, 10 - length))
        got = step_mask(padded, torch.arange(length - 1, length))
        assert torch.equal(got, want) and got.dtype == want.dtype, length
