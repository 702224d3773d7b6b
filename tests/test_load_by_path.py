"""A PEFT adapter saved with ``save_pretrained``, loaded by path into a free slot: exact, no compile, safe."""
import json
import os
import re

import pytest
import torch
from peft import LoraConfig

import xla_lora_pass as xlp
from xla_lora_pass.demo_models import eager_reference, per_sequence_mapping, tiny_peft_llama

from .test_dora import per_adapter_reference, perturb_magnitudes
from .xla_utils import device_compiles

SEQ = 6
FRESH = LoraConfig(r=4, lora_alpha=6, use_rslora=True, target_modules=["q_proj", "v_proj"], init_lora_weights=False)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The demo Llama with a fourth adapter "fresh" (rsLoRA), its reference logits, and it saved then removed."""
    model, names = tiny_peft_llama()
    model.add_adapter("fresh", FRESH)
    model.set_adapter(names[0])
    rows = ["fresh", "sql", None, "fresh"]
    ids = torch.randint(0, 128, (len(rows), SEQ), generator=torch.Generator().manual_seed(0))
    reference = eager_reference(model, ids, rows)
    path = tmp_path_factory.mktemp("peft") / "fresh"
    model.save_pretrained(str(path), selected_adapters=["fresh"])
    model.delete_adapter("fresh")
    return dict(model=model, ids=ids, rows=rows, reference=reference, path=path / "fresh"
                if (path / "fresh").is_dir() else path)


def test_saved_adapter_loaded_by_path_is_exact_and_compiles_nothing(saved, device, inner):
    torch._dynamo.reset()
    s = saved
    assert os.path.isfile(os.path.join(s["path"], "adapter_model.safetensors"))
    model = s["model"].to(device)
    meta = xlp.LoRAMetadata(max_num_tokens=128, max_slots=4)
    assert meta.register_adapters(model) == ["sql", "chat", "code"]
    compiled = torch.compile(model, backend=xlp.make_backend(meta, inner=inner))

    def run(rows):
        meta.set_token_adapters(per_sequence_mapping(rows, SEQ))
        with torch.no_grad():
            return compiled(input_ids=s["ids"].to(device)).logits.cpu()

    run(["sql", "chat", None, "code"])
    before = device_compiles(device, meta)
    assert meta.load_adapter("fresh", s["path"]) == 3
    out = run(s["rows"])
    assert (out - s["reference"]).abs().max().item() < 1e-4
    assert device_compiles(device, meta) == before
    model.cpu()


def test_pickled_weights_load_through_weights_only(saved, tmp_path):
    """adapter_model.bin: torch.load(weights_only=True) gives the same stacks; a pickled object is refused."""
    from safetensors.torch import load_file

    by_tensors = xlp.LoRAMetadata(max_num_tokens=16, max_slots=4)
    by_tensors.register_adapters(saved["model"])
    by_tensors.load_adapter("fresh", saved["path"])
    pickled = tmp_path / "bin"
    pickled.mkdir()
    (pickled / "adapter_config.json").write_text((saved["path"] / "adapter_config.json").read_text())
    torch.save(load_file(str(saved["path"] / "adapter_model.safetensors")), str(pickled / "adapter_model.bin"))
    by_pickle = xlp.LoRAMetadata(max_num_tokens=16, max_slots=4)
    by_pickle.register_adapters(saved["model"])
    by_pickle.load_adapter("fresh", pickled)
    for site in by_tensors.sites:
        for a, b in zip(by_tensors.stacked_weights(site, "cpu"), by_pickle.stacked_weights(site, "cpu")):
            assert torch.equal(a, b)

    class Payload:
        def __reduce__(self):
            return (os.system, ("echo owned",))

    torch.save({"x": Payload()}, str(pickled / "adapter_model.bin"))
    with pytest.raises(Exception, match="Weights only load failed"):
        by_pickle.load_adapter("evil", pickled)
    assert by_pickle.slots[3] == "fresh"


@pytest.mark.parametrize("edit, error, match", [
    (lambda cfg, st: cfg.update(peft_type="IA3"), ValueError, "is a IA3 adapter; only LoRA is served"),
    (lambda cfg, st: cfg.update(lora_alpha="big"), ValueError, "no finite number lora_alpha"),
    (lambda cfg, st: cfg.update(modules_to_save=["lm_head"]), ValueError, "sets modules_to_save"),
    (lambda cfg, st: st.update({k: v[:, :31].contiguous() for k, v in st.items() if "lora_A" in k}), ValueError,
     r"expected \[r, 32\]"),
    (lambda cfg, st: st.update({"base_model.model.lm_head.lora_A.weight": torch.zeros(4, 32)}), KeyError,
     "names no registered LoRA site"),
])
def test_a_saved_adapter_that_does_not_fit_is_refused_before_any_slot_changes(saved, tmp_path, edit, error, match):
    from safetensors.torch import load_file, save_file

    cfg = json.loads((saved["path"] / "adapter_config.json").read_text())
    state = load_file(str(saved["path"] / "adapter_model.safetensors"))
    edit(cfg, state)
    (tmp_path / "adapter_config.json").write_text(json.dumps(cfg))
    save_file(state, str(tmp_path / "adapter_model.safetensors"))
    meta = xlp.LoRAMetadata(max_num_tokens=16, max_slots=4)
    meta.register_adapters(saved["model"])
    before = {s: [t.clone() for t in meta.stacked_weights(s, "cpu")] for s in meta.sites}
    with pytest.raises(error, match=match):
        meta.load_adapter("fresh", tmp_path)
    assert meta.slots[3] is None
    for s, old in before.items():
        assert all(torch.equal(a, b) for a, b in zip(old, meta.stacked_weights(s, "cpu")))


def test_saved_dora_adapter_loads_its_magnitudes(tmp_path):
    """A DoRA adapter saved by PEFT, loaded by path next to a registered DoRA adapter: PEFT's own output."""
    model, names = tiny_peft_llama(num_hidden_layers=1)
    dora = LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"], use_dora=True, init_lora_weights=False)
    model.add_adapter("dora", dora)
    model.add_adapter("dora2", dora)
    perturb_magnitudes(model)
    model.set_adapter(names[0])
    ids = torch.randint(0, 128, (3, 4), generator=torch.Generator().manual_seed(0))
    rows = ["dora2", "dora", None]
    reference = per_adapter_reference(model, lambda: model(input_ids=ids).logits, rows)
    model.save_pretrained(str(tmp_path), selected_adapters=["dora2"])
    model.delete_adapter("dora2")
    torch._dynamo.reset()  # a static trace: 12 tokens, no bucket past max_num_tokens
    meta = xlp.LoRAMetadata(max_num_tokens=16, max_slots=5)
    meta.register_adapters(model)
    meta.load_adapter("dora2", tmp_path / "dora2")
    meta.set_token_adapters(per_sequence_mapping(rows, 4))
    compiled = torch.compile(model, backend=xlp.make_backend(meta, inner="aot_eager"))
    with torch.no_grad():
        out = compiled(input_ids=ids).logits
    assert (out - reference).abs().max().item() < 1e-4


