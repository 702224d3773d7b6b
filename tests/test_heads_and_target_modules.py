"""Mixed batches for other target modules, saved heads (modules_to_save) and sequence-classification
heads: exact against PEFT to 1e-4 (fp32), no compile on remap (XLA's own count on XLA; off XLA, on the CPU with
aot_eager, the backend's).

Rows [sql, chat, code, base]; each model built from a tiny config with random weights.
"""
import pytest
import torch
from peft import LoraConfig, get_peft_model

import xla_lora_pass as xlp
from xla_lora_pass.demo_models import per_sequence_mapping, tiny_llama_config

from .helpers import compile_lora
from .models import per_row_eager
from .xla_utils import device_compiles

ROWS = ["sql", "chat", "code", None]
ROTATED = ["code", None, "sql", "chat"]
SEQ = 6
LLAMA_ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _peft(model, adapters, **common):
    """``adapters``: (name, targets, r, alpha, extra LoraConfig kwargs); every saved copy made distinct."""
    peft_model = None
    for name, targets, r, alpha, extra in adapters:
        cfg = LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, init_lora_weights=False, **common, **extra)
        peft_model = get_peft_model(model, cfg, adapter_name=name) if peft_model is None else peft_model
        if name not in peft_model.peft_config:
            peft_model.add_adapter(name, cfg)
    with torch.no_grad():
        for pname, p in peft_model.named_parameters():
            if ".modules_to_save." in pname:
                p.add_(torch.randn_like(p) * 0.5)
    peft_model.set_adapter(adapters[0][0])
    return peft_model.eval()


def _ids(vocab=128, rows=len(ROWS)):
    return torch.randint(3, vocab, (rows, SEQ), generator=torch.Generator().manual_seed(0))


def _serve(model, device, inner, rows_list, call, refs):
    """Compile, run each rows mapping, check against its reference; return (meta, compiles on the remaps,
    backend)."""
    meta, backend, compiled = compile_lora(model, device, 256, inner=inner)
    remap_compiles = []
    for i, rows in enumerate(rows_list):
        meta.set_token_adapters(per_sequence_mapping(rows, SEQ))
        before = device_compiles(device, meta)
        with torch.no_grad():
            out = call(compiled).cpu()
        if i:
            remap_compiles.append(device_compiles(device, meta) - before)
        diff = (out - refs[i]).abs().max().item()
        assert diff < 1e-4, (rows, diff)
    model.cpu()
    torch._dynamo.reset()
    return meta, remap_compiles, backend


def test_adapters_on_different_target_modules(device, inner):
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = _peft(LlamaForCausalLM(tiny_llama_config()), [
        ("sql", ["q_proj", "v_proj"], 4, 8, {}),
        ("chat", LLAMA_ALL, 8, 16, {}),
        ("code", ["gate_proj", "up_proj", "embed_tokens"], 2, 2, {"use_rslora": True})])
    ids = _ids()
    refs = [per_row_eager(model, ids, rows).logits for rows in (ROWS, ROTATED)]
    meta, remaps, _ = _serve(model, device, inner, [ROWS, ROTATED], lambda m: m(input_ids=ids.to(device)).logits, refs)
    assert len(meta.sites) == 2 * 7 + 1
    rewrites = meta.stats["rewrites"]
    assert rewrites["lora_linear"] + rewrites["lora_attach"] == 2 * 7 + 1  # every site, whatever is active
    assert rewrites["lora_attach"] > 0
    assert remaps == [0]


def test_modules_to_save_lm_head_and_embed_tokens(device, inner):
    from transformers import LlamaForCausalLM

    torch.manual_seed(1)
    saved = {"modules_to_save": ["lm_head", "embed_tokens"]}
    model = _peft(LlamaForCausalLM(tiny_llama_config()), [
        ("sql", ["q_proj"], 4, 8, saved), ("chat", ["v_proj"], 8, 16, saved), ("code", ["q_proj"], 2, 2, saved)])
    ids = _ids()
    refs = [per_row_eager(model, ids, rows).logits for rows in (ROWS, ROTATED)]
    meta, remaps, _ = _serve(model, device, inner, [ROWS, ROTATED], lambda m: m(input_ids=ids.to(device)).logits, refs)
    assert meta.stats["rewrites"]["saved_module"] == 2
    assert remaps == [0]


