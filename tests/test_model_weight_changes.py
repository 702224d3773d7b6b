"""The model's own LoRA tensors changed in place after register_adapters are served (or refused, by name).

PEFT's ``hotswap_adapter`` on the compiled model (same rank; into the padded
ranks and scaling tensors of ``prepare_model_for_compiled_hotswap``), a
``no_grad`` copy into an inactive adapter, a change while the pool holds the
adapter out of its slot; every result against PEFT run the same way.
"""
import copy

import pytest
import torch

import xla_lora_pass as xlp
from xla_lora_pass.demo_models import eager_reference, tiny_peft_llama

from .xla_utils import device_compiles

ROWS = ["sql", "chat", None]
IDS = torch.randint(0, 128, (3, 8), generator=torch.Generator().manual_seed(1))


def _saved_adapter(tmp_path, name, rank, alpha, seed):
    """A PEFT adapter directory of another model's weights, named ``name`` (the hotswap target)."""
    other, _ = tiny_peft_llama(adapters=((name, rank, alpha),), seed=seed)
    other.save_pretrained(str(tmp_path), selected_adapters=[name])
    return str(tmp_path / name) if name != "default" else str(tmp_path)


def _serve(model, device, inner, rows=ROWS, **meta_kw):
    meta = xlp.LoRAMetadata(max_num_tokens=64, **meta_kw)
    model.to(device)
    meta.register_adapters(model)
    compiled = torch.compile(model, backend=xlp.make_backend(meta, inner=inner))
    meta.set_request_adapters(rows)
    return meta, compiled


def _run(compiled, device, ids=IDS):
    with torch.no_grad():
        return compiled(input_ids=ids.to(device)).logits.cpu()


def _err(got, reference, rows=ROWS):
    return (got - eager_reference(reference, IDS, rows)).abs().max().item()


@pytest.mark.compat
@pytest.mark.parametrize("padded", [False, True], ids=["same_rank", "prepared_for_compiled_hotswap"])
def test_peft_hotswap_on_the_compiled_model_is_served(device, inner, tmp_path, padded):
    from peft.utils.hotswap import hotswap_adapter, prepare_model_for_compiled_hotswap

    model, _ = tiny_peft_llama(adapters=(("sql", 4, 8), ("chat", 4, 8)))
    reference = copy.deepcopy(model)
    if padded:  # scalings become tensors, ranks are padded to 4: a rank-2 adapter of another alpha swaps in
        prepare_model_for_compiled_hotswap(model, target_rank=4)
    first = _saved_adapter(tmp_path / "one", "chat", 2 if padded else 4, 6, seed=7)
    second = _saved_adapter(tmp_path / "two", "chat", 2 if padded else 4, 6, seed=8)
    meta, compiled = _serve(model, device, inner)
    assert _err(_run(compiled, device), reference) < 1e-4
    assert sum(meta.stats["rewrites"].values()) == 4  # q and v of both layers, scaling tensors included
    compiles = meta.stats["compiles"]
    for path in (first, second):
        device_before = device_compiles(device, meta)
        hotswap_adapter(compiled, path, adapter_name="chat", torch_device=str(device))
        hotswap_adapter(reference, path, adapter_name="chat", torch_device="cpu")
        assert _err(_run(compiled, device), reference) < 1e-4
        assert meta.stats["compiles"] == compiles
    # The first swap ran PEFT's own copies on the device (programs of PEFT's, once per shape); the second: none.
    assert device_compiles(device, meta) == device_before
    assert meta.stats["weight_refreshes"] == 2 * 4  # chat at 4 sites, twice


@pytest.mark.compat
def test_inactive_adapter_written_in_place_and_one_out_of_its_slot(device, inner):
    """A no_grad copy into the inactive adapter's weights (load_state_dict does the same), and a change made
    while the pool holds the adapter out of its slot (2 slots, 3 adapters): both served when next used."""
    model, _ = tiny_peft_llama(adapters=(("sql", 4, 8), ("chat", 8, 16), ("code", 2, 2)))
    reference = copy.deepcopy(model)
    meta, compiled = _serve(model, device, inner, rows=["sql", "chat", None], max_slots=3)
    gen = torch.Generator().manual_seed(3)
    lora = [n for n, _ in model.named_parameters() if ".lora_B.chat." in n]
    for name in lora:
        new = torch.randn(model.get_parameter(name).shape, generator=gen)
        with torch.no_grad():
            model.get_parameter(name).copy_(new.to(device))
            reference.get_parameter(name).copy_(new)
    assert _err(_run(compiled, device), reference, ["sql", "chat", None]) < 1e-4
    meta.unload_adapter("code")
    for name in [n for n, _ in model.named_parameters() if ".lora_A.code." in n]:
        new = torch.randn(model.get_parameter(name).shape, generator=gen)
        model.get_parameter(name).data.copy_(new.to(device))  # through .data: no version counter moves
        reference.get_parameter(name).data.copy_(new)
    meta.set_request_adapters(["code", "chat", None])  # brings code back from its kept copy
    assert _err(_run(compiled, device), reference, ["code", "chat", None]) < 1e-4


