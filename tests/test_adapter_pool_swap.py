"""A swap into the stacks a graph sent is one transfer call and one program (XLA), from rows staged by prefetch or
read from the host stacks, and leaves every device copy equal to the host stacks."""
import pytest
import torch

import xla_lora_pass as xlp
from xla_lora_pass.demo_models import eager_reference, tiny_peft_llama

from .test_adapter_pool import ALL_LINEAR

RANKS = (2, 8, 4, 3)  # rank 3 sends a bucket of 4 rows


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A Llama holding ad0 (rank 8 at every site) and four saved adapters of ranks 2, 8, 4, 3."""
    served, _ = tiny_peft_llama(targets=ALL_LINEAR, adapters=(("ad0", 8, 16),))
    root = tmp_path_factory.mktemp("swap")
    gen = torch.Generator().manual_seed(1)
    for i, rank in enumerate(RANKS, start=1):
        template, _ = tiny_peft_llama(targets=ALL_LINEAR, adapters=(("default", rank, 2 * rank),))
        with torch.no_grad():
            for n, p in template.named_parameters():
                if ".lora_A." in n or ".lora_B." in n:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
        template.save_pretrained(str(root / f"ad{i}"))
    return served, root


def _metric_count(name: str) -> int:
    import torch_xla.debug.metrics as met

    data = met.metric_data(name)
    return 0 if data is None else int(data[0])


def _copies_equal_host(meta):
    for (site, role, _), copy_ in meta.device_copies().items():
        names = site if isinstance(site, tuple) else (site,)
        host = (torch.cat([meta.host_stacks(n)[0] for n in names], 1) if role.startswith("A")
                else meta.host_stacks(site)[1])
        assert torch.equal(copy_.cpu(), host.transpose(1, 2) if role.endswith("_T") else host), (site, role)


@pytest.mark.parametrize("prefetched", [True, False], ids=["staged", "from_host_stacks"])
def test_a_swap_is_one_transfer_and_one_program_and_exact(saved, xla_device, prefetched):
    import copy

    import torch_xla.core.xla_model as xm
    import torch_xla.debug.metrics as met

    from .xla_utils import xla_compiles

    torch._dynamo.reset()
    served, root = saved
    reference = copy.deepcopy(served)
    model = copy.deepcopy(served).to(xla_device)
    meta = xlp.LoRAMetadata(max_num_tokens=32, max_slots=2)
    meta.register_adapters(model)
    for i in range(1, len(RANKS) + 1):
        meta.add_adapter(f"ad{i}", root / f"ad{i}")
    compiled = torch.compile(model, backend=xlp.make_backend(meta))
    ids = torch.randint(0, 128, (2, 6), generator=torch.Generator().manual_seed(0))
    meta.set_request_adapters(["ad0", "ad0"])
    with torch.no_grad():
        compiled(input_ids=ids.to(xla_device)).logits.cpu()  # the graph's programs and the swap's
    compiles = xla_compiles()
    for i in range(1, len(RANKS) + 1):
        name = f"ad{i}"
        if prefetched:
            meta.prefetch([name], wait=True)
        xm.wait_device_ops()
        executions, transfers = _metric_count("ExecuteTime"), _metric_count("TransferToDeviceTime")
        lookups = met.counter_value("CachedCompile") or 0
        meta.set_request_adapters([name, "ad0"])  # evicts the other adapter's slot
        xm.wait_device_ops()  # an execution is counted when it ends (the swap does not wait for it)
        assert _metric_count("ExecuteTime") - executions == 1, name
        # Run as the program compiled at warm-up: no op traced again and looked up in XLA's program cache.
        assert (met.counter_value("CachedCompile") or 0) == lookups, name
        assert _metric_count("TransferToDeviceTime") - transfers <= 1, name  # 0 where nothing is new but rows
        with torch.no_grad():
            out = compiled(input_ids=ids.to(xla_device)).logits.cpu()
        reference.load_adapter(str(root / name), adapter_name=name)
        assert (out - eager_reference(reference, ids, [name, "ad0"])).abs().max().item() < 1e-4, name
        _copies_equal_host(meta)
    assert xla_compiles() == compiles


def test_staged_swaps_on_the_cpu_equal_the_host_stacks(saved):
    """The generic runtime writes every sent stack from one buffer too (no programs): staged and unstaged
    swaps leave the copies equal to the host stacks and the output equal to PEFT's."""
    import copy

    torch._dynamo.reset()
    served, root = saved
    reference = copy.deepcopy(served)
    model = copy.deepcopy(served)
    meta = xlp.LoRAMetadata(max_num_tokens=32, max_slots=2)
    meta.register_adapters(model)
    for i in range(1, len(RANKS) + 1):
        meta.add_adapter(f"ad{i}", root / f"ad{i}")
    compiled = torch.compile(model, backend=xlp.make_backend(meta, inner="aot_eager"))
    ids = torch.randint(0, 128, (2, 6), generator=torch.Generator().manual_seed(0))
    meta.set_request_adapters(["ad0", "ad0"])
    with torch.no_grad():
        compiled(input_ids=ids)
    for i in range(1, len(RANKS) + 1):
        name = f"ad{i}"
        if i % 2:
            meta.prefetch([name], wait=True)
        meta.set_request_adapters([name, "ad0"])
        with torch.no_grad():
            out = compiled(input_ids=ids).logits
        reference.load_adapter(str(root / name), adapter_name=name)
        assert (out - eager_reference(reference, ids, [name, "ad0"])).abs().max().item() < 1e-4, name
        _copies_equal_host(meta)


