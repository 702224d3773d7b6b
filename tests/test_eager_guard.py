"""The eager guard refuses only a LoRA layer computing the wrong adapters inside a compiled call."""
import pytest
import torch

import xla_lora_pass as xlp
from xla_lora_pass.serving.eager_guard import inside_compiled_call

from .models import peft_two_layer, per_row_reference


def _registered():
    model = peft_two_layer()
    meta = xlp.LoRAMetadata(max_num_tokens=64)
    meta.register_adapters(model)
    return model, meta


def test_eager_peft_outside_compiled_calls_keeps_peft_behaviour():
    """set_adapter, disable_adapter and adapter_names= under a mixed mapping: PEFT's own results, no error."""
    model, meta = _registered()
    x = torch.randn(2, 16)
    meta.set_token_adapters(["sql", "chat"])
    assert not inside_compiled_call()
    with torch.no_grad():
        for adapter in ("chat", "sql"):
            model.set_adapter(adapter)
            torch.testing.assert_close(model(x), per_row_reference(model, x, [adapter, adapter]))
        with model.disable_adapter():
            torch.testing.assert_close(model(x), per_row_reference(model, x, [None, None]))
        torch.testing.assert_close(model(x, adapter_names=["sql", "chat"]),
                                   per_row_reference(model, x, ["sql", "chat"]))


def test_inside_compiled_call_is_true_in_a_graph_break_and_false_after():
    seen = []

    def probe(x):
        seen.append(inside_compiled_call())
        return x

    def fn(x):
        x = x + 1
        torch._dynamo.graph_break()
        return probe(torch.compiler.disable(lambda y: y)(x)) * 2

    torch._dynamo.reset()
    torch.compile(fn, backend="eager")(torch.ones(2))
    assert seen and all(seen)
    assert not inside_compiled_call()


def test_layer_falling_back_to_eager_inside_a_compiled_call_is_refused():
    """Past the recompile limit Dynamo runs the model eagerly: the layer computes one adapter for all rows."""
    model, meta = _registered()
    compiled = torch.compile(model, backend=xlp.make_backend(meta, inner="aot_eager"), dynamic=False)
    torch._dynamo.reset()
    with torch.no_grad(), torch._dynamo.config.patch(recompile_limit=1, automatic_dynamic_shapes=False):
        meta.set_token_adapters(["sql", "chat"])
        compiled(torch.randn(2, 16))  # compiled: served exactly
        meta.set_token_adapters(["sql", "chat", "chat"])
        with pytest.raises(xlp.UnsupportedMappingError, match=r"LoRA layer base_model.model.proj is running "
                                                              r"eagerly inside a compiled call"):
            compiled(torch.randn(3, 16))  # a new static shape past the limit: eager
        meta.set_token_adapters(["sql"] * 3)  # what the eager layer computes (the active adapter): allowed
        x = torch.randn(3, 16)
        torch.testing.assert_close(compiled(x), per_row_reference(model, x, ["sql"] * 3))
    torch._dynamo.reset()


def _llama():
    from xla_lora_pass.demo_models import tiny_peft_llama

    model, names = tiny_peft_llama(num_hidden_layers=1, seed=4)
    return model, names


def test_decode_steps_with_the_default_dynamic_cache_through_the_compiled_model():
    """Each decode step's KV length changes under the same token dims: each gets its own program (it
    crashed at the third decode step when programs were keyed by the token dims alone)."""
    from transformers import DynamicCache

    model, names = _llama()
    rows = ["chat", None]
    ids = torch.randint(3, 128, (2, 5), generator=torch.Generator().manual_seed(1))
    meta = xlp.LoRAMetadata(max_num_tokens=64)
    meta.register_adapters(model)
    compiled = torch.compile(model, backend=xlp.make_backend(meta, inner="aot_eager"))
    names_per_row = ["__base__" if r is None else r for r in rows]
    caches, step_ids = (DynamicCache(), DynamicCache()), ids
    with torch.no_grad():
        for step in range(5):
            meta.set_request_adapters(rows)
            got = compiled(input_ids=step_ids, past_key_values=caches[0], use_cache=True).logits
            want = model(input_ids=step_ids, past_key_values=caches[1], use_cache=True,
                         adapter_names=names_per_row).logits
            assert (got - want).abs().max().item() < 1e-4, step
            step_ids = want[:, -1:].argmax(-1)
    torch._dynamo.reset()
