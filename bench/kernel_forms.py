"""Op-level: one LoRA linear with a mixed batch, each BGMV form against the base matmul.

    python bench/kernel_forms.py [--tokens 512] [--slots 16] [--rank 16] [--dim 512] [--reps 7]

One 512x512 linear, 512 tokens spread over 16 adapters at random, r=16, fp32,
every form compiled with plain ``openxla`` on the XLA CPU device:

* base: ``x @ W.T`` (the floor);
* masked: base + ``torch.ops.xla_lora.bgmv_shrink`` / ``bgmv_expand`` (kernels/masked.py, what the pass emits);
* rows: base + ``bgmv_shrink_rows`` / ``bgmv_expand_rows`` (kernels/rows.py, the default kernel) for the
  per-request case: the tokens as 16 rows of T/16, row i on adapter i mod N;
* segments: base + ``bgmv_shrink_segments`` / ``bgmv_expand_segments`` (kernels/segments.py) for the same
  tokens packed as 16 requests of T/16 in one row (blocks of ``config.segment_block_tokens`` with
  ``config.segment_slots_per_block`` passes), the layout already on the device;
* sorted: base + ``bgmv_shrink_sorted`` / ``bgmv_expand_sorted`` (kernels/sorted_tokens.py) for the random mix
  itself, tokens ordered by slot into blocks of BS (``--sorted-blocks``), the layout already on the device.

Each repetition runs every form in turn; the ratios are within one repetition.
"""
from __future__ import annotations

import argparse
import time