def test_saved_lm_head_of_tied_embeddings(device, inner):
    """The original lm_head's weight is embed_tokens' (tie_word_embeddings), so the embedding's read of it
    is no read of the saved lm_head. Before: that read made the graph, which runs the active adapter's copy,
    count as running the base model: the base mapping was served with sql's head (2.9 off eager), every
    other refused. ``code`` has no copy (the original serves it, as in PEFT)."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(4)
    saved = {"modules_to_save": ["lm_head"]}
    model = _peft(LlamaForCausalLM(tiny_llama_config(tie_word_embeddings=True)), [
        ("sql", ["q_proj"], 4, 8, saved), ("chat", ["v_proj"], 8, 16, saved), ("code", ["q_proj"], 2, 2, {})])
    ids = _ids()
    rows = [[None] * 4, ROWS, ROTATED]
    refs = [per_row_eager(model, ids, r).logits for r in rows]
    meta, remaps, _ = _serve(model, device, inner, rows, lambda m: m(input_ids=ids.to(device)).logits, refs)
    assert meta.stats["rewrites"]["saved_module"] == 1
    assert remaps == [0, 0]


def test_roberta_sequence_classification_head(device, inner):
    """SEQ_CLS saves RoBERTa's whole classifier (dense -> tanh -> out_proj on the first token) per adapter."""
    from transformers import RobertaConfig, RobertaForSequenceClassification

    torch.manual_seed(2)
    cfg = RobertaConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=64, num_labels=3)
    model = _peft(RobertaForSequenceClassification(cfg), [
        ("sql", ["query", "value"], 4, 8, {}), ("chat", ["query", "key", "dense"], 8, 16, {}),
        ("code", ["value"], 2, 2, {})], task_type="SEQ_CLS")
    ids = _ids()
    refs = [per_row_eager(model, ids, rows).logits for rows in (ROWS, ROTATED)]
    meta, remaps, _ = _serve(model, device, inner, [ROWS, ROTATED], lambda m: m(input_ids=ids.to(device)).logits, refs)
    assert "base_model.model.classifier" in meta.saved_modules
    assert meta.stats["rewrites"]["saved_module"] == 1
    assert remaps == [0]


def test_bert_sequence_classification_pooler_and_classifier(device, inner):
    """BERT pools ``hidden[:, 0]`` through a dense layer and tanh before its saved classifier: both heads
    read the selection's rows (graph_rewrites/passes/row_selections.py; refused as "neither the graph's token
    layout ..." before)."""
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(2)
    cfg = BertConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=64, max_position_embeddings=64, num_labels=3)
    model = _peft(BertForSequenceClassification(cfg), [
        ("sql", ["query", "value"], 4, 8, {}), ("chat", ["query", "dense"], 8, 16, {}),
        ("code", ["value"], 2, 2, {})], task_type="SEQ_CLS")
    ids = _ids()
    refs = [per_row_eager(model, ids, rows).logits for rows in (ROWS, ROTATED)]
    meta, remaps, _ = _serve(model, device, inner, [ROWS, ROTATED], lambda m: m(input_ids=ids.to(device)).logits, refs)
    assert "base_model.model.classifier" in meta.saved_modules
    # 2 layers x (query, value, 3 dense) + the pooler's dense (as lora_linear or lora_attach), and the classifier
    rewrites = dict(meta.stats["rewrites"])
    assert rewrites.pop("saved_module") == 1 and sum(rewrites.values()) == 11, rewrites
    assert remaps == [0]


def test_llama_sequence_classification_score(device, inner):
    """Llama's ``score`` runs on every token before HF pools the last non-pad one: served per token."""
    from transformers import LlamaForSequenceClassification

    torch.manual_seed(3)
    model = _peft(LlamaForSequenceClassification(tiny_llama_config(num_labels=3, pad_token_id=0)), [
        ("sql", ["q_proj", "v_proj"], 4, 8, {}), ("chat", ["k_proj"], 8, 16, {}), ("code", ["v_proj"], 2, 2, {})],
        task_type="SEQ_CLS")
    ids = _ids()
    refs = [per_row_eager(model, ids, rows).logits for rows in (ROWS, ROTATED)]
    meta, remaps, _ = _serve(model, device, inner, [ROWS, ROTATED], lambda m: m(input_ids=ids.to(device)).logits, refs)
    assert "base_model.model.score" in meta.saved_modules
    assert remaps == [0]


