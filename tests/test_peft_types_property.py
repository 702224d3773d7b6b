"""Issue 28: LoHa and LoKr adapters beside LoRA ones in one ``PeftMixedModel``, drawn: ``register_adapters``
refuses the model naming every adapter of another type that ``exclude=`` leaves out; with all of them excluded
(and inactive), every LoRA row equals PEFT run on that adapter and every base row the base model.

Per example: 2-4 adapters, each LoRA (targets among TinyLM's embedding, q, v and up) or LoHa / LoKr (q, v, up),
added in turn, rank and alpha drawn, half of them LoRA, another type and LoRA on one module first (PEFT nests
their layers: ``chat(hada(sql(Linear)))``, one site); the active LoRA adapter, sometimes with an excluded one
active too (refused at registration, by name); ``exclude`` all or some of the other adapters; two mappings of
LoRA adapters and the base model over the rows, compiled once per example (CPU, ``aot_eager``), 1e-4.  Three
explicit examples (``SANDWICH``) hold the nested, excluded-but-active and not-excluded cases whatever is drawn.
The fixed cases: tests/test_unsupported_peft_types.py.
"""
from __future__ import annotations

import copy
import re

import pytest
import torch
from hypothesis import event, example, given, settings
from hypothesis import strategies as st
from peft import LoHaConfig, LoKrConfig, LoraConfig, PeftMixedModel

import xla_lora_pass as xlp
from xla_lora_pass import UnsupportedAdapterError

from .models import TinyLM
from .property_support import SETTINGS, assert_exact, compile_served, one_thread  # noqa: F401 (a fixture)

pytestmark = pytest.mark.compat  # PEFT's tuner types and how a mixed model nests them change between releases

EXAMPLES = 45
NAMES = ("sql", "chat", "code", "math")
OTHER = {"loha": "LOHA", "lokr": "LOKR"}
MODULES = ("embed", "q", "v", "up")  # TinyLM's; the other types on the linears


@st.composite
def mixed_types(draw):
    n = draw(st.integers(2, 4))
    kinds = [draw(st.sampled_from(["lora", "lora", "loha", "lokr"])) for _ in range(n)]
    if "lora" not in kinds:
        kinds[draw(st.integers(0, n - 1))] = "lora"
    if set(kinds) == {"lora"}:
        kinds[draw(st.integers(0, n - 1))] = draw(st.sampled_from(sorted(OTHER)))
    # Half the examples: LoRA, another type, LoRA on one module, which PEFT nests as lora(other(lora(Linear))).
    sandwich = n >= 3 and draw(st.booleans())
    if sandwich:
        kinds[:3] = ["lora", draw(st.sampled_from(sorted(OTHER))), "lora"]
    # Few modules, so that adapters share them: a LoRA layer, another tuner's around it, a LoRA layer around that.
    adapters = [dict(name=name, kind=kind, r=draw(st.integers(1, 4)), alpha=draw(st.sampled_from([1, 2, 8])),
                     targets=draw(st.lists(st.sampled_from(MODULES if kind == "lora" else MODULES[1:]), min_size=1,
                                           max_size=3, unique=True)))
                for name, kind in zip(NAMES, kinds)]
    if sandwich:
        shared = draw(st.sampled_from(MODULES[1:]))
        for a in adapters[:3]:
            a["targets"] = list(dict.fromkeys(a["targets"] + [shared]))
    lora = [a["name"] for a in adapters if a["kind"] == "lora"]
    others = [a["name"] for a in adapters if a["kind"] != "lora"]
    # Two in three examples exclude every other adapter (they compile and serve); the rest leave some out.
    exclude = others if draw(st.integers(0, 2)) else draw(st.lists(st.sampled_from(others), unique=True))
    rows = draw(st.integers(1, 4))
    entries = st.sampled_from(lora + [None])
    return dict(adapters=adapters, exclude=exclude, active=draw(st.sampled_from(lora)),
                also_active=draw(st.sampled_from(others)) if draw(st.integers(0, 3)) == 0 else None,
                mappings=[draw(st.lists(entries, min_size=rows, max_size=rows)) for _ in range(2)],
                seq=draw(st.integers(1, 5)), kernel=draw(st.sampled_from(["auto", "masked"])),
                seed=draw(st.integers(0, 2 ** 16)))


def _config(spec):
    if spec["kind"] == "lora":
        return LoraConfig(r=spec["r"], lora_alpha=spec["alpha"], target_modules=spec["targets"],
                          init_lora_weights=False)
    make = LoHaConfig if spec["kind"] == "loha" else LoKrConfig
    return make(r=spec["r"], alpha=spec["alpha"], target_modules=spec["targets"], init_weights=False)