def _truncated_safetensors(path):
    data = (path / "adapter_model.safetensors").read_bytes()
    (path / "adapter_model.safetensors").write_bytes(data[:len(data) // 2])
    return "adapter_model.safetensors"


def _corrupt_bin(path):
    (path / "adapter_model.safetensors").unlink()
    (path / "adapter_model.bin").write_bytes(b"PK\x03\x04 not a zip archive" + bytes(range(256)))
    return "adapter_model.bin"


def _bad_json(path):
    (path / "adapter_config.json").write_text('{"peft_type": "LORA", "lora_alpha": 8,')
    return "adapter_config.json"


def _config_not_an_object(path):
    (path / "adapter_config.json").write_text("[8]")
    return "adapter_config.json"


def _no_weights(path):
    (path / "adapter_model.safetensors").unlink()
    return ""


def _no_config(path):
    (path / "adapter_config.json").unlink()
    return ""


BAD_FILES = [_truncated_safetensors, _corrupt_bin, _bad_json, _config_not_an_object, _no_weights, _no_config]


def _bad_copy(saved, tmp_path, damage):
    """A copy of the saved adapter directory with ``damage`` done to it; returns (directory, path to name)."""
    import shutil

    path = tmp_path / "broken"
    shutil.copytree(saved["path"], path)
    return path, os.path.join(str(path), damage(path))


@pytest.mark.parametrize("damage", BAD_FILES, ids=lambda f: f.__name__.strip("_"))
def test_a_bad_adapter_file_raises_adapter_file_error_naming_adapter_and_path(saved, tmp_path, damage):
    """Truncated safetensors, a corrupt .bin, bad JSON, a missing file: the package's AdapterFileError (a
    FileNotFoundError too when a file is missing), naming the adapter and the file; nothing changes."""
    from xla_lora_pass.errors import AdapterFileError

    path, bad = _bad_copy(saved, tmp_path, damage)
    meta = xlp.LoRAMetadata(max_num_tokens=16, max_slots=4)
    meta.register_adapters(saved["model"])
    with pytest.raises(AdapterFileError, match=r"load_adapter\('fresh'\): .*'" + re.escape(bad.rstrip("/"))) as info:
        meta.load_adapter("fresh", path)
    assert isinstance(info.value, FileNotFoundError) == (damage in (_no_weights, _no_config))
    assert meta.slots[3] is None


@pytest.mark.parametrize("damage", [_truncated_safetensors, _no_weights], ids=lambda f: f.__name__.strip("_"))
def test_a_bad_added_adapter_raises_at_the_mapping_that_uses_it(saved, tmp_path, damage):
    """add_adapter reads nothing and a prefetch that fails raises nothing: the mapping that needs the adapter
    raises AdapterFileError naming the adapter and the file, and keeps the old mapping and slots."""
    from xla_lora_pass.errors import AdapterFileError

    path, bad = _bad_copy(saved, tmp_path, damage)
    meta = xlp.LoRAMetadata(max_num_tokens=16, max_slots=4)
    meta.register_adapters(saved["model"])
    meta.add_adapter("fresh", path)
    meta.set_request_adapters(["sql", None])
    meta.prefetch(["fresh"], wait=True)
    named = r"set_request_adapters: adapter 'fresh'.*'" + re.escape(bad.rstrip("/"))
    with pytest.raises(AdapterFileError, match=named):
        meta.set_request_adapters(["fresh", "chat"])
    assert meta.slots == ["sql", "chat", "code", None] and meta.request_adapters().tolist() == [0, -1]
