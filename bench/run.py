"""All the multi-LoRA benchmarks in one run: markdown tables on stdout, a PNG plot, bench/out/.

    python bench/run.py            # full: 1, 4, 16 adapters x 64..512 tokens, 2..32 layers (~30 min on 2 cores)
    python bench/run.py --quick    # 16 adapters x 512 tokens, 2..8 layers, 3 reps (a few minutes)

Every figure is a ratio measured side by side in the same run (interleaved
repetitions, median [min-max]); every part runs in fresh processes
(bench/_timing.run_child) so XLA's program cache never carries over.

Parts: step time (bench/step_time.py), decode and prefill steps and a full
``generate`` with a static cache (bench/decode_step.py; ``--decode-only`` runs
that part alone), the pass's own time against graph size
(bench/pass_time.py), the BGMV kernel forms on one linear (bench/kernel_forms.py),
and compiles for a serving stream (bench/recompiles.py, with --recompiles).
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import _common  # noqa: F401
from _common import markdown_table
from _timing import BENCH_DIR, OUT_DIR, run_child, summary

PEFT_EAGER_OVERHEAD_ISSUE = 1.23  # the issue's figure: PEFT eager mixed = 2.23x its own eager base
TARGET_STEP, TARGET_OVERHEAD_SHARE = 1.3, 0.25


def step_tables(rows):
    out = []
    for block in rows:
        n = block["adapters"]
        table = []
        for r in block["results"]:
            rb, re_ = r["ratio_vs_base"], r["ratio_vs_eager"]
            base_ms = statistics.median(r["times"]["base, openxla"]) * 1e3
            table.append([r["tokens"], f"{base_ms:.1f}", summary(rb["merged 1 adapter, openxla"]),
                          summary(rb["xla_lora"]), summary(rb["xla_lora, masked kernel"]),
                          summary(rb["xla_lora, mixed within sequences"]), summary(rb["PEFT openxla, per adapter"]),
                          summary(re_["PEFT eager mixed (CPU)"]), summary(rb["base eager (CPU)"])])
        out.append(f"**{n} adapter(s)** (16 sequences, sequence i on adapter i mod {n}); columns are time / "
                   "`base, openxla` except *PEFT eager mixed*, which is time / its own eager base:\n\n" +
                   markdown_table(["tokens", "base openxla ms", "merged 1 adapter", "**xla_lora** (row kernel)",
                                   "xla_lora, masked kernel", "xla_lora, adapters mixed within sequences",
                                   "PEFT openxla per adapter", "PEFT eager mixed / eager base",
                                   "eager base / base openxla"], table))
    return "\n\n".join(out)


def target_table(rows):
    table, met = [], True
    for block in rows:
        if block["adapters"] != 16:
            continue
        for r in block["results"]:
            ours = r["ratio_vs_base"]["xla_lora"]
            peft = r["ratio_vs_eager"]["PEFT eager mixed (CPU)"]
            share = [(o - 1) / (p - 1) for o, p in zip(ours, peft)]
            med_ours, med_share = statistics.median(ours), statistics.median(share)
            share_issue = (med_ours - 1) / PEFT_EAGER_OVERHEAD_ISSUE
            ok1, ok2 = med_ours <= TARGET_STEP, med_share <= TARGET_OVERHEAD_SHARE
            met = met and ok1 and ok2
            table.append([r["tokens"], summary(ours), "met" if ok1 else "NOT met", summary(share),
                          f"{share_issue:.2f}", "met" if ok2 else "NOT met"])
    text = markdown_table(["tokens", "xla_lora / base (target <= 1.3)", "",
                           "overhead / PEFT eager overhead, same run (target <= 0.25)",
                           "overhead / 1.23 (issue's PEFT figure)", ""], table)
    return text, met


TARGET_DECODE, TARGET_PREFILL, GOAL_DECODE = 1.15, 1.15, 1.05


def decode_tables(blocks):
    """Decode-step, prefill-step and generate tables (bench/decode_step.py), one row per (adapters, batch)."""
    decode, prefill, generate, targets = [], [], [], []
    for block in blocks:
        for r in block["results"]:
            n, b = r["adapters"], r["batch"]
            extra = [k for k in r["decode_ratio"] if k not in ("base, openxla", "xla_lora")]
            base_ms = statistics.median(r["decode"]["base, openxla"]) * 1e3
            decode.append([n, b, f"{base_ms:.1f}", summary(r["decode_ratio"]["xla_lora"])]
                          + [summary(r["decode_ratio"][k]) for k in extra])
            if r["prefill_ratio"]:
                pms = statistics.median(r["prefill"]["base, openxla"]) * 1e3
                row = [n, b, f"{pms:.0f}", summary(r["prefill_ratio"]["xla_lora"])]
                if r.get("prompt_ratio"):  # generate's prompt step: the last position's logits only
                    qms = statistics.median(r["prompt_step"]["base, openxla"]) * 1e3
                    row += [f"{qms:.0f}", summary(r["prompt_ratio"]["xla_lora"])]
                prefill.append(row)
            g = r.get("generate")
            if g:
                tps = g["tokens_per_s"]
                generate.append([n, b, g["new_tokens"], f"{tps['base, openxla']:.0f}", f"{tps['xla_lora']:.0f}",
                                 summary(g["ratio"]["xla_lora"])])
            if n == 16:
                med = statistics.median(r["decode_ratio"]["xla_lora"])
                row = [b, summary(r["decode_ratio"]["xla_lora"]),
                       "met" if med <= TARGET_DECODE else "NOT met", "met" if med <= GOAL_DECODE else "not met"]
                if r["prefill_ratio"]:
                    pmed = statistics.median(r["prefill_ratio"]["xla_lora"])
                    row += [summary(r["prefill_ratio"]["xla_lora"]), "met" if pmed <= TARGET_PREFILL else "NOT met"]
                targets.append(row)
    extra = [k for k in blocks[0]["results"][0]["decode_ratio"] if k not in ("base, openxla", "xla_lora")]
    parts = ["### Decode step (`[B, 1]` at the next static-cache position)\n\nColumns are time / `base, openxla`, "
             "median [min-max].\n\n" +
             markdown_table(["adapters", "batch", "base openxla ms", "**xla_lora**"] + extra, decode)]
    if prefill:
        head = ["adapters", "batch", "base openxla ms", "**xla_lora** / base"]
        if len(prefill[0]) > len(head):
            head += ["prompt step: base openxla ms", "**xla_lora** / base"]
        parts.append(f"### Prefill step (`[B, {blocks[0]['results'][0]['prompt']}]` into the static cache; the prompt "
                     "step is the same forward with `logits_to_keep=1`, as `generate` runs it)\n\n" +
                     markdown_table(head, prefill))
    if generate:
        parts.append("### Full `generate` (greedy, static cache of the same length on both sides)\n\n" +
                     markdown_table(["adapters", "batch", "new tokens", "base tokens/s", "xla_lora tokens/s",
                                     "xla_lora time / base"], generate))
    if targets:
        head = ["batch", f"decode / base (target <= {TARGET_DECODE})", "", f"goal <= {GOAL_DECODE}"]
        if prefill:
            head += [f"prefill / base (target <= {TARGET_PREFILL})", ""]
        parts.append("### Targets (16 adapters, one per row)\n\n" + markdown_table(head, targets))
    return "\n\n".join(parts)


def pass_table(rows):
    import numpy as np

    layers = np.array([r["layers"] for r in rows], dtype=float)
    rew = np.array([r["rewrite_s"] for r in rows])
    slope, icept = np.polyfit(layers, rew, 1)
    pred = slope * layers + icept
    r2 = 1 - ((rew - pred) ** 2).sum() / max(((rew - rew.mean()) ** 2).sum(), 1e-30)
    table = [[r["layers"], r["fx_nodes"], r["sites"] if r["sites"] is not None else "-",
              f"{r['rewrite_s'] * 1e3:.0f} [{min(r['rewrite_runs']) * 1e3:.0f}-{max(r['rewrite_runs']) * 1e3:.0f}]",
              f"{r['rewrite_s'] / r['layers'] * 1e3:.1f}",
              f"{r['rewrite_in_backend_s'] * 1e3:.0f}", f"{r['xla_compile_s']:.1f}", f"{r['first_call_s']:.1f}",
              f"{100 * r['rewrite_in_backend_s'] / r['xla_compile_s']:.1f}%",
              f"{100 * r['rewrite_in_backend_s'] / r['first_call_s']:.1f}%"] for r in rows]
    text = markdown_table(["layers", "FX nodes", "sites", "rewrite ms, median [min-max]", "ms / layer",
                           "rewrite ms in the compile", "XLA compile s", "first call s",
                           "pass / XLA compile", "pass / first call"], table)
    text += (f"\n\nLinear fit of the pass alone: {slope * 1e3:.1f} ms per layer + {icept * 1e3:.0f} ms "
             f"(R^2 = {r2:.3f}).")
    return text, (layers, rew, slope, icept)


def plot(step_rows, fit, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not importable: no plot (pip install matplotlib)", file=sys.stderr)
        return None
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    ax = axes[0]
    for block in step_rows:
        toks = [r["tokens"] for r in block["results"]]
        for key, style in [("xla_lora", "-o"), ("PEFT openxla, per adapter", "--s")]:
            med = [statistics.median(r["ratio_vs_base"][key]) for r in block["results"]]
            lo = [min(r["ratio_vs_base"][key]) for r in block["results"]]
            hi = [max(r["ratio_vs_base"][key]) for r in block["results"]]
            ax.errorbar(toks, med, yerr=[[m - l for m, l in zip(med, lo)], [h - m for m, h in zip(med, hi)]],
                        fmt=style, capsize=3, label=f"{key}, {block['adapters']} adapters")
        med = [statistics.median(r["ratio_vs_eager"]["PEFT eager mixed (CPU)"]) for r in block["results"]]
        ax.plot(toks, med, ":^", label=f"PEFT eager mixed / eager base, {block['adapters']} adapters")
    ax.axhline(TARGET_STEP, color="k", lw=0.8, ls="--", label="target 1.3x")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens per step")
    ax.set_ylabel("step time / base model, openxla")
    ax.set_title("Mixed multi-LoRA batch (hidden 512, 4 layers, r=16)")
    ax.legend(fontsize=7)
    layers, rew, slope, icept = fit
    ax = axes[1]
    ax.plot(layers, rew * 1e3, "o", label="xla_lora_pass.rewrite (median)")
    ax.plot(layers, (slope * layers + icept) * 1e3, "-", label=f"fit: {slope * 1e3:.1f} ms / layer")
    ax.set_xlabel("decoder layers")
    ax.set_ylabel("pass time, ms")
    ax.set_title("The pass's own time against graph size")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--adapters", help="comma list (default 1,4,16; --quick 16)")
    parser.add_argument("--tokens", help="comma list (default 64,128,256,512; --quick 512)")
    parser.add_argument("--layers", help="comma list for the pass timing (default 2,4,8,16,32; --quick 2,4,8)")
    parser.add_argument("--reps", type=int, help="repetitions (default 7; --quick 3)")
    parser.add_argument("--decode-batch", default="1,8,32",
                        help="batch sizes of the decode/prefill/generate part (bench/decode_step.py); '' skips it")
    parser.add_argument("--decode-only", action="store_true", help="run only the decode/prefill/generate part")
    parser.add_argument("--recompiles", action="store_true",
                        help="also run bench/recompiles.py --max-tokens 64 (a serving stream's compiles)")
    args = parser.parse_args(argv)
    adapters = args.adapters or ("16" if args.quick else "1,4,16")
    tokens = args.tokens or ("512" if args.quick else "64,128,256,512")
    layers = args.layers or ("2,4,8" if args.quick else "2,4,8,16,32")
    reps = args.reps or (3 if args.quick else 7)
    os.makedirs(OUT_DIR, exist_ok=True)
    t0 = time.perf_counter()

    print("running (each part in a fresh process):", file=sys.stderr)
    decode_blocks = [run_child("decode_step.py", ["--adapters", n, "--batch", args.decode_batch, "--reps", str(reps),
                                                  "--masked"], f"decode and prefill, {n} adapters")
                     for n in adapters.split(",")] if args.decode_batch else []
    decode_section = (
        "## Decoding and prefill with a static cache (bench/decode_step.py)\n\nThe same model; B sequences, "
        "sequence i on adapter i mod N, `meta.set_request_adapters` once per batch; HF `StaticCache`; every "
        "step ends with `logits.cpu()`.\n\n" + decode_tables(decode_blocks)) if decode_blocks else None
    if args.decode_only:
        text = (f"# Benchmark run: `python bench/run.py {' '.join(argv if argv is not None else sys.argv[1:])}`"
                f"\n\nMachine: {os.cpu_count()}-core CPU shared with other jobs, XLA on the CPU, fp32. {reps} "
                f"repetitions; ratios within one repetition, median [min-max]. Total run "
                f"{time.perf_counter() - t0:.0f} s.\n\n" + (decode_section or "") + "\n")
        print(text)
        with open(os.path.join(OUT_DIR, "decode.md"), "w") as f:
            f.write(text)
        return 0
    step_rows = [run_child("step_time.py", ["--adapters", n, "--tokens", tokens, "--reps", str(reps)],
                           f"step time, {n} adapters") for n in adapters.split(",")]
    pass_rows = [run_child("pass_time.py", ["--layers", L, "--reps", str(max(reps, 3))], f"pass time, {L} layers")
                 for L in layers.split(",")]
    # The same step with XLA:CPU's own (breadth-first) scheduler, which xla_lora_pass turns off on import.
    default_sched = run_child("step_time.py", ["--adapters", "16", "--tokens", "512", "--reps", str(reps)],
                              "step time, XLA's default scheduler",
                              env={"XLA_FLAGS": "--xla_cpu_enable_concurrency_optimized_scheduler=true"})
    kernels = subprocess.run([sys.executable, os.path.join(BENCH_DIR, "kernel_forms.py"), "--reps", str(reps)],
                             capture_output=True, text=True, check=True).stdout.strip()
    print("  done: kernels", file=sys.stderr)
    recompiles = None
    if args.recompiles:
        recompiles = subprocess.run([sys.executable, os.path.join(BENCH_DIR, "recompiles.py"), "--max-tokens", "64"],
                                    capture_output=True, text=True, check=True).stdout.strip()
        print("  done: recompiles", file=sys.stderr)

    targets, met = target_table(step_rows)
    ptable, fit = pass_table(pass_rows)
    png = plot(step_rows, fit, os.path.join(OUT_DIR, "benchmarks.png"))
    cmd = "python bench/run.py " + " ".join(a for a in (argv if argv is not None else sys.argv[1:]))
    sections = [
        f"# Benchmark run: `{cmd.strip()}`\n\nMachine: {os.cpu_count()}-core CPU shared with other jobs, XLA on the "
        f"CPU (PJRT_DEVICE=CPU), fp32. {reps} repetitions, each running every configuration in rotating order; "
        "every figure is a ratio within one repetition, shown as median [min-max]. Total run "
        f"{time.perf_counter() - t0:.0f} s.",
        "## Step time of one mixed batch\n\nLlama-style model: hidden 512, intermediate 1408, 4 layers, 8 heads, "
        "vocab 4096, random weights; PEFT LoRA r=16 on every linear of the decoder layers (7 per layer). "
        "Steady-state steps only, each ending with `logits.cpu()`.\n\n" + step_tables(step_rows),
        "## Targets (16 adapters)\n\n" + targets + f"\n\nAll targets met: {'yes' if met else 'no'}.",
        *([decode_section] if decode_section else []),
        "## With XLA:CPU's default scheduler\n\nThe same 16-adapter step with "
        "`XLA_FLAGS=--xla_cpu_enable_concurrency_optimized_scheduler=true` (XLA's default, which importing "
        "xla_lora_pass turns off on the CPU; every configuration in this run has it, the base model "
        "included):\n\n" + step_tables([default_sched]),
        "## The pass's own time against graph size\n\nSame model, 4 adapters, 128 tokens; 'first call' is Dynamo "
        "tracing + the pass + XLA compile + one step.\n\n" + ptable,
        "## BGMV forms on one linear (bench/kernel_forms.py)\n\n" + kernels,
    ]
    if recompiles:
        sections.append("## Compiles for a serving stream (bench/recompiles.py --max-tokens 64)\n\n" + recompiles)
    else:
        sections.append("## Compiles for a serving stream\n\nSee `python bench/recompiles.py` (or `bench/run.py "
                        "--recompiles`).")
    if png:
        sections.append(f"Plot: `{os.path.relpath(png, os.path.dirname(BENCH_DIR))}`.")
    text = "\n\n".join(sections) + "\n"
    print(text)
    with open(os.path.join(OUT_DIR, "benchmarks_quick.md" if args.quick else "benchmarks.md"), "w") as f:
        f.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
