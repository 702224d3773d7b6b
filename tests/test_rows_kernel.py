"""The row kernel (ops_rows.py): one adapter per row of the token grid, and the backend's switch to
the masked kernel for mappings that mix adapters within a row."""
import os

import pytest
import torch

import xla_lora_pass as xlp
from xla_lora_pass.kernels import masked as ops
from xla_lora_pass.runtimes import xla_cpu_flags
from xla_lora_pass.demo_models import eager_reference, per_sequence_mapping, tiny_peft_llama
from xla_lora_pass.errors import UnsupportedMappingError

from .xla_utils import xla_compiles


def _row_case(rows_slots, length, num_slots=3, rank=4, d=16, o=12, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(len(rows_slots) * length, d, generator=g).to(dtype)
    a = torch.randn(num_slots, rank, d, generator=g).to(dtype)
    b = torch.randn(num_slots, o, rank, generator=g).to(dtype)
    y = torch.randn(len(rows_slots) * length, o, generator=g).to(dtype)
    row_slots = torch.tensor(rows_slots, dtype=torch.int32)
    return x, a, b, y, row_slots, row_slots.repeat_interleave(length)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_row_ops_equal_the_per_token_reference(dtype, tol):
    x, a, b, y, row_slots, idx = _row_case([2, -1, 0, 2, 1], length=6, dtype=dtype)
    a_t, b_t = a.transpose(1, 2).contiguous(), b.transpose(1, 2).contiguous()  # the row kernel's layout
    got_t = torch.ops.xla_lora.bgmv_shrink_rows(x, a_t, row_slots, 0.5)
    want_t = ops.bgmv_shrink_reference(x, a, idx, 0.5)
    torch.testing.assert_close(got_t.float(), want_t.float(), atol=tol, rtol=tol)
    got = torch.ops.xla_lora.bgmv_expand_rows(got_t, b_t, y, row_slots, True)
    want = ops.bgmv_expand_reference(want_t, b, y, idx, True)
    torch.testing.assert_close(got.float(), want.float(), atol=tol * 10, rtol=tol)
    assert torch.equal(got[6:12], y[6:12])  # the -1 row: exactly the base output
    delta = torch.ops.xla_lora.bgmv_expand_rows(got_t, b_t, y, row_slots, False)
    torch.testing.assert_close((y + delta).float(), got.float(), atol=tol, rtol=tol)


def test_row_ops_refuse_tokens_that_do_not_split_into_rows():
    x, a, b, y, row_slots, _ = _row_case([0, 1, 2], length=4)
    a_t = a.transpose(1, 2).contiguous()
    with pytest.raises(RuntimeError, match="do not split into 3 equal rows"):
        torch.ops.xla_lora.bgmv_shrink_rows(x[:11], a_t, row_slots, 1.0)
    with pytest.raises(RuntimeError, match="x has 16 features, w expects 4"):
        torch.ops.xla_lora.bgmv_shrink_rows(x, a, row_slots, 1.0)  # the [N, R, D] layout: refused


def test_metadata_refuses_row_slots_for_a_mapping_mixed_within_rows():
    model, names = tiny_peft_llama()
    meta = xlp.LoRAMetadata(max_num_tokens=64)
    meta.register_adapters(model)
    meta.set_token_adapters(per_sequence_mapping(["sql", None, "chat"], 4))
    assert meta.rows_uniform((3, 4))
    assert meta.row_slots("cpu", (3, 4), (4, 8))[:5].tolist() == [0, -1, 1, -1, -1]
    meta.set_token_adapters(["sql"] * 4 + ["chat", "sql", "sql", "sql"] + [None] * 4)
    assert not meta.rows_uniform((3, 4))
    with pytest.raises(UnsupportedMappingError, match="different adapters"):
        meta.row_slots("cpu", (3, 4), (3, 4))


ROWS = ["sql", "chat", "code", None]


@pytest.fixture(scope="module")
def served(xla_device):
    torch._dynamo.reset()
    model, names = tiny_peft_llama()
    ids = torch.randint(0, 128, (len(ROWS), 16), generator=torch.Generator().manual_seed(3))
    model_cpu_state = {k: v.clone() for k, v in model.state_dict().items()}
    model.to(xla_device)
    meta = xlp.LoRAMetadata(max_num_tokens=256, max_slots=4)
    meta.register_adapters(model)
    backend = xlp.make_backend(meta)
    compiled = torch.compile(model, backend=backend)
    cpu_model, _ = tiny_peft_llama()
    cpu_model.load_state_dict(model_cpu_state)
    return dict(ids=ids, meta=meta, backend=backend, compiled=compiled, device=xla_device, cpu=cpu_model)


def _logits(s, n):
    with torch.no_grad():
        return s["compiled"](input_ids=s["ids"][:, :n].to(s["device"])).logits.cpu()


def test_per_row_mapping_runs_the_row_kernel_and_matches_eager(served):
    s = served
    for n in (12, 16, 9):  # 12 is Dynamo's first (static) trace, then dynamic and bucketed to 16
        s["meta"].set_token_adapters(per_sequence_mapping(ROWS, n))
        got = _logits(s, n)
        want = eager_reference(s["cpu"], s["ids"][:, :n], ROWS)
        assert (got - want).abs().max().item() < 1e-4
    assert all("rows" in g.kernels for g in s["backend"].graphs)
    assert all(not g.variants for g in s["backend"].graphs)  # no other rewrite was needed
    # A new per-row mapping compiles nothing.
    before = xla_compiles()
    rotated = ROWS[1:] + ROWS[:1]
    s["meta"].set_token_adapters(per_sequence_mapping(rotated, 16))
    got = _logits(s, 16)
    assert (got - eager_reference(s["cpu"], s["ids"][:, :16], rotated)).abs().max().item() < 1e-4
    assert xla_compiles() == before
    # An adapter loaded into the free slot reaches the row kernel's (transposed) stacks; nothing compiles.
    q0 = "base_model.model.model.layers.0.self_attn.q_proj"
    g = torch.Generator().manual_seed(11)
    state = {f"{q0}.lora_A.weight": torch.randn(3, 32, generator=g),
             f"{q0}.lora_B.weight": torch.randn(32, 3, generator=g)}
    assert s["meta"].load_adapter("fresh", state, scaling=1.5) == 3
    s["meta"].set_token_adapters(per_sequence_mapping([None, None, "fresh", None], 16))
    with_fresh = _logits(s, 16)
    s["meta"].set_token_adapters(per_sequence_mapping([None] * 4, 16))
    base = _logits(s, 16)
    assert xla_compiles() == before
    assert torch.equal(with_fresh[[0, 1, 3]], base[[0, 1, 3]])
    assert (with_fresh[2] - base[2]).abs().max().item() > 1e-3


def test_mapping_mixed_within_rows_switches_to_the_sorted_kernel_once(served):
    s = served
    n = 16
    # Row 0 switches adapter at position 8: causal attention means positions < 8 see only "sql"
    # tokens, so they equal the all-"sql" row; positions >= 8 alternate "chat" and "code" with an "sql"
    # prefix (three adapters in one block of 32 tokens: not a segment layout either).
    # Check the exact parts against eager PEFT, and the whole against the masked kernel run alone (the
    # sorted kernel runs it: 64 tokens over 4 slots are worth sorting, kernels.sorted_fits).
    mixed = per_sequence_mapping(ROWS, n)
    mixed[8:16] = ["chat", "code"] * 4
    s["meta"].set_token_adapters(mixed)
    got = _logits(s, n)
    per_row = eager_reference(s["cpu"], s["ids"][:, :n], ROWS)
    assert (got[1:] - per_row[1:]).abs().max().item() < 1e-4  # rows 1-3 are per-row
    assert (got[0, :8] - per_row[0, :8]).abs().max().item() < 1e-4  # the "sql" prefix of row 0
    assert (got[0, 8:] - per_row[0, 8:]).abs().max().item() > 1e-3  # ...and its "chat" tail differs
    graph = next(g for g in s["backend"].graphs if "sorted" in g.variants)
    mixed_graph = graph.variants["sorted"]
    assert "masked" not in graph.variants
    assert mixed_graph.kernels == {"sorted"} and mixed_graph.report.counts() == graph.report.counts()
    # The masked rewrite of the same graph, run on its own through a fresh masked-kernel backend.
    saved = xlp.config.kernel
    try:
        xlp.config.kernel = "masked"
        torch._dynamo.reset()
        meta2 = xlp.LoRAMetadata(max_num_tokens=256, max_slots=4)
        meta2.register_adapters(s["compiled"]._orig_mod)
        only_masked = torch.compile(s["compiled"]._orig_mod, backend=xlp.make_backend(meta2))
        meta2.set_token_adapters(mixed)
        with torch.no_grad():
            want = only_masked(input_ids=s["ids"][:, :n].to(s["device"])).logits.cpu()
    finally:
        xlp.config.kernel = saved
        torch._dynamo.reset()
    assert (got - want).abs().max().item() < 1e-5


def test_cpu_scheduler_flag_is_set_only_when_it_can_act(monkeypatch):
    flag = xla_cpu_flags.SCHEDULER_FLAG
    monkeypatch.setattr(xla_cpu_flags, "runtime_started", lambda: False)
    monkeypatch.setenv("PJRT_DEVICE", "CPU")
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/x")
    assert xla_cpu_flags.set_cpu_scheduler_flag() == "set"
    assert os.environ["XLA_FLAGS"] == f"--xla_dump_to=/tmp/x {flag}=false"
    monkeypatch.setenv("XLA_FLAGS", f"{flag}=true")
    assert xla_cpu_flags.set_cpu_scheduler_flag() == "set by the user"
    assert os.environ["XLA_FLAGS"] == f"{flag}=true"
    monkeypatch.setenv("XLA_FLAGS", "")
    monkeypatch.setenv("PJRT_DEVICE", "TPU")
    assert xla_cpu_flags.set_cpu_scheduler_flag() == "not on the CPU" and os.environ["XLA_FLAGS"] == ""
    monkeypatch.setenv("PJRT_DEVICE", "CPU")
    monkeypatch.setattr(xla_cpu_flags, "runtime_started", lambda: True)
    assert xla_cpu_flags.set_cpu_scheduler_flag().startswith("too late") and os.environ["XLA_FLAGS"] == ""


def test_this_test_process_runs_with_the_depth_first_scheduler():
    """conftest sets PJRT_DEVICE=CPU and the package is imported before any device use."""
    assert xla_cpu_flags.CPU_SCHEDULER_STATUS in ("set", "set by the user"), xla_cpu_flags.CPU_SCHEDULER_STATUS
    assert xla_cpu_flags.scheduler_flag_in_effect() or "=true" in os.environ.get("XLA_FLAGS", "")