def test_a_change_the_stacks_cannot_hold_is_refused_by_name_and_nothing_changes(device, inner):
    model, _ = tiny_peft_llama(adapters=(("sql", 4, 8), ("chat", 4, 8)))
    meta, compiled = _serve(model, device, inner)
    _run(compiled, device)
    site = next(s for s in meta.sites if s.endswith("q_proj"))
    before = [t.clone() for t in meta.host_stacks(site)]
    layer = model.get_submodule(site)
    with torch.no_grad():  # rank 16 > the site's stacked rank 4
        torch.utils.swap_tensors(layer.lora_A["chat"].weight, torch.nn.Parameter(torch.ones(16, 32, device=device)))
    with pytest.raises(xlp.UnsupportedAdapterError, match=r"adapter 'chat' at .*q_proj.*register_adapters"):
        _run(compiled, device)
    assert all(torch.equal(a, b) for a, b in zip(before, meta.host_stacks(site)))
    with pytest.raises(xlp.UnsupportedAdapterError):  # refused at every call until the model is put right
        _run(compiled, device)


def test_an_adapter_loaded_over_a_model_adapter_no_longer_follows_the_model(device, inner):
    """load_adapter("chat", state) defines chat by the state: a later change of the model's chat is not served."""
    model, _ = tiny_peft_llama(adapters=(("sql", 4, 8), ("chat", 4, 8)))
    reference = copy.deepcopy(model)
    meta, compiled = _serve(model, device, inner)
    state = {k: v.detach().cpu() for k, v in reference.state_dict().items() if ".chat." in k and "lora_" in k}
    meta.load_adapter("chat", state, scaling=2.0)  # PEFT's own scaling for chat: alpha 8 / rank 4
    for name, p in model.named_parameters():
        if ".lora_B.chat." in name:
            p.data.copy_(torch.zeros_like(p))  # would make chat the base model, if it were followed
    assert _err(_run(compiled, device), reference) < 1e-4
    assert meta.stats["weight_refreshes"] == 0


def test_host_tensors_written_through_data_are_seen():
    """On the CPU a write through ``.data`` keeps pointer and version: the watch compares by value."""
    model, _ = tiny_peft_llama(adapters=(("sql", 4, 8), ("chat", 4, 8)))
    reference = copy.deepcopy(model)
    meta = xlp.LoRAMetadata(max_num_tokens=64)
    meta.register_adapters(model)
    compiled = torch.compile(model, backend=xlp.make_backend(meta, inner="aot_eager"))
    meta.set_request_adapters(ROWS)
    _run(compiled, "cpu")
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        if ".lora_A.chat." in name:
            new = torch.randn(p.shape, generator=torch.Generator().manual_seed(4))
            p.data.copy_(new)
            q.data.copy_(new)
    assert _err(_run(compiled, "cpu"), reference) < 1e-4


def test_weights_are_checked_once_per_generate_not_per_step(device, inner, monkeypatch):
    """A generate checks the model's LoRA tensors before its first step only (the check read every watched
    tensor at every step: 0.64 ms of a 3.9 ms batch-1 decode step on XLA:CPU); a change made before it is
    served, and its tokens equal eager PEFT's."""
    from xla_lora_pass.metadata.weight_watch import WeightWatch

    model, _ = tiny_peft_llama(adapters=(("sql", 4, 8), ("chat", 4, 8)))
    reference = copy.deepcopy(model)
    meta, compiled = _serve(model, device, inner)
    gen = torch.Generator().manual_seed(5)
    for name in [n for n, _ in model.named_parameters() if ".lora_B.chat." in n]:
        new = torch.randn(model.get_parameter(name).shape, generator=gen)
        with torch.no_grad():
            model.get_parameter(name).copy_(new.to(device))
            reference.get_parameter(name).copy_(new)
    checks = []
    original = WeightWatch.changed
    monkeypatch.setattr(WeightWatch, "changed", lambda self, *a: checks.append(1) or original(self, *a))
    ids = IDS[:2, :5]
    kw = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        got = compiled.generate(input_ids=ids.to(device), adapter_names=["chat", "__base__"], **kw).cpu()
    assert len(checks) == 1
    assert meta.stats["weight_refreshes"] == 4  # chat at q and v of both layers, read once
    with torch.no_grad():
        reference.set_adapter("chat")
        want_chat = reference.generate(input_ids=ids[:1], **kw)
        with reference.disable_adapter():
            want_base = reference.generate(input_ids=ids[1:], **kw)
    assert torch.equal(got, torch.cat([want_chat, want_base]))


