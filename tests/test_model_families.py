"""HF model families the other tests do not use, each with a form of its own, in mixed batches against PEFT.

- Falcon: ``FalconLinear`` is an ``nn.Linear`` whose forward is ``x @ W.T`` (every mixed batch was refused:
  the form was a near miss);
- Bloom: ``torch.baddbmm(input=alibi, batch1=, batch2=)`` with keywords only (every compile raised
  ``IndexError`` in the padding hazard rule);
- OPT: its MLP runs on the tokens flattened to ``[B*S, H]`` (PEFT's own ``adapter_names=`` refuses it, so
  the reference is PEFT run once per adapter);
- Mixtral: a sparse MoE block (top-k routing, ``sort`` over the tokens), LoRA on the attention;
- Gemma 2: soft-capped attention and logits, sliding-window layers.

Tiny configs, random weights, two adapters of different ranks and the base model in one batch at two
lengths (Dynamo's first static graph, then the dynamic one), fp32 to 1e-4.
"""
import pytest
import torch
import transformers as T
from peft import LoraConfig, get_peft_model


from .helpers import compile_lora, per_adapter_reference

ROWS = ["a", None, "b"]
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
SMALL = dict(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4)

FAMILIES = {
    "falcon": (lambda: T.FalconForCausalLM(T.FalconConfig(**SMALL, num_kv_heads=2, new_decoder_architecture=True)),
               ["query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"]),
    "bloom": (lambda: T.BloomForCausalLM(T.BloomConfig(vocab_size=128, hidden_size=32, n_layer=2, n_head=4)),
              ["query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"]),
    "opt": (lambda: T.OPTForCausalLM(T.OPTConfig(**SMALL, ffn_dim=64, word_embed_proj_dim=32,
                                                 max_position_embeddings=64)),
            ["q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"]),
    "mixtral": (lambda: T.MixtralForCausalLM(T.MixtralConfig(**SMALL, intermediate_size=64, num_local_experts=4,
                                                             num_experts_per_tok=2, num_key_value_heads=2)),
                ATTENTION),
    "gemma2": (lambda: T.Gemma2ForCausalLM(T.Gemma2Config(**SMALL, intermediate_size=64, num_key_value_heads=2,
                                                          head_dim=8, sliding_window=4)),
               ATTENTION + ["gate_proj", "up_proj", "down_proj"]),
}


def _peft(family):
    make, targets = FAMILIES[family]
    torch.manual_seed(0)
    model = get_peft_model(make().eval(), LoraConfig(r=4, lora_alpha=8, target_modules=targets,
                                                      init_lora_weights=False), adapter_name="a")
    model.add_adapter("b", LoraConfig(r=8, lora_alpha=4, target_modules=targets, init_lora_weights=False))
    return model.eval()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_mixed_batch_of_a_family_matches_peft(family, device, inner):
    torch._dynamo.reset()
    model = _peft(family)
    lora_layers = sum(1 for m in model.modules() if hasattr(m, "lora_A") and "a" in m.lora_A)
    batches = [torch.randint(3, 128, (len(ROWS), n), generator=torch.Generator().manual_seed(n)) for n in (5, 9)]
    references = [per_adapter_reference(model, ROWS, lambda m, ids=ids: m(input_ids=ids).logits) for ids in batches]
    meta, backend, compiled = compile_lora(model, device, 64, inner=inner)
    for ids, want in zip(batches, references):
        meta.set_request_adapters(ROWS)
        with torch.no_grad():
            got = compiled(input_ids=ids.to(device)).logits.cpu()
        assert (got - want).abs().max().item() < 1e-4, ids.shape
    for graph in backend.graphs:
        assert graph.report.near_misses == [] and not graph.leftovers, graph.report.format()
    # Every LoRA layer rewritten (in one graph, or in the graphs a graph break splits the model into).
    rewritten = {s.site for g in backend.graphs for s in g.report.sites}
    assert len(rewritten) == lora_layers == len(meta.sites)
    model.cpu()
    torch._dynamo.reset()
