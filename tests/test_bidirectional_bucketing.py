"""A bidirectional model without an attention mask is never padded; with a mask, and causal models, still bucket.

Tiny HF models with random weights and two PEFT adapters, a mixed batch on
XLA (else the CPU with aot_eager), compared with PEFT eager run once per adapter.
"""
import pytest
import torch
import transformers as T

from xla_lora_pass.demo_models import tiny_llama_config

from .helpers import serve_stream
from .models import with_peft_adapters

ROWS = ["sql", "chat", None]
ADAPTERS = (("sql", 4, 8), ("chat", 8, 16))
MAX_TOKENS = 64  # sequence buckets 8, 16, 32, 64
# The first size Dynamo traces statically; the later ones run one dynamic graph (11, 13, 14 share bucket 16).
LENGTHS = (5, 11, 13, 14)

pytestmark = pytest.mark.compat


def _roberta():
    return T.RobertaForMaskedLM(T.RobertaConfig(vocab_size=128, hidden_size=32, num_hidden_layers=1,
                                                num_attention_heads=4, intermediate_size=64,
                                                max_position_embeddings=80))


def _gpt2():
    return T.GPT2LMHeadModel(T.GPT2Config(vocab_size=128, n_embd=32, n_layer=1, n_head=4, n_positions=64))


def _llama():
    return T.LlamaForCausalLM(tiny_llama_config(num_hidden_layers=1))


MODELS = {
    "roberta": lambda: with_peft_adapters(_roberta, ["query", "key", "value", "dense"], ADAPTERS, 0),
    "gpt2": lambda: with_peft_adapters(_gpt2, ["c_attn", "c_proj", "c_fc"], ADAPTERS, 0, fan_in_fan_out=True),
    "llama": lambda: with_peft_adapters(_llama, ["q_proj", "k_proj", "v_proj", "o_proj"], ADAPTERS, 0),
}


def _serve(family, with_mask, device, inner):
    """(worst abs error against PEFT eager, the backend's dynamic graphs) over LENGTHS."""
    torch._dynamo.reset()
    model = MODELS[family]()
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(1)
    batches = []
    for s in LENGTHS:
        batch = {"input_ids": torch.randint(2, vocab, (len(ROWS), s), generator=g)}
        if with_mask:
            batch["attention_mask"] = torch.ones_like(batch["input_ids"])
        batches.append(batch)
    worst, _, backend = serve_stream(model, device, MAX_TOKENS, ROWS, batches, inner=inner)
    assert all(not g.report.near_misses for g in backend.graphs)
    dynamic = [g for g in backend.graphs if g.shapes.sources and g.report.sites]
    assert dynamic, "no graph of this model traced its token dims as symbols"
    return worst, dynamic


def test_bidirectional_model_without_a_mask_compiles_per_exact_shape(device, inner):
    """Real tokens would attend to padded ones: never padded, so exact, one program per size."""
    worst, dynamic = _serve("roberta", False, device, inner)
    assert worst < 1e-4
    for g in dynamic:
        assert "attends over padded keys" in g.shapes.not_bucketable
        assert g.shapes.padded_symbols == ()
        assert len(g.programs) == len(LENGTHS) - 1  # 11, 13 and 14 each their own program


@pytest.mark.parametrize("family, with_mask", [("roberta", True), ("llama", False), ("gpt2", False)])
def test_masked_or_causal_model_still_buckets(family, with_mask, device, inner):
    worst, dynamic = _serve(family, with_mask, device, inner)
    assert worst < 1e-4
    for g in dynamic:
        assert g.shapes.not_bucketable is None
        assert len(g.programs) == 1  # 11, 13 and 14 all run bucket 16's program
