"""The newest torch without torch_xla (.ci/run's third job; it runs on torch 2.9 too): a model family the rest of
the suite does not use, a tiny PEFT Qwen2 (random weights from a config, nothing downloaded; LoRA on every linear
of its decoder and on embed_tokens, 3 adapters, fp32), served on the CPU with inductor, the backend's default
there, against PEFT's own mixed batch in eager."""
import pytest
import torch

import xla_lora_pass as xlp

ADAPTERS = (("sql", 4, 8), ("chat", 8, 16), ("code", 2, 2))  # (name, rank, alpha): every scaling differs
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "embed_tokens"]
LAYERS, VOCAB = 2, 128
# (rows, sequence length): every row its own adapter or the base model, over 4 lengths in 2 buckets (8, 16).
CALLS = [(["sql", "chat", "code", None], 5), (["chat", None, "sql", "code"], 8),
         (["code", "sql", None, "chat"], 11), ([None, "code", "chat", "sql"], 16)]
REMAP = ["sql", "sql", "code", "chat"]


def _names(rows):
    return ["__base__" if r is None else r for r in rows]


def tiny_peft_qwen2():
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=False)
    model = None
    for name, rank, alpha in ADAPTERS:
        cfg = LoraConfig(r=rank, lora_alpha=alpha, target_modules=TARGETS, init_lora_weights=False)
        if model is None:
            model = get_peft_model(Qwen2ForCausalLM(config).eval(), cfg, adapter_name=name)
        else:
            model.add_adapter(name, cfg)
    model.set_adapter(ADAPTERS[0][0])
    return model.float().eval()


def _eager(model, ids, rows):
    with torch.no_grad():
        return model(input_ids=ids, adapter_names=_names(rows)).logits


@pytest.fixture(scope="module")
def served():
    torch._dynamo.reset()
    model = tiny_peft_qwen2()
    ids = torch.randint(0, VOCAB, (4, 32), generator=torch.Generator().manual_seed(1))
    meta = xlp.LoRAMetadata(max_num_tokens=256)
    meta.register_adapters(model)
    backend = xlp.make_backend(meta, inner="inductor")
    return dict(model=model, ids=ids, meta=meta, backend=backend, compiled=torch.compile(model, backend=backend))


def _check(s, ids, rows):
    s["meta"].set_request_adapters(rows)
    with torch.no_grad():
        got = s["compiled"](input_ids=ids).logits
    torch.testing.assert_close(got, _eager(s["model"], ids, rows), rtol=0, atol=1e-4)


def test_mixed_rows_at_four_lengths_are_exact_and_every_lora_layer_is_rewritten(served):
    s = served
    for rows, n in CALLS:
        _check(s, s["ids"][:, :n].contiguous(), rows)
    lora_layers = sum(1 for m in s["model"].modules() if hasattr(m, "lora_A") and m.lora_A)
    embeddings = sum(1 for m in s["model"].modules() if hasattr(m, "lora_embedding_A") and m.lora_embedding_A)
    assert (lora_layers, embeddings) == (7 * LAYERS, 1)
    # Each Dynamo graph (the first, static trace, then the dynamic one) rewrites every LoRA layer, and the
    # metadata's counter adds them up.
    want = {"lora_linear": lora_layers, "lora_embedding": embeddings}
    graphs = s["backend"].graphs
    assert graphs and all(g.report.counts() == want for g in graphs), [g.report.format() for g in graphs]
    assert s["meta"].stats["rewrites"] == {k: n * len(graphs) for k, n in want.items()}
    # One program per bucket the calls fell in: 8 and 16 for the dynamic graph, and Dynamo's first, static
    # graph compiled for its own length.
    hits = s["meta"].stats["bucket_hits"]
    buckets = {s["backend"].buckets.pad(n) for _, n in CALLS[1:]}
    assert buckets == {8, 16} and len(hits) == len(buckets) + 1, dict(hits)
    assert s["meta"].stats["compiles"] <= len(hits), dict(hits)


def test_a_remap_compiles_nothing(served):
    s = served
    ids = s["ids"][:, :11].contiguous()
    _check(s, ids, CALLS[2][0])
    compiles = s["meta"].stats["compiles"]
    _check(s, ids, REMAP)
    assert s["meta"].stats["compiles"] == compiles


def test_a_strided_input_at_exactly_a_bucket_size(served):
    s = served
    ids = s["ids"][:, ::2]  # [4, 16]: bucket 16 exactly, every other id of a wider tensor
    assert ids.shape[1] == 16 and not ids.is_contiguous()
    _check(s, ids, REMAP)


def test_generate_with_peft_adapter_names_gives_eager_peft_s_tokens():
    torch._dynamo.reset()
    model = tiny_peft_qwen2()
    ids = torch.randint(3, VOCAB, (4, 6), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # one left-padded row
    rows = CALLS[0][0]
    kw = dict(attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0, adapter_names=_names(rows))
    with torch.no_grad():
        want = model.generate(input_ids=ids, **kw)
    meta = xlp.LoRAMetadata(max_num_tokens=256)
    meta.register_adapters(model)
    backend = xlp.make_backend(meta, inner="inductor")
    compiled = torch.compile(model, backend=backend)
    with torch.no_grad():
        got = compiled.generate(input_ids=ids, **kw)
    assert torch.equal(got, want), f"{got}\n{want}"
    assert meta.stats["rewrites"]["lora_linear"] >= 7 * LAYERS  # the prompt step's and the decode step's graphs
    assert sum(meta.stats["bucket_hits"].values()) == kw["max_new_tokens"]  # every step ran a rewritten program
