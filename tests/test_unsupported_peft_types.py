"""Issue 28: a PEFT adapter of a type the package does not serve (LoHa, LoKr, AdaLoRA, IA3, VeRA, OFT, ...) is
refused at ``register_adapters``, naming it, unless excluded; an excluded one never reaches a row.

Found by a new user: a ``PeftMixedModel`` with a LoHa adapter beside LoRA ones gave the LoHa adapter a slot
whose rows got the base model's output, a LoKr-only model registered with a warning only, and AdaLoRA's
``SVDLinear`` was read as a LoRA layer (``AttributeError``).  The mixed model here nests a LoRA layer inside
the LoHa layer inside another LoRA layer (``q``: chat(hada(sql(Linear)))), as PEFT builds it when adapters
of other types are added in turn.  Tiny models from configs, random weights; the backend on the CPU
(``aot_eager``), against PEFT run once per adapter (``set_adapter``) and the base model before PEFT wrapped it.
"""
import copy

import pytest
import torch
from peft import (AdaLoraConfig, IA3Config, LoHaConfig, LoKrConfig, LoraConfig, OFTConfig, PeftMixedModel,
                  VeraConfig, get_peft_model, inject_adapter_in_model)

import xla_lora_pass as xlp
from xla_lora_pass import UnsupportedAdapterError, UnsupportedMappingError
from xla_lora_pass.adapters.formats import format_of

from .models import TinyLM

pytestmark = pytest.mark.compat  # PEFT's tuner types change between releases: run on the newest too
SEQ = 4


def _mixed(active=("sql",), seed=0):
    """(PeftMixedModel with LoRA "sql", LoHa "hada", LoRA "chat"; the base TinyLM as it was before PEFT)."""
    torch.manual_seed(seed)
    base = TinyLM().eval()
    reference = copy.deepcopy(base)
    model = PeftMixedModel(base, LoraConfig(r=2, lora_alpha=4, target_modules=["q", "v"],
                                            init_lora_weights=False), "sql")
    model.add_adapter("hada", LoHaConfig(r=2, alpha=4, target_modules=["q", "up"], init_weights=False))
    model.add_adapter("chat", LoraConfig(r=4, lora_alpha=8, target_modules=["q", "up", "embed"],
                                         init_lora_weights=False))
    model.set_adapter(list(active))
    return model.eval(), reference


def _ids(rows, seed=0):
    return torch.randint(0, 32, (len(rows), SEQ), generator=torch.Generator().manual_seed(seed))


def _eager_rows(model, base, ids, rows):
    """Row i of PEFT run alone on adapter rows[i], or of the base model for None."""
    active = list(model.active_adapters)
    outs = []
    with torch.no_grad():
        for i, r in enumerate(rows):
            if r is None:
                outs.append(base(ids[i:i + 1]))
            else:
                model.set_adapter([r])
                outs.append(model(ids[i:i + 1]))
    model.set_adapter(active)
    return tuple(torch.cat(parts) for parts in zip(*outs))


def _compiled(model, exclude=()):
    torch._dynamo.reset()
    meta = xlp.LoRAMetadata(max_num_tokens=64)
    slots = meta.register_adapters(model, exclude=exclude)
    return meta, slots, torch.compile(model, backend=xlp.make_backend(meta, inner="aot_eager"))


def test_mixed_model_with_a_loha_adapter_is_refused_naming_it():
    model, _ = _mixed()
    meta = xlp.LoRAMetadata(max_num_tokens=64)
    with pytest.raises(UnsupportedAdapterError, match=r"adapter 'hada' is of type LOHA .*exclude=\['hada'\]"):
        meta.register_adapters(model)
    assert meta.slots == [] and dict(meta.sites) == {}  # a refused call changes nothing