def mixed_model(case):
    """(the PeftMixedModel, the base TinyLM as it was before PEFT wrapped it)."""
    torch.manual_seed(case["seed"])
    base = TinyLM().eval()
    reference = copy.deepcopy(base)
    first, *rest = case["adapters"]
    model = PeftMixedModel(base, _config(first), first["name"])
    for spec in rest:
        model.add_adapter(spec["name"], _config(spec))
    model.set_adapter([case["active"]] + ([case["also_active"]] if case["also_active"] else []))
    return model.eval(), reference


def _chains(model) -> bool:
    """Whether a LoRA layer holds another tuner's layer holding a LoRA layer (one module, read as one site)."""
    from peft.tuners.lora import LoraLayer

    for module in model.modules():
        kinds, layer = "", module
        while hasattr(layer, "base_layer"):
            kinds, layer = kinds + ("L" if isinstance(layer, LoraLayer) else "o"), layer.base_layer
        if re.search("L.*o.*L", kinds):
            return True
    return False


def _eager_rows(model, base, ids, rows):
    """Row i of PEFT run on adapter rows[i] alone, or of the base model for None."""
    outs = []
    with torch.no_grad():
        for i, r in enumerate(rows):
            if r is None:
                outs.append(base(ids[i:i + 1]))
            else:
                model.set_adapter([r])
                outs.append(model(ids[i:i + 1]))
    return tuple(torch.cat(parts) for parts in zip(*outs))


def _adapter(name, kind, targets):
    return dict(name=name, kind=kind, r=2, alpha=4, targets=targets)


# Drawn or not: lora(loha(lora(Linear))) at q, served with the LoHa adapter excluded, and refused with it active.
SANDWICH = dict(adapters=[_adapter("sql", "lora", ["q", "v"]), _adapter("chat", "loha", ["q", "up"]),
                          _adapter("code", "lora", ["q", "up", "embed"]), _adapter("math", "lokr", ["v"])],
                exclude=["chat", "math"], active="sql", also_active=None, seq=3, kernel="auto", seed=3,
                mappings=[["sql", None, "code"], ["code", "code", "sql"]])


@settings(max_examples=EXAMPLES, **SETTINGS)
@given(mixed_types())
@example(SANDWICH)
@example(dict(SANDWICH, active="code", also_active="math"))
@example(dict(SANDWICH, exclude=["math"]))
def test_mixed_peft_types_refused_or_served(case):
    model, base = mixed_model(case)
    kinds = {a["name"]: a["kind"] for a in case["adapters"]}
    left = [n for n, k in kinds.items() if k != "lora" and n not in case["exclude"]]
    meta = xlp.LoRAMetadata(max_num_tokens=64)
    if left:
        event("refused: another type not excluded")
        with pytest.raises(UnsupportedAdapterError) as caught:
            meta.register_adapters(model, exclude=case["exclude"])
        for name in left:
            assert re.search(rf"adapter '{name}' is of type {OTHER[kinds[name]]}", str(caught.value)), caught.value
        assert meta.slots == [] and dict(meta.sites) == {}  # a refused call changes nothing
        return
    if case["also_active"]:
        event("refused: an excluded adapter is active")
        name = case["also_active"]
        with pytest.raises(UnsupportedAdapterError, match=rf"'{name}' \({OTHER[kinds[name]]}\) is excluded but active"):
            meta.register_adapters(model, exclude=case["exclude"])
        return
    event(f"served: {len(case['exclude'])} excluded, {len(kinds) - len(case['exclude'])} LoRA"
          + (", LoRA layers around another tuner's" if _chains(model) else ""))
    lora = [n for n, k in kinds.items() if k == "lora"]
    assert meta.register_adapters(model, exclude=case["exclude"]) == lora  # no slot for another type
    gen = torch.Generator().manual_seed(case["seed"])
    batches = [torch.randint(0, 32, (len(rows), case["seq"]), generator=gen) for rows in case["mappings"]]
    wanted = [_eager_rows(model, base, ids, rows) for ids, rows in zip(batches, case["mappings"])]
    model.set_adapter([case["active"]])  # as registered
    compiled = compile_served(model, meta, case["kernel"])
    for rows, ids, want in zip(case["mappings"], batches, wanted):
        meta.set_request_adapters(rows)
        with torch.no_grad():
            got = compiled(ids)
        assert_exact(got, want, f"rows {rows}")
    assert meta.stats["fallbacks"] == 0
