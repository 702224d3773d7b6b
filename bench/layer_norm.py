"""LayerNorm's two lowerings side by side: torch_xla's kernel against torch's decomposition.

    python bench/layer_norm.py [--tokens 512] [--dim 512] [--layers 8] [--reps 7]

xla_lora_pass/runtimes/xla_layer_norm.py sends ``layer_norm`` calls with symbolic
sizes (Dynamo's shape propagation) to torch's decomposition and every other
call to torch_xla's kernel.  This measures what that choice is worth: the
same model, ``layers`` x (LayerNorm -> Linear -> GELU), fp32 and bf16,
compiled with plain ``openxla`` on static shapes two ways:

* native: ``nn.LayerNorm`` (torch_xla's kernel; what every compiled program
  and eager call gets, with or without the package);
* decomposed: the same weights through torch's decomposition of
  ``native_layer_norm`` (what every program would run if the decomposition
  replaced the kernel for all calls).

Each repetition runs both in turn; the ratio is within one repetition.
"""
from __future__ import annotations

import argparse

import _common  # noqa: F401  (sets PJRT_DEVICE before torch_xla loads)
import torch
import torch.nn as nn
from _common import markdown_table
from _timing import ratios, summary, time_interleaved


class Blocks(nn.Module):
    def __init__(self, dim: int, layers: int, decomposed: bool):
        super().__init__()
        self.norms = nn.ModuleList(nn.LayerNorm(dim) for _ in range(layers))
        self.linears = nn.ModuleList(nn.Linear(dim, dim) for _ in range(layers))
        self.decomposed = decomposed

    def forward(self, x):
        from torch._decomp import decomposition_table

        decomposition = decomposition_table[torch.ops.aten.native_layer_norm.default]
        for norm, linear in zip(self.norms, self.linears):
            if self.decomposed:
                h = decomposition(x, norm.normalized_shape, norm.weight, norm.bias, norm.eps)[0]
            else:
                h = norm(x)
            x = x + torch.nn.functional.gelu(linear(h))
        return x


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--steps", type=int, default=10, help="calls per form per repetition")
    args = parser.parse_args(argv)

    import torch_xla

    import xla_lora_pass  # noqa: F401  (XLA:CPU scheduler flag, as the package runs)

    dev = torch_xla.device()
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        torch.manual_seed(0)
        native = Blocks(args.dim, args.layers, decomposed=False).to(dtype)
        decomposed = Blocks(args.dim, args.layers, decomposed=True).to(dtype)
        decomposed.load_state_dict(native.state_dict())
        x = torch.randn(args.tokens, args.dim).to(dtype).to(dev)
        fns, outs = {}, {}
        for name, model in (("native", native), ("decomposed", decomposed)):
            compiled = torch.compile(model.to(dev).eval(), backend="openxla")

            def run(compiled=compiled):
                with torch.no_grad():
                    return compiled(x).cpu()

            outs[name] = run()  # compile outside the timing
            fns[name] = run
        diff = (outs["native"].float() - outs["decomposed"].float()).abs().max().item()
        times = time_interleaved(fns, args.reps, args.steps)
        rel = ratios(times, "native")
        native_ms = sorted(times["native"])[len(times["native"]) // 2] * 1e3
        rows.append([str(dtype).replace("torch.", ""), f"{native_ms:.2f}", summary(rel["decomposed"]),
                     f"{diff:.2g}"])
    print(f"{args.layers} x (LayerNorm -> Linear -> GELU), hidden {args.dim}, {args.tokens} tokens, openxla, "
          f"static shapes; median [min-max] of {args.reps} interleaved repetitions\n")
    print(markdown_table(["dtype", "native ms", "decomposed / native", "max |native - decomposed|"], rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
