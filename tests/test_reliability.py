"""Issue 7: bad input gets a clear, early error; a failed rewrite falls back and never gives a wrong answer.

Every bad input of ``BAD_INPUTS`` is tried on ONE compiled tiny PEFT Llama on
the ``device`` fixture's device (XLA, else the CPU); after each error the same
compiled model must serve the next good request, equal to eager PEFT, with no
new XLA program (on XLA) and no new backend compile.  ``python -m tests.test_reliability`` prints the table of
errors from the same cases.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Callable, List, Optional

import pytest
import torch

import xla_lora_pass as xlp
from xla_lora_pass.demo_models import eager_reference, per_sequence_mapping, tiny_peft_llama

from .xla_utils import device_compiles, xla_compiles

Q0 = "base_model.model.model.layers.0.self_attn.q_proj"
WARM_ROWS = ["sql", "chat"]
GOOD_ROWS = ["code", None]  # the good request after every bad one
SEQ = 4
MAX_TOKENS = 32  # [2, 20] is too many tokens
BUCKETS = (8,)  # seq 12 is past the largest bucket, 24 tokens are not too many


@dataclasses.dataclass
class Served:
    model: torch.nn.Module
    meta: xlp.LoRAMetadata
    backend: xlp.LoRABackend
    compiled: Callable
    device: torch.device
    ids: torch.Tensor  # [2, 20]; calls use a prefix of the sequence
    reference: torch.Tensor  # eager PEFT, ids[:, :SEQ] on GOOD_ROWS

    def run(self, seq: int = SEQ) -> torch.Tensor:
        with torch.no_grad():
            return self.compiled(input_ids=self.ids[:, :seq].to(self.device)).logits.cpu()

    def good_request(self) -> float:
        """The next good request: a new mapping, a call, and the max abs error against eager PEFT."""
        self.meta.set_token_adapters(per_sequence_mapping(GOOD_ROWS, SEQ))
        return (self.run() - self.reference).abs().max().item()


def _state(a_shape=(2, 32), b_shape=(32, 2), dtype=torch.float32, device="cpu", fill: Optional[dict] = None):
    """A one-site PEFT-style state dict for q_proj of layer 0, random unless ``fill`` says otherwise."""
    g = torch.Generator().manual_seed(11)
    a = torch.randn(a_shape, generator=g).to(dtype=dtype, device=device) if device != "meta" else \
        torch.empty(a_shape, dtype=dtype, device="meta")
    b = torch.randn(b_shape, generator=g).to(dtype=dtype, device=device) if device != "meta" else \
        torch.empty(b_shape, dtype=dtype, device="meta")
    for (which, index), value in (fill or {}).items():
        (a if which == "A" else b)[index] = value
    return {f"{Q0}.lora_A.weight": a, f"{Q0}.lora_B.weight": b}


@dataclasses.dataclass
class BadInput:
    label: str
    action: Callable[[Served], object]
    error: type
    match: str

    @property
    def sets_mapping(self) -> bool:
        """A compiled-call case: its (good) mapping is set on purpose before the refused call."""
        return getattr(self.action, "sets_mapping", False)


def _call_with(mapping, seq):
    def action(s: Served):
        s.meta.set_token_adapters(mapping)
        return s.run(seq)
    action.sets_mapping = True
    return action


def _set(mapping):
    return lambda s: s.meta.set_token_adapters(mapping)


def _load(state, name="fresh", **kw):
    kw.setdefault("scaling", 1.0)
    return lambda s: s.meta.load_adapter(name, state() if callable(state) else state, **kw)


BAD_INPUTS: List[BadInput] = [
    # set_token_adapters
    BadInput("unknown adapter name", _set(["sql"] * 4 + ["nope"] * 4), KeyError, r"token 4: unknown adapter 'nope'"),
    BadInput("slot past the slots", _set([0] * 7 + [9]), ValueError, r"token 7: slot 9 is not a loaded slot; valid: -1 and \[0, 1, 2\]"),
    BadInput("free slot", _set([3] * 8), ValueError, r"slot 3 is not a loaded slot"),
    BadInput("negative slot other than -1", _set([-2] * 8), ValueError, r"slot -2 is not a loaded slot"),
    BadInput("bool entry", _set([True] * 8), TypeError, r"token 0: expected str, int or None, got True"),
    BadInput("float entry", _set([1.0] * 8), TypeError, r"expected str, int or None, got 1.0"),
    BadInput("a bare string", _set("sql"), TypeError, r"expected a sequence with one entry per token"),
    BadInput("2-d tensor", _set(torch.zeros(2, 4, dtype=torch.int32)), TypeError, r"1-d integer tensor"),
    BadInput("float tensor", _set(torch.zeros(8)), TypeError, r"1-d integer tensor, got torch.float32"),
    BadInput("mapping longer than max_num_tokens", _set(["sql"] * 33), ValueError,
             r"33 tokens exceed max_num_tokens=32"),
    # the compiled call
    BadInput("mapping shorter than the call", _call_with(["sql"] * 7, SEQ), xlp.UnsupportedMappingError,
             r"mapping has 7 entries but this call has 8 tokens \(token dims \[2, 4\]\)"),
    BadInput("mapping longer than the call", _call_with(["sql"] * 12, SEQ), xlp.UnsupportedMappingError,
             r"mapping has 12 entries but this call has 8 tokens"),
    BadInput("more tokens than the largest bucket", _call_with(["sql"] * 24, 12), ValueError,
             r"size 12 exceeds the largest bucket 8"),
    # uniform on the active adapter: what a fallback graph would have computed, so only the count refuses it
    BadInput("more tokens than max_num_tokens", _call_with(["sql"] * 32, 20), ValueError,
             r"this call has 40 tokens \(token dims \[2, 20\]\), more than max_num_tokens=32"),
    # load_adapter
    BadInput("A rank above the site's stacked rank", _load(_state((9, 32), (32, 9))), ValueError,
             r"q_proj.lora_A: expected \[r, 32\] with 1 <= r <= 8 \(the site's stacked rank\), got \[9, 32\]"),
    BadInput("A of the wrong in_features", _load(_state((2, 31))), ValueError, r"lora_A: expected \[r, 32\].*got \[2, 31\]"),
    BadInput("1-d A", _load(_state((32,))), ValueError, r"lora_A: expected \[r, 32\].*got \[32\]"),
    BadInput("B of the wrong shape", _load(_state(b_shape=(31, 2))), ValueError, r"lora_B: expected \[32, 2\], got \[31, 2\]"),
    BadInput("integer dtype", _load(_state(dtype=torch.int64)), TypeError, r"lora_A: expected a floating-point tensor"),
    BadInput("complex dtype", _load(_state(dtype=torch.complex64)), TypeError, r"expected a floating-point tensor"),
    BadInput("meta device", _load(_state(device="meta")), ValueError, r"lora_A: a meta tensor holds no data"),
    BadInput("sparse tensor", _load(lambda: {k: v.to_sparse() for k, v in _state().items()}), TypeError,
             r"expected a dense tensor"),
    BadInput("NaN in A", _load(_state(fill={("A", (0, 3)): float("nan")})), ValueError,
             r"load_adapter\('fresh'\): .*q_proj: lora_A has 1 NaN or inf value"),
    BadInput("inf in B", _load(_state(fill={("B", (5, 1)): float("inf")})), ValueError,
             r"lora_B \* scaling \(1.0\) has 1 NaN or inf value"),
    BadInput("B overflows float32 once scaled", _load(_state(), scaling=1e39), ValueError,
             r"lora_B \* scaling \(1e\+39\) has \d+ NaN or inf value"),
    BadInput("NaN scaling", _load(_state(), scaling=float("nan")), ValueError, r"scaling must be finite, got nan"),
    BadInput("string scaling", _load(_state(), scaling="2"), TypeError, r"scaling must be a real number, got '2'"),
    BadInput("no scaling and no config", _load(_state(), scaling=None), ValueError, r"give scaling= or a LoraConfig"),
    BadInput("key naming no site", _load({"model.nowhere.lora_A.weight": torch.randn(2, 32)}), KeyError,
             r"names no registered LoRA site"),
    BadInput("A without B", _load({f"{Q0}.lora_A.weight": torch.randn(2, 32)}), KeyError, r"needs both lora_A and lora_B"),
    BadInput("not a LoRA key", _load({f"{Q0}.base_layer.weight": torch.randn(32, 32)}), KeyError,
             r"is not a lora_A / lora_B weight"),
    BadInput("adapter name None", _load(_state(), name=None), TypeError, r"adapter name must be a non-empty str, got None"),
    BadInput("state is a list", _load([torch.randn(2, 32)]), TypeError, r"state must be a mapping"),
    BadInput("empty state", _load({}), ValueError, r"state holds no lora_A / lora_B weights"),
]


def make_served(device, inner=None) -> Served:
    """The one compiled model every bad input is tried on, warmed up."""
    torch._dynamo.reset()
    model, names = tiny_peft_llama()
    ids = torch.randint(0, 128, (2, 20), generator=torch.Generator().manual_seed(0))
    reference = eager_reference(model, ids[:, :SEQ], GOOD_ROWS)
    model.to(device)
    meta = xlp.LoRAMetadata(max_num_tokens=MAX_TOKENS, max_slots=4)
    meta.register_adapters(model)
    backend = xlp.make_backend(meta, buckets=xlp.Buckets(BUCKETS), inner=inner)
    s = Served(model, meta, backend, torch.compile(model, backend=backend), device, ids, reference)
    # Warm up as a server would: two sequence lengths make Dynamo's graph dynamic in the sequence.
    for seq in (SEQ, 6, SEQ):
        s.meta.set_token_adapters(per_sequence_mapping(WARM_ROWS, seq))
        s.run(seq)
    assert s.good_request() < 1e-4
    return s


@pytest.fixture(scope="module")
def served(device, inner) -> Served:
    return make_served(device, inner)


def _snapshot(meta: xlp.LoRAMetadata):
    mapping = meta.mapping()
    return (meta.slots, None if mapping is None else mapping.tolist(),
            {site: [t.clone() for t in meta.host_stacks(site)] for site in meta.sites})


def try_bad_input(s: Served, bad: BadInput):
    """Run one bad input; returns (error, seconds, new device compiles (XLA's own on XLA), new backend compiles,
    good request's error).

    Also checks that the refused call left the metadata exactly as it was.
    """
    s.meta.set_token_adapters(per_sequence_mapping(GOOD_ROWS, SEQ))
    before = _snapshot(s.meta)
    device_before, compiles_before = device_compiles(s.device, s.meta), s.meta.stats["compiles"]
    start = time.perf_counter()
    with pytest.raises(bad.error, match=bad.match) as caught:
        bad.action(s)
    seconds = time.perf_counter() - start
    after = _snapshot(s.meta)
    if not bad.sets_mapping:
        assert after[1] == before[1], "a refused mapping replaced the old one"
    assert after[0] == before[0], "a refused call changed the slots"
    for site in before[2]:
        assert all(torch.equal(x, y) for x, y in zip(before[2][site], after[2][site])), site
    good_error = s.good_request()
    return (caught.value, seconds, device_compiles(s.device, s.meta) - device_before,
            s.meta.stats["compiles"] - compiles_before, good_error)


@pytest.mark.parametrize("bad", BAD_INPUTS, ids=[b.label for b in BAD_INPUTS])
def test_bad_input_is_refused_and_the_same_model_serves_the_next_request(served, bad):
    _, _, new_xla, new_compiles, good_error = try_bad_input(served, bad)
    assert good_error < 1e-4
    assert (new_xla, new_compiles) == (0, 0)


def test_no_bad_input_compiled_anything(served):
    """Every program the model has: the static first trace and the one bucket of the dynamic graph."""
    assert served.meta.stats["compiles"] == 2
    assert set(served.meta.stats["bucket_hits"]) == {(2, 4), (2, 8)}


def test_load_adapter_copies_weights_from_any_device_and_refuses_a_full_house(served):
    """Weights on the XLA device (and of another float dtype) are accepted: copied, cast, never kept."""
    s = served
    device_before, compiles_before = device_compiles(s.device, s.meta), s.meta.stats["compiles"]
    state = _state((3, 32), (32, 3), dtype=torch.bfloat16, device=s.device)
    assert s.meta.load_adapter("fresh", state, scaling=0.5) == 3
    a, b = s.meta.stacked_weights(Q0, "cpu")
    assert a.dtype == torch.float32
    torch.testing.assert_close(a[3, :3], state[f"{Q0}.lora_A.weight"].cpu().float())
    torch.testing.assert_close(b[3, :, :3], state[f"{Q0}.lora_B.weight"].cpu().float() * 0.5)
    s.meta.set_token_adapters(per_sequence_mapping([None, "fresh"], SEQ))
    with_fresh = s.run()
    s.meta.set_token_adapters(per_sequence_mapping([None, None], SEQ))
    base = s.run()
    assert torch.equal(with_fresh[0], base[0]) and (with_fresh[1] - base[1]).abs().max() > 1e-3
    # A fifth adapter while the mapping uses all four slots: no slot may be taken from under it.
    s.meta.set_token_adapters([s.meta.slots[i % 4] for i in range(2 * SEQ)])
    with pytest.raises(ValueError, match=r"load_adapter\('another'\): .*4 of them kept by .* it needs 5 slots"):
        s.meta.load_adapter("another", _state(), scaling=1.0)
    assert s.good_request() < 1e-4
    assert (device_compiles(s.device, s.meta) - device_before, s.meta.stats["compiles"] - compiles_before) == (0, 0)


@pytest.mark.xfail(strict=True, reason="bucketing.py: slice_outputs narrows the padded XLA outputs lazily, so the "
                   "first call of every new real token count inside an already compiled bucket compiles one more "
                   "(slicing) XLA program; stats['compiles'] does not count it")
def test_a_new_token_count_in_a_compiled_bucket_compiles_nothing(served):
    s = served  # bucket 8 is compiled and sequence lengths 4 and 6 are warm; 7 is new
    s.meta.set_token_adapters(per_sequence_mapping(GOOD_ROWS, 7))
    xla_before, compiles_before = xla_compiles(), s.meta.stats["compiles"]
    s.run(7)
    assert s.meta.stats["compiles"] == compiles_before
    assert xla_compiles() == xla_before


def test_register_refuses_non_finite_adapter_weights_and_drops_a_stale_mapping():
    """CPU: register_adapters checks the model's own weights, and a new registration forgets old slot numbers."""
    from .models import peft_two_layer

    meta = xlp.LoRAMetadata(max_num_tokens=MAX_TOKENS)
    model = peft_two_layer()
    meta.register_adapters(model)
    meta.set_token_adapters(["chat", "sql"])
    with torch.no_grad():
        model.base_model.model.proj.lora_B["chat"].weight[0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"register_adapters: base_model.model.proj adapter 'chat': "
                                         r"lora_B \* scaling \(1.0\) has 1 NaN or inf value"):
        meta.register_adapters(model)
    assert meta.slots == ["sql", "chat"] and meta.mapping().tolist() == [1, 0]  # the refused call changed nothing
    meta.register_adapters(peft_two_layer(adapters=(("chat", 2, 4), ("sql", 4, 4))))
    assert meta.slots == ["chat", "sql"] and meta.mapping() is None  # [1, 0] would now mean the other adapters


def _table() -> str:
    """The bad-input table of the final report, from the same cases and the same checks."""
    import torch_xla

    rows = ["| bad input | error (type: message) | s to refuse | next good request | new XLA / backend "
            "compiles | fallbacks |", "|---|---|---|---|---|---|"]
    s = make_served(torch_xla.device())
    for bad in BAD_INPUTS:
        fallbacks = s.meta.stats["fallbacks"]
        err, seconds, new_xla, new_compiles, good_error = try_bad_input(s, bad)
        msg = str(err).replace("|", "\\|").replace("\n", " ")
        rows.append(f"| {bad.label} | {type(err).__name__}: {msg} | {seconds:.3f} | "
                    f"{'ok' if good_error < 1e-4 else 'WRONG'} (max abs err {good_error:.1e}) | "
                    f"{new_xla} / {new_compiles} | +{s.meta.stats['fallbacks'] - fallbacks} |")
    return "\n".join(rows)


if __name__ == "__main__":
    import os

    os.environ.setdefault("PJRT_DEVICE", "CPU")
    print(_table())
