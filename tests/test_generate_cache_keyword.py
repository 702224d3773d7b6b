"""The cache a served ``generate`` is given and hands over, by either keyword: transformers 5.25 renamed
``generate``'s ``past_key_values`` to ``cache`` (it still takes the old name, with a FutureWarning, and drops it
when both are given)."""
import pytest
import torch

import xla_lora_pass as xlp
from xla_lora_pass.demo_models import tiny_peft_llama

from .generate_cases import ROWS, adapter_names_of, left_padded_prompts


@pytest.fixture(scope="module")
def llama(device, inner):
    torch._dynamo.reset()
    model, _ = tiny_peft_llama()
    ids, mask = left_padded_prompts()
    model.to(device)
    meta = xlp.LoRAMetadata(max_num_tokens=256)
    meta.register_adapters(model)
    backend = xlp.make_backend(meta, inner=inner)
    return dict(model=model, backend=backend, compiled=torch.compile(model, backend=backend), ids=ids, mask=mask,
                device=device)


@pytest.mark.parametrize("keyword", ["past_key_values", "cache"])
def test_generate_refuses_a_growing_cache_object(llama, keyword):
    from transformers import DynamicCache

    with pytest.raises(ValueError, match=f"{keyword} is a DynamicCache, which grows by one position per token"
                                         ".*'static'"):
        with torch.no_grad():
            llama["compiled"].generate(input_ids=llama["ids"].to(llama["device"]), max_new_tokens=2,
                                       adapter_names=adapter_names_of(ROWS), **{keyword: DynamicCache()})


@pytest.mark.compat
def test_the_served_generate_passes_its_cache_by_the_keyword_generate_takes(llama, recwarn):
    """The routed generate and precompile_generate hand HF the serving cache by the installed transformers'
    own keyword, so they raise no deprecation of ``past_key_values`` (transformers 5.25 warns at each use)."""
    llama["backend"].precompile_generate(llama["model"], [len(ROWS)], [llama["ids"].shape[1]], 2, progress=False)
    with torch.no_grad():
        llama["compiled"].generate(input_ids=llama["ids"].to(llama["device"]),
                                   attention_mask=llama["mask"].to(llama["device"]), max_new_tokens=2,
                                   adapter_names=adapter_names_of(ROWS))
    deprecations = [str(w.message) for w in recwarn if "past_key_values" in str(w.message)]
    assert not deprecations, deprecations