@pytest.mark.parametrize("active", ["sql", "chat"])  # the inner LoRA layer of q, or the outer one
def test_mixed_model_with_the_loha_adapter_excluded_serves_lora_rows_exactly(active):
    model, base = _mixed(active=(active,))
    rows = ["sql", None, "chat", "sql", None]
    ids = _ids(rows)
    want = _eager_rows(model, base, ids, rows)
    meta, slots, compiled = _compiled(model, exclude=["hada"])
    assert slots == ["sql", "chat"]  # no slot for the LoHa adapter
    assert "base_model.model.q" in meta.sites and set(meta.sites["base_model.model.q"].adapters) == {"sql", "chat"}
    meta.set_request_adapters(rows)
    with torch.no_grad():
        got = compiled(ids)
    for g, w in zip(got, want):
        assert (g - w).abs().max().item() < 1e-4
    meta.set_request_adapters([None] * len(rows))  # base rows against the base model itself
    with torch.no_grad():
        got = compiled(ids)
        plain = base(ids)
    for g, w in zip(got, plain):
        assert (g - w).abs().max().item() < 1e-4


def test_an_excluded_adapter_that_is_active_is_refused_at_registration():
    model, _ = _mixed(active=("sql", "hada"))
    with pytest.raises(UnsupportedAdapterError, match=r"'hada' \(LOHA\) is excluded but active in layers "
                                                      r".*base_model\.model\.up"):
        xlp.LoRAMetadata(max_num_tokens=64).register_adapters(model, exclude=["hada"])


def test_an_excluded_adapter_made_active_after_registration_is_refused_at_the_call():
    model, _ = _mixed()
    meta, _, compiled = _compiled(model, exclude=["hada"])
    model.set_adapter(["hada"])  # its layers now add it to every row of the traced graph
    ids = _ids([None, "sql"])
    for rows in ([None, "sql"], [None, None]):  # not even the base rows: the LoHa delta would reach them
        meta.set_request_adapters(rows)
        with pytest.raises(UnsupportedMappingError, match=r"adapter 'hada' \(LOHA\), excluded at "
                                                          r"register_adapters"), torch.no_grad():
            compiled(ids)
    torch._dynamo.reset()


def test_lokr_only_model_is_refused():
    model = get_peft_model(TinyLM(), LoKrConfig(r=2, alpha=4, target_modules=["q", "v"], init_weights=False))
    with pytest.raises(UnsupportedAdapterError, match=r"adapter 'default' is of type LOKR"):
        xlp.LoRAMetadata(max_num_tokens=64).register_adapters(model.eval())


def test_adalora_is_refused_and_its_layers_are_not_read_as_lora():
    model = get_peft_model(TinyLM(), AdaLoraConfig(init_r=2, lora_alpha=4, target_modules=["q", "v"],
                                                   total_step=10, init_lora_weights=False))
    svd_linear = model.base_model.model.q
    assert format_of(svd_linear) is None  # it subclasses LoraLayer, but lora_E changes its forward
    with pytest.raises(UnsupportedAdapterError, match=r"adapter 'default' is of type ADALORA"):
        xlp.LoRAMetadata(max_num_tokens=64).register_adapters(model.eval())


@pytest.mark.parametrize("config", [
    IA3Config(target_modules=["q", "v", "up"], feedforward_modules=["up"]),
    VeraConfig(r=4, target_modules=["q", "v"]),
    OFTConfig(r=0, oft_block_size=4, target_modules=["q", "v"]),
    LoHaConfig(r=2, alpha=4, target_modules=["q", "v"]),
], ids=lambda c: str(c.peft_type.value))
def test_other_peft_types_are_refused(config):
    model = get_peft_model(TinyLM(), config, adapter_name="style")
    with pytest.raises(UnsupportedAdapterError, match=rf"adapter 'style' is of type {config.peft_type.value}"):
        xlp.LoRAMetadata(max_num_tokens=64).register_adapters(model.eval())


def test_layers_of_another_tuner_are_refused_without_a_peft_config():
    """A type is known by its layers too, so a model whose ``peft_config`` is gone or says nothing of an adapter
    is refused by the tuner layers it holds."""
    model = inject_adapter_in_model(LoHaConfig(r=2, alpha=4, target_modules=["q"]), TinyLM(), adapter_name="x")
    del model.peft_config  # only the layers tell the type now
    with pytest.raises(UnsupportedAdapterError, match=r"adapter 'x' is of type LOHA \(layers q\)"):
        xlp.LoRAMetadata(max_num_tokens=64).register_adapters(model.eval())