import _common  # noqa: F401  (sets PJRT_DEVICE before torch_xla loads)
import torch
from _common import markdown_table
from _timing import ratios, summary, time_interleaved


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--slots", type=int, default=16)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--steps", type=int, default=20, help="calls per form per repetition")
    parser.add_argument("--sorted-blocks", default="8,16,32", help="block sizes of the sorted kernel")
    args = parser.parse_args(argv)

    import torch_xla
    import torch_xla.core.xla_model as xm

    import xla_lora_pass  # noqa: F401  (registers torch.ops.xla_lora)
    from xla_lora_pass import config
    from xla_lora_pass.kernels.segments import build_segment_layout
    from xla_lora_pass.kernels.sorted_tokens import build_sorted_layout

    dev = torch_xla.device()
    g = torch.Generator().manual_seed(0)
    t, n, r, d = args.tokens, args.slots, args.rank, args.dim
    x = torch.randn(t, d, generator=g).to(dev)
    w = (torch.randn(d, d, generator=g) / d ** 0.5).to(dev)
    a = (torch.randn(n, r, d, generator=g) / d ** 0.5).to(dev)
    b = (torch.randn(n, d, r, generator=g) / r ** 0.5).to(dev)
    idx_host = torch.randint(0, n, (t,), generator=g, dtype=torch.int32)
    idx = idx_host.to(dev)

    def base(x, w):
        return x @ w.t()

    def masked(x, w, a, b, idx):
        y = x @ w.t()
        s = torch.ops.xla_lora.bgmv_shrink(x, a, idx, 1.0)
        return torch.ops.xla_lora.bgmv_expand(s, b, y, idx, True)

    def rows(x, w, a, b, row_slots):
        y = x @ w.t()
        s = torch.ops.xla_lora.bgmv_shrink_rows(x, a, row_slots, 1.0)
        return torch.ops.xla_lora.bgmv_expand_rows(s, b, y, row_slots, True)

    row_slots_host = torch.arange(16, dtype=torch.int32) % n
    row_slots = row_slots_host.to(dev)
    a_t, b_t = a.transpose(1, 2).contiguous(), b.transpose(1, 2).contiguous()  # the row kernel's layout
    def segments(x, w, a, b, block_slots, pick):
        y = x @ w.t()
        s = torch.ops.xla_lora.bgmv_shrink_segments(x, a, block_slots, pick, 1.0)
        return torch.ops.xla_lora.bgmv_expand_segments(s, b, y, block_slots, pick, True)

    seg_idx = row_slots_host.repeat_interleave(t // 16)
    seg_layout = [v.to(dev) for v in build_segment_layout(seg_idx, config.segment_block_tokens,
                                                          config.segment_slots_per_block)]
    c_segments = torch.compile(segments, backend="openxla")

    def sorted_(x, w, a, b, gather, block_slots, inverse):
        y = x @ w.t()
        s = torch.ops.xla_lora.bgmv_shrink_sorted(x, a, gather, block_slots, inverse, 1.0)
        return torch.ops.xla_lora.bgmv_expand_sorted(s, b, y, gather, block_slots, inverse, True)

    c_sorted = torch.compile(sorted_, backend="openxla")
    sorted_sizes = [int(v) for v in args.sorted_blocks.split(",") if v]
    sorted_layouts = {bs: [v.to(dev) for v in build_sorted_layout(idx_host, bs, n + 1)] for bs in sorted_sizes}
    c_rows = torch.compile(rows, backend="openxla")
    c_base = torch.compile(base, backend="openxla")
    c_masked = torch.compile(masked, backend="openxla")

    # Correctness first: the forms agree with each other.
    with torch.no_grad():
        ref = c_masked(x, w, a, b, idx).cpu()
        got_rows = c_rows(x, w, a_t, b_t, row_slots).cpu()
        ref_rows = c_masked(x, w, a, b, row_slots_host.repeat_interleave(t // 16).to(dev)).cpu()
        torch.testing.assert_close(got_rows, ref_rows, atol=1e-3, rtol=1e-4)
        got_segments = c_segments(x, w, a_t, b_t, *seg_layout).cpu()
        torch.testing.assert_close(got_segments, ref_rows, atol=1e-3, rtol=1e-4)
        for layout in sorted_layouts.values():
            torch.testing.assert_close(c_sorted(x, w, a_t, b_t, *layout).cpu(), ref, atol=1e-3, rtol=1e-4)

    def run(fn, *inputs):
        def call():
            with torch.no_grad():
                fn(*inputs)
            xm.wait_device_ops()
        return call

    fns = {
        "base matmul": run(c_base, x, w),
        "masked (kernels/masked.py)": run(c_masked, x, w, a, b, idx),
        "rows (kernels/rows.py), one adapter per row of 16": run(c_rows, x, w, a_t, b_t, row_slots),
        f"segments (kernels/segments.py), 16 requests of {t // 16} in one row": run(c_segments, x, w, a_t, b_t,
                                                                                *seg_layout),
    }
    for bs, layout in sorted_layouts.items():
        fns[f"sorted (kernels/sorted_tokens.py), blocks of {bs}, the random mix"] = run(c_sorted, x, w, a_t, b_t,
                                                                                          *layout)
    for fn in fns.values():  # warm up: compile and settle
        for _ in range(3):
            fn()
    times = time_interleaved(fns, args.reps, args.steps)
    rat = ratios(times, "base matmul")

    start = time.perf_counter()
    for _ in range(50):
        build_segment_layout(seg_idx, config.segment_block_tokens, config.segment_slots_per_block)
    host_ms = (time.perf_counter() - start) / 50 * 1e3

    print(f"One {d}x{d} linear, {t} tokens over {n} adapters (random), r={r}, fp32, openxla on the XLA CPU "
          f"device; {args.reps} repetitions x {args.steps} calls, ratio to the base matmul within each "
          f"repetition, median [min-max].\n")
    rows = [[name, f"{sorted(ts)[len(ts) // 2] * 1e3:.3f}", summary(rat[name])] for name, ts in times.items()]
    print(markdown_table(["form", "ms / call (median)", "time / base"], rows))
    print(f"\nbuild_segment_layout on the host alone: {host_ms:.3f} ms per step ({t} tokens, 16 segments).")
    for bs in sorted_sizes:
        start = time.perf_counter()
        for _ in range(50):
            build_sorted_layout(idx_host, bs, n + 1)
        print(f"build_sorted_layout on the host alone, blocks of {bs}: "
              f"{(time.perf_counter() - start) / 50 * 1e3:.3f} ms per step ({t} tokens, random mix).")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
