"""Each generate step's mask made inside the compiled forward (serving/generate_mask.py): HF builds none on
the host, the tokens stay eager PEFT's, and the in-program mask is HF's growing mask padded with zeros.
Run on transformers 4 (generate passes ``cache_position``) and 5 (it passes none: the step's position is the
static cache's own length), and on a sliding-window cache, which transformers 5 leaves to HF's mask."""
import pytest
import torch

pytestmark = pytest.mark.compat

import xla_lora_pass as xlp
from xla_lora_pass.demo_models import tiny_peft_llama

from .generate_cases import ROWS, generate_rows, left_padded_prompts


def _generate_counting_host_masks(model, device, inner, monkeypatch):
    """The tokens of a static-cache generate of left-padded rows through the backend, against eager PEFT's,
    and how many masks HF built on the host."""
    from transformers.generation import utils as generation_utils

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
    assert "create_masks_for_generate" not in model.get_base_model().__dict__  # removed after the generate
    return len(calls)


def test_generate_builds_no_mask_on_the_host_and_matches_eager_peft(device, inner, monkeypatch):
    """A static-cache generate's 4-d masks are made inside the compiled forward: HF's create_masks_for_generate
    never runs (it ran once per step before), and the tokens of left-padded rows stay eager PEFT's."""
    from xla_lora_pass.serving.generate_mask import applies_to

    torch._dynamo.reset()
    model, _ = tiny_peft_llama(seed=3)
    assert applies_to(model.get_base_model())
    calls = _generate_counting_host_masks(model, device, inner, monkeypatch)
    assert calls == 0, f"HF built {calls} masks on the host"


def test_a_sliding_window_cache_keeps_hf_mask_on_transformers_5(device, inner, monkeypatch):
    """Near miss: Gemma 2, a sliding window of 4 (shorter than every prompt plus its 16 tokens) on one layer
    and full attention on the other, so the cache is as long as a full layer's.  Transformers 5's sliding
    cache layer does not hold every token, so HF builds its masks as without this package (once per step);
    on either version the tokens stay eager PEFT's."""
    import transformers
    from peft import LoraConfig, get_peft_model

    torch._dynamo.reset()
    torch.manual_seed(3)
    config = transformers.Gemma2Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=4)
    targets = ["q_proj", "v_proj"]
    model = get_peft_model(transformers.Gemma2ForCausalLM(config).eval(),
                           LoraConfig(r=4, target_modules=targets, init_lora_weights=False), adapter_name="sql")
    for name in ("chat", "code"):
        model.add_adapter(name, LoraConfig(r=8, target_modules=targets, init_lora_weights=False))
    calls = _generate_counting_host_masks(model.eval(), device, inner, monkeypatch)
    if int(transformers.__version__.split(".")[0]) >= 5:
        assert calls > 0, "transformers 5: the sliding cache's masks were made in the program"


def test_step_mask_is_hf_growing_mask_padded_with_zeros():
    from xla_lora_pass.serving.generate_mask import step_mask

    prompt = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    padded = torch.nn.functional.pad(prompt, (0, 6), value=1)
    for length in range(4, 11):  # HF's mask after length - 4 generated tokens: ones appended
        grown = torch.cat([prompt, torch.ones(2, length - 4, dtype=prompt.dtype)], dim=1)
        want = torch.nn.functional.pad(grown, (0, 10 - length))
        got = step_mask(padded, torch.tensor(length - 1))  # the step's last cache position
        assert torch.equal(got, want) and got.dtype == want.dtype, length
