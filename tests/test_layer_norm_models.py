"""Issue 15: LayerNorm models bucket by default, exact against PEFT eager over a stream of token counts."""
import pytest
import torch
import transformers as T
from peft import LoraConfig, get_peft_model

from .helpers import serve_stream

ROWS = ["sql", "chat", None]
MAX_TOKENS = 64  # buckets 8, 16, 32, 64 for the sequence dim


def _gpt2():
    return T.GPT2LMHeadModel(T.GPT2Config(vocab_size=128, n_embd=32, n_layer=1, n_head=4, n_positions=64)), \
        ["c_attn", "c_proj", "c_fc"], {"fan_in_fan_out": True}


def _opt():
    # fc1/fc2 run on the tokens flattened to [B*S, H] (graph_rewrites/flat_tokens.py)
    return T.OPTForCausalLM(T.OPTConfig(vocab_size=128, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                        ffn_dim=64, max_position_embeddings=64, word_embed_proj_dim=32)), \
        ["q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"], {}


def _gpt_neox():
    return T.GPTNeoXForCausalLM(T.GPTNeoXConfig(vocab_size=128, hidden_size=32, num_hidden_layers=1,
                                                num_attention_heads=4, intermediate_size=64,
                                                max_position_embeddings=64)), \
        ["query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"], {}


def _roberta():
    return T.RobertaForMaskedLM(T.RobertaConfig(vocab_size=128, hidden_size=32, num_hidden_layers=1,
                                                num_attention_heads=4, intermediate_size=64,
                                                max_position_embeddings=80)), \
        ["query", "key", "value", "dense"], {}


FAMILIES = {"gpt2": _gpt2, "opt": _opt, "gpt_neox": _gpt_neox, "roberta": _roberta}


def _peft_model(family):
    torch.manual_seed(0)
    base, targets, kw = FAMILIES[family]()
    model = None
    for name, r in (("sql", 4), ("chat", 8)):
        cfg = LoraConfig(r=r, lora_alpha=2 * r, target_modules=targets, init_lora_weights=False, **kw)
        model = get_peft_model(base.eval(), cfg, adapter_name=name) if model is None else model
        if name not in model.peft_config:
            model.add_adapter(name, cfg)
    model.set_adapter("sql")
    return model.eval()


@pytest.mark.parametrize("family", [pytest.param(f, marks=pytest.mark.compat) if f == "gpt2" else f
                                    for f in FAMILIES])
def test_layer_norm_model_buckets_a_stream_exactly(family, xla_device):
    torch._dynamo.reset()
    model = _peft_model(family)
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(1, 17, (40,), generator=g).tolist()
    batches = []
    for s in lengths:
        batch = {"input_ids": torch.randint(2, 128, (len(ROWS), s), generator=g)}
        if family == "roberta":  # bidirectional: padding must be masked (docs/user-guide.md)
            batch["attention_mask"] = torch.ones_like(batch["input_ids"])
        batches.append(batch)
    # PEFT eager, one run per adapter (OPT's [B*S, H] layers refuse PEFT's own adapter_names)
    worst, meta, backend = serve_stream(model, xla_device, MAX_TOKENS, ROWS, batches)
    assert worst < 1e-4
    assert len(set(lengths)) > len(list(backend.buckets)) + 2  # more sizes than programs allowed
    assert meta.stats["compiles"] <= len(list(backend.buckets)) + 2, meta.stats
    assert meta.stats["fallbacks"] == 0
    assert all(not g.report.near_misses for g in backend.graphs)