def test_a_call_checks_the_mapped_adapters_only_and_reads_a_change_once_mapped(device, inner, monkeypatch):
    """A compiled call compares the watched tensors of the adapters its mapping names, not every adapter's;
    a change to an unmapped adapter stays unread (its slot adds nothing) until a call maps it, which
    serves it."""
    from xla_lora_pass.metadata.weight_watch import WeightWatch

    model, _ = tiny_peft_llama(adapters=(("sql", 4, 8), ("chat", 4, 8)))
    reference = copy.deepcopy(model)
    meta, compiled = _serve(model, device, inner, rows=["sql", None, "sql"])
    _run(compiled, device)  # compiled: a new graph checks every adapter before its rewrite
    asked = []
    original = WeightWatch.changed
    monkeypatch.setattr(WeightWatch, "changed", lambda self, adapters=None: asked.append(
        None if adapters is None else sorted(adapters)) or original(self, adapters))
    gen = torch.Generator().manual_seed(9)
    for name in [n for n, _ in model.named_parameters() if ".lora_B.chat." in n]:
        new = torch.randn(model.get_parameter(name).shape, generator=gen)
        with torch.no_grad():
            model.get_parameter(name).copy_(new.to(device))
            reference.get_parameter(name).copy_(new)
    assert _err(_run(compiled, device), reference, ["sql", None, "sql"]) < 1e-4
    assert asked == [["sql"]]
    assert meta.stats["weight_refreshes"] == 0  # chat's change not read: no row maps it
    meta.set_request_adapters(ROWS)
    assert _err(_run(compiled, device), reference) < 1e-4  # chat's new weights served
    assert asked[-1] == ["chat", "sql"]
    assert meta.stats["weight_refreshes"] == 4  # chat at q and v of both layers
    assert meta.sync_model_weights() == 0 and asked[-1] is None  # the public call checks every adapter


def _replace(model, how, adapter, gen):
    """Give ``adapter``'s q_proj of layer 0 new values by another object (or a new float scaling)."""
    q = model.base_model.model.model.layers[0].self_attn.q_proj
    weight = q.lora_B[adapter].weight
    new = torch.randn(weight.shape, generator=gen).to(weight.device)
    if how == "parameter":
        q.lora_B[adapter].weight = torch.nn.Parameter(new)
    elif how == "load_state_dict_assign":
        q.lora_B[adapter].load_state_dict({"weight": new}, assign=True)
    elif how == "module":
        linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False).to(weight.device)
        with torch.no_grad():
            linear.weight.copy_(new)
        q.lora_B[adapter] = linear
    else:
        q.scaling[adapter] = 3.0


@pytest.mark.compat
@pytest.mark.parametrize("adapter", ["sql", "chat"], ids=["active", "inactive"])
@pytest.mark.parametrize("how", ["parameter", "load_state_dict_assign", "module", "scaling"])
def test_a_replaced_tensor_module_or_scaling_is_served(device, inner, how, adapter):
    """Another object where a LoRA tensor was (a new Parameter, load_state_dict(assign=True), the adapter's
    module replaced) or a new float scaling of an adapter the traced forward does not read: marks cannot show
    it and Dynamo need not trace again; the next call that maps the adapter serves it (before: served the old
    weights, up to 0.59 off eager PEFT, for the inactive adapter even after meta.sync_model_weights())."""
    torch._dynamo.reset()  # 8 cases each trace the same forwards: not past Dynamo's recompile limit
    model, _ = tiny_peft_llama(adapters=(("sql", 4, 8), ("chat", 4, 8)))
    reference = copy.deepcopy(model)
    meta, compiled = _serve(model, device, inner)
    assert _err(_run(compiled, device), reference) < 1e-4
    _replace(model, how, adapter, torch.Generator().manual_seed(11))
    _replace(reference, how, adapter, torch.Generator().manual_seed(11))
    assert _err(_run(compiled, device), reference) < 1e-4
    assert meta.stats["weight_refreshes"] >= 1


def test_synced_once_reads_at_entry_and_serves_later_changes_after_exit(device, inner):
    model, _ = tiny_peft_llama(adapters=(("sql", 4, 8), ("chat", 4, 8)))
    reference = copy.deepcopy(model)
    meta, compiled = _serve(model, device, inner)
    assert _err(_run(compiled, device), reference) < 1e-4
    name = next(n for n, _ in model.named_parameters() if ".lora_B.chat." in n)
    new = torch.randn(model.get_parameter(name).shape, generator=torch.Generator().manual_seed(6))
    with meta.model_weights_synced_once():
        before = _run(compiled, device)
        with torch.no_grad():
            model.get_parameter(name).copy_(new.to(device))
        assert torch.equal(_run(compiled, device), before)  # documented: seen from the first call after
    with torch.no_grad():
        reference.get_parameter(name).copy_(new)
    assert _err(_run(compiled, device), reference) < 1e-4
