"""Issue 28: tied embeddings, drawn: LoRA on ``embed_tokens`` and/or ``lm_head`` of a tiny Llama with
``tie_word_embeddings=True`` (one base weight, two sites), each call against eager PEFT's mixed batch.

Per example: 1-3 adapters of generated configurations (targets among the tied pair and three linears, at least
one adapter on one of the pair; rank, alpha, rsLoRA, LoRA bias on linears; on a PEFT that has it,
``ensure_weight_tying``, which gives ``lm_head`` the embedding's adapter), the active adapter, the kernel, and three
mappings of one adapter (or the base model) per row.  The model is compiled once per example (CPU,
``aot_eager``); 1e-4.  The pass alone on TinyLM's tied pair and its near miss: tests/test_tied_weights.py; on XLA:
tests/test_heads_and_target_modules.py::test_tied_embeddings_retied_on_the_device.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st
from peft import LoraConfig, get_peft_model

import xla_lora_pass as xlp
from xla_lora_pass.demo_models import tiny_llama_config

from .models import per_row_eager
from .property_support import SETTINGS, assert_exact, compile_served, one_thread  # noqa: F401 (a fixture)
from .test_peft_configs_property import NAMES

pytestmark = [pytest.mark.compat,  # how PEFT wraps a tied pair (ensure_weight_tying on the newest) changes
              # PEFT warns that LoRA on a tied module complicates merging (every example does it on purpose)
              pytest.mark.filterwarnings("ignore:Model (with|has) `tie_word_embeddings=True`:UserWarning")]

EXAMPLES = 20  # a Llama takes Dynamo ~1.3 s to trace here: three mappings per compile
VOCAB = 64
TIED = ("embed_tokens", "lm_head")
LINEARS = ("lm_head", "q_proj", "v_proj", "down_proj")
# PEFT releases with LoraConfig(ensure_weight_tying=...) (0.18 on): LoRA on embed_tokens is given to lm_head too.
HAS_TYING = "ensure_weight_tying" in {f.name for f in dataclasses.fields(LoraConfig)}


@st.composite
def tied_adapter(draw, name, pair=()):
    """An adapter's configuration; ``pair``: the tied modules it targets for sure."""
    lora_bias = "embed_tokens" not in pair and draw(st.booleans())  # PEFT has no LoRA bias for an embedding
    targets = draw(st.lists(st.sampled_from(LINEARS if lora_bias else TIED + LINEARS[1:]), max_size=3, unique=True))
    targets = list(pair) + [t for t in targets if t not in pair] or ["q_proj"]
    return dict(name=name, targets=targets, r=draw(st.integers(1, 4)), alpha=draw(st.sampled_from([1, 2, 8])),
                use_rslora=draw(st.booleans()), lora_bias=lora_bias,
                tying=HAS_TYING and "embed_tokens" in targets and draw(st.booleans()))


@st.composite
def tied_setup(draw):
    n = draw(st.integers(1, 3))
    pair = draw(st.sampled_from([("embed_tokens",), ("lm_head",), TIED]))  # the first adapter's, at least
    adapters = [draw(tied_adapter(name, pair if name == NAMES[0] else ())) for name in NAMES[:n]]
    rows = draw(st.integers(1, 4))
    entries = st.sampled_from(list(NAMES[:n]) + [None])
    return dict(adapters=adapters, active=draw(st.sampled_from(NAMES[:n])), seq=draw(st.integers(1, 5)),
                mappings=[draw(st.lists(entries, min_size=rows, max_size=rows)) for _ in range(3)],
                kernel=draw(st.sampled_from(["auto", "masked"])), seed=draw(st.integers(0, 2 ** 16)))


def tied_llama(adapters, active, seed):
    """A one-layer Llama whose lm_head reads the embedding's weight, with PEFT LoRA adapters of random weights."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    config = tiny_llama_config(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                               tie_word_embeddings=True)
    model = LlamaForCausalLM(config).eval()
    for spec in adapters:
        extra = dict(ensure_weight_tying=True) if spec["tying"] else {}
        cfg = LoraConfig(r=spec["r"], lora_alpha=spec["alpha"], target_modules=list(spec["targets"]),
                         use_rslora=spec["use_rslora"], lora_bias=spec["lora_bias"], init_lora_weights=False, **extra)
        if isinstance(model, LlamaForCausalLM):
            model = get_peft_model(model, cfg, adapter_name=spec["name"])
        else:
            model.add_adapter(spec["name"], cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name or "lora_embedding_B" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.set_adapter(active)
    return model.eval()


@settings(max_examples=EXAMPLES, **SETTINGS)
@given(tied_setup())
def test_tied_embeddings_against_eager_peft(case):
    model = tied_llama(case["adapters"], case["active"], case["seed"])
    lm = model.base_model.model
    embed, head = lm.model.embed_tokens, lm.lm_head
    assert getattr(head, "base_layer", head).weight is getattr(embed, "base_layer", embed).weight  # still tied
    meta = xlp.LoRAMetadata(max_num_tokens=64)
    meta.register_adapters(model)
    targeted = {t for a in case["adapters"] for t in a["targets"]}
    for module, site in ((embed, "base_model.model.model.embed_tokens"), (head, "base_model.model.lm_head")):
        assert (site in meta.sites) == hasattr(module, "base_layer"), (site, sorted(meta.sites))
    event(f"LoRA on {' and '.join(t for t in TIED if t in targeted) or 'neither'} of the tied pair"
          + (", ensure_weight_tying" if any(a["tying"] for a in case["adapters"]) else ""))
    compiled = compile_served(model, meta, case["kernel"])
    gen = torch.Generator().manual_seed(case["seed"])
    for rows in case["mappings"]:
        meta.set_request_adapters(rows)
        ids = torch.randint(0, VOCAB, (len(rows), case["seq"]), generator=gen)
        with torch.no_grad():
            got = compiled(ids)
        assert_exact(got, per_row_eager(model, ids, rows), f"rows {rows}")
    assert meta.stats["fallbacks"] == 0