def test_exclude_names_only_adapters_of_the_model_the_package_does_not_serve():
    model, _ = _mixed()
    meta = xlp.LoRAMetadata(max_num_tokens=64)
    assert meta.register_adapters(model, exclude=["hada"]) == ["sql", "chat"]
    with pytest.raises(TypeError, match=r"exclude must be a list of adapter names, got the str 'hada'"):
        meta.register_adapters(model, exclude="hada")
    with pytest.raises(ValueError, match=r"exclude: 'hadaa' is not an adapter of this model"):
        meta.register_adapters(model, exclude=["hadaa"])
    with pytest.raises(ValueError, match=r"exclude: 'chat' is a LoRA adapter, which register_adapters serves"):
        meta.register_adapters(model, exclude=["hada", "chat"])
    assert meta.slots == ["sql", "chat"]  # the refused calls changed nothing
    with pytest.raises(ValueError, match=r"'hada' names an adapter excluded at register_adapters"):
        meta.load_adapter("hada", {"base_model.model.v.lora_A.weight": torch.zeros(2, 16),
                                   "base_model.model.v.lora_B.weight": torch.zeros(16, 2)})
    assert meta.slots == ["sql", "chat"]


def test_a_lora_layer_added_after_registration_is_refused_at_the_call():
    """A LoRA adapter the metadata never read (added on another module after ``register_adapters``) is found in
    the graph by its Dynamo source name (``L['self']._modules['k']._modules['lora_A']._modules['late']...``),
    and its layer is left alone: a mixed mapping is refused, not served with "late" on every row."""
    torch.manual_seed(0)
    model = get_peft_model(TinyLM(), LoraConfig(r=2, lora_alpha=4, target_modules=["q"], init_lora_weights=False),
                           adapter_name="sql").eval()
    meta, _, compiled = _compiled(model)
    model.add_adapter("late", LoraConfig(r=2, lora_alpha=4, target_modules=["k"], init_lora_weights=False))
    model.set_adapter("late")
    meta.set_request_adapters(["sql", None])
    with pytest.raises(UnsupportedMappingError, match=r"base_model\.model\.k \([^)]*'late'\): a LoRA weight this "
                                                      r"LoRAMetadata does not know"), torch.no_grad():
        compiled(_ids([None, None]))
    torch._dynamo.reset()


def test_lora_on_a_parameter_is_refused_by_name_and_can_be_excluded():
    """PEFT's ``target_parameters`` (``ParamWrapper``: ``W + B A`` before the module's forward; what
    ``"all-linear"`` puts on transformers 5's Mixtral router and fused experts).  Before, it was read as a
    linear LoRA site: the rewrite left it alone and a mixed batch was refused with "the request mapping has 3
    rows but this call has a batch of 4" (the identity matrix PEFT builds its delta from)."""
    torch.manual_seed(0)
    base = TinyLM().eval()
    model = get_peft_model(base, LoraConfig(r=2, lora_alpha=4, target_modules=["q"], init_lora_weights=False),
                           adapter_name="sql")
    model.add_adapter("param", LoraConfig(r=2, lora_alpha=4, target_modules=[], target_parameters=["k.weight"],
                                          init_lora_weights=False))
    model.set_adapter("sql")
    model.eval()
    with pytest.raises(UnsupportedAdapterError, match=r"adapter 'param' is of type LoRA on a parameter "
                                                      r"\(ParamWrapper over 'weight'.*layers base_model\.model\.k"):
        xlp.LoRAMetadata(max_num_tokens=64).register_adapters(model)
    meta = xlp.LoRAMetadata(max_num_tokens=64)
    assert meta.register_adapters(model, exclude=["param"]) == ["sql"]
    assert sorted(meta.sites) == ["base_model.model.q"]
    rows = ["sql", None]
    ids = _ids(rows)
    with torch.no_grad():
        want_sql = model(ids[:1])
        with model.disable_adapter():
            want_base = model(ids[1:])
    compiled = torch.compile(model, backend=xlp.make_backend(meta, inner="aot_eager"))
    meta.set_request_adapters(rows)
    with torch.no_grad():
        got = compiled(ids)
    for g, a, b in zip(got, want_sql, want_base):
        assert (g - torch.cat([a, b])).abs().max().item() < 1e-4
    torch._dynamo.reset()