def test_pooled_head_refuses_a_row_with_two_adapters():
    from transformers import RobertaConfig, RobertaForSequenceClassification

    torch.manual_seed(2)
    cfg = RobertaConfig(vocab_size=128, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=64, num_labels=3)
    model = _peft(RobertaForSequenceClassification(cfg), [("sql", ["query"], 4, 8, {}), ("chat", ["value"], 2, 4, {})],
                  task_type="SEQ_CLS")
    meta = xlp.LoRAMetadata(max_num_tokens=64)
    meta.register_adapters(model)
    compiled = torch.compile(model, backend=xlp.make_backend(meta, inner="aot_eager"))
    ids = _ids(rows=2)
    meta.set_token_adapters(["sql", "chat"] * SEQ)
    with pytest.raises(xlp.UnsupportedMappingError, match="pools each row to one output"):
        with torch.no_grad():
            compiled(input_ids=ids)
    torch._dynamo.reset()


@pytest.mark.compat
def test_tied_embeddings_retied_on_the_device(device, inner):
    """Issue 28: ``.to(xla)`` unties embed_tokens and lm_head, ``tie_weights()`` ties them again (as HF's
    Trainer does), then PEFT puts LoRA on both: one base tensor, two sites, each served at its own op.
    (Tied before PEFT wraps the model, HF's re-tie after ``.to(xla)`` raises on PEFT's layers, so the two
    stay apart there; tests/test_tied_weights.py covers that tie, kept on the CPU.)"""
    from transformers import LlamaForCausalLM

    torch.manual_seed(4)
    base = LlamaForCausalLM(tiny_llama_config(tie_word_embeddings=True)).to(device)
    base.tie_weights()
    model = _peft(base, [("sql", ["q_proj"], 4, 8, {}), ("both", ["embed_tokens", "lm_head", "v_proj"], 8, 16, {}),
                         ("emb", ["embed_tokens"], 2, 4, {}), ("head", ["lm_head"], 4, 2, {})])
    lm = model.base_model.model
    assert lm.lm_head.base_layer.weight is lm.model.embed_tokens.base_layer.weight
    rows_list = [["both", "sql", None, "emb"], ["head", "both", "emb", None]]
    ids = _ids()
    refs = [per_row_eager(model, ids.to(device), rows).logits.cpu() for rows in rows_list]
    meta, remaps, _ = _serve(model, device, inner, rows_list, lambda m: m(input_ids=ids.to(device)).logits, refs)
    assert meta.stats["rewrites"]["lora_attach"] >= 2  # embed_tokens and lm_head: "sql" has neither branch
    assert remaps == [0]


def test_several_active_adapters_serve_the_mapped_one_only(device, inner):
    """PEFT with two adapters active (``set_adapter([...])``) traces both branches where their targets overlap
    and adds both deltas; a row is served its mapped adapter alone, as one eager run per adapter computes it.
    Before: the second branch was left alone and added on top, so every row on ``chat`` got chat's delta twice
    at q_proj (0.02 off) and every other mapping was refused."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(3)
    model = _peft(LlamaForCausalLM(tiny_llama_config()), [
        ("sql", ["q_proj", "v_proj"], 4, 8, {}), ("chat", ["q_proj", "down_proj"], 8, 16, {}),
        ("code", ["q_proj"], 2, 2, {})])
    ids = _ids()
    rows = [["chat", "chat", "chat", "chat"], ROWS, ROTATED]
    refs = [per_row_eager(model, ids, r).logits for r in rows]
    model.base_model.set_adapter(["sql", "chat"])
    meta, _, backend = _serve(model, device, inner, rows, lambda m: m(input_ids=ids.to(device)).logits, refs)
    # 2 layers: q_proj's chat branch removed, sql's rewritten (serving all three); v_proj (sql), down_proj (chat)
    assert meta.stats["rewrites"]["lora_linear"] == 2 * 3
    assert sorted(b for g in backend.graphs for b in g.report.dropped_branches) == [
        (f"base_model.model.model.layers.{i}.self_attn.q_proj", "chat") for i in range(2)]