@pytest.fixture(scope="module")
def saved_batch(tmp_path_factory):
    """ad0 (rank 8) in the model, and saved: r1..r6 of rank 8 (the sites' full rank), s1 of rank 2."""
    served, _ = tiny_peft_llama(targets=ALL_LINEAR, adapters=(("ad0", 8, 16),))
    root = tmp_path_factory.mktemp("swap_batch")
    gen = torch.Generator().manual_seed(2)
    for name, rank in [(f"r{i}", 8) for i in range(1, 7)] + [("s1", 2)]:
        template, _ = tiny_peft_llama(targets=ALL_LINEAR, adapters=(("default", rank, 2 * rank),))
        with torch.no_grad():
            for n, p in template.named_parameters():
                if ".lora_A." in n or ".lora_B." in n:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
        template.save_pretrained(str(root / name))
    return served, root


def test_a_mappings_swaps_of_one_shape_are_one_program(saved_batch, device, inner):
    """The adapters one mapping brings in are written together: those of the sites' full rank by one program on
    XLA (4 into free slots; 2 evicting others), prefetched or not; an adapter of a lower rank by a program of its
    own.  Exact against PEFT at every step, every copy equal to the host stacks, and nothing compiled after the
    first call (the programs for several slots are compiled when the first adapter is added beyond the slots)."""
    import copy

    torch._dynamo.reset()
    served, root = saved_batch
    reference = copy.deepcopy(served)
    for name in ["s1"] + [f"r{i}" for i in range(1, 7)]:
        reference.load_adapter(str(root / name), adapter_name=name)
    model = copy.deepcopy(served).to(device)
    meta = xlp.LoRAMetadata(max_num_tokens=32, max_slots=5)
    meta.register_adapters(model)
    for name in ["s1"] + [f"r{i}" for i in range(1, 7)]:
        meta.add_adapter(name, root / name)
    compiled = torch.compile(model, backend=xlp.make_backend(meta, inner=inner))
    ids = torch.randint(0, 128, (4, 6), generator=torch.Generator().manual_seed(0))
    meta.set_request_adapters(["ad0"] * 4)
    with torch.no_grad():
        compiled(input_ids=ids.to(device)).logits.cpu()
    on_xla = device.type == "xla"
    if on_xla:
        import torch_xla.core.xla_model as xm

        from .xla_utils import xla_compiles
        compiles = xla_compiles()
    # (mapping, prefetched, loads, programs): 4 misses into free slots; 2 misses evicting ad0 and r1 beside 2
    # resident; a rank-8 and a rank-2 miss beside a resident adapter.
    for rows, prefetched, loaded, programs in [(["r1", "r2", "r3", "r4"], False, 4, 1),
                                               (["r5", "r6", "r3", "r4"], True, 2, 1),
                                               (["r1", "s1", "r5", "r6"], False, 2, 2)]:
        if prefetched:
            meta.prefetch(rows, wait=True)
        loads = meta.stats["loads"]
        if on_xla:
            xm.wait_device_ops()
            executions = _metric_count("ExecuteTime")
        meta.set_request_adapters(rows)
        assert meta.stats["loads"] - loads == loaded, rows
        if on_xla:
            xm.wait_device_ops()
            assert _metric_count("ExecuteTime") - executions == programs, rows
        with torch.no_grad():
            out = compiled(input_ids=ids.to(device)).logits.cpu()
        assert (out - eager_reference(reference, ids, rows)).abs().max().item() < 1e-4, rows
        _copies_equal_host(meta)
    if on_xla:
        assert xla_compiles() == compiles
