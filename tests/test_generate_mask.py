"""Each generate step's mask made inside the compiled forward (serving/generate_mask.py): HF builds none on
the host, the tokens stay eager PEFT's, and the in-program mask is HF's growing mask padded with zeros.
Run on transformers 4 (generate passes ``cache_position``) and 5 (it passes none: the step's position is the
static cache's own length), and on a sliding-window cache, which transformers 5 leaves to HF's mask."""
import pytest
import torch

import xla_lora_pass as xlp
from xla_lora_pass.demo_models import tiny_peft_gpt2, tiny_peft_llama

from .generate_cases import ROWS, generate_rows, left_padded_prompts

pytestmark = pytest.mark.compat  # how generate passes the step's position and builds its masks changes between releases


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


def _tiny_peft_opt():
    """OPT: learned positions that its forward derives from the attention mask when none are passed."""
    import transformers
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(3)
    config = transformers.OPTConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                    ffn_dim=64, word_embed_proj_dim=32, max_position_embeddings=64)
    model = None
    for name, rank, alpha in (("sql", 4, 8), ("chat", 8, 16), ("code", 2, 2)):
        config_lora = LoraConfig(r=rank, lora_alpha=alpha, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
        if model is None:
            model = get_peft_model(transformers.OPTForCausalLM(config).eval(), config_lora, adapter_name=name)
        else:
            model.add_adapter(name, config_lora)
    return model.eval()


FAMILIES = {
    "llama": lambda: tiny_peft_llama(seed=3)[0],  # rotary positions
    # Learned absolute positions: a position off by the left padding changes the tokens (rotary ones do not).
    "gpt2": lambda: tiny_peft_gpt2(seed=3)[0],
    "opt": _tiny_peft_opt,
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_generate_builds_no_mask_on_the_host_and_matches_eager_peft(family, device, inner, monkeypatch):
    """A static-cache generate's 4-d masks are made inside the compiled forward: HF's create_masks_for_generate
    never runs (it ran once per step before), and the tokens of left-padded rows stay eager PEFT's.  The
    forward keeps the model's signature, so HF still passes ``position_ids`` (GPT-2's, OPT's learned positions
    follow the left padding only through them) and ``logits_to_keep``."""
    import functools
    import inspect

    from xla_lora_pass.serving.generate_mask import applies_to

    torch._dynamo.reset()
    model = FAMILIES[family]()
    transformer = model.get_base_model()
    assert applies_to(transformer)
    seen = []
    original_prepare = transformer.prepare_inputs_for_generation

    @functools.wraps(original_prepare)  # HF reads its signature too (which model kwargs are used)
    def prepare(*args, **kwargs):
        seen.append(set(inspect.signature(transformer.forward).parameters))
        return original_prepare(*args, **kwargs)

    monkeypatch.setattr(transformer, "prepare_inputs_for_generation", prepare)
    calls = _generate_counting_host_masks(model, device, inner, monkeypatch)
    assert calls == 0, f"HF built {calls} masks on the host"
    own = set(inspect.signature(type(transformer).forward).parameters) - {"self"}
    assert {"position_ids"} <= own and seen and all(names == own for names in seen), (own, seen[:1])


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
