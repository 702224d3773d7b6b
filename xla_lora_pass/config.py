"""Every setting of the pass in one place: the defaults, and the ``Settings`` one backend runs with.

``make_backend`` takes a snapshot of these attributes (``snapshot()``, as
vLLM's ``LoRAConfig``): two backends in one process can differ, and nothing
reads this module at call time.  Change an attribute before ``make_backend``
(tests patch them), or pass ``make_backend(meta, settings=config.snapshot(kernel="masked"))``.
``XLA_LORA_DUMP_DIR`` is the only environment variable the package reads.
"""
import dataclasses
import os
import sys
import types
from typing import Mapping, Optional

# Which graph_rewrites passes run (name -> on/off); a missing name is on.  Each
# pattern of graph_rewrites.PATTERNS is switched by its own name here too
# (e.g. "lora_linear": False), and "patterns": False switches them all off.
passes = {
    "normalize": True,
    "patterns": True,
    # Off: a site whose adapters are all inactive (no LoRA branch in the graph) is left as its base op,
    # and the graph then accepts only a uniform mapping; never a wrong batch.
    "lora_attach": True,
    # Off: PEFT modules_to_save run the traced variant only, and the graph accepts only a uniform mapping.
    "saved_modules": True,
    "fuse_shared_shrink": True,
    # Off: a linear on a strided view of its tokens (lm_head on the last position of each row, as
    # generate's prompt step computes it) multiplies by a copy of its weight per row on XLA
    # (graph_rewrites/passes/fold_linear_inputs.py).
    "fold_linear_inputs": True,
}

# When a pass raises on an unexpected graph: True compiles the graph unrewritten
# (counted in stats["fallbacks"], still correct for uniform mappings); False
# re-raises, which tests use to see the failure itself.
fallback_on_error = True

# Write every graph the backend sees under this folder, one subfolder
# compile_NNN per compile: before.py, after.py, report.txt, view.html
# (xla_lora_pass/dump).  None: no files (TORCH_TRACE artifacts are written
# whenever TORCH_TRACE is set, whatever this says).
dump_dir = os.environ.get("XLA_LORA_DUMP_DIR") or None

# The BGMV kernel the pass emits for sites on the graph's token layout: "auto" (the
# default: per call, the first kernel of the table that is exact for the mapping;
# xla_lora_pass/kernels/table.py says how it picks) or one kernel of the table for
# every call ("segments", "sorted", "masked": kernels.table.CHOICES).
kernel = "auto"

# "auto" uses the row kernel only for rows of at least this many (padded)
# tokens; shorter rows run the masked kernel.  1 (default): every row, the
# decode step's [B, 1] graph included, where each row's one token is Punica's
# BGMV case: measured at decode (hidden 512, 4 layers, all-linear r=16, 16
# adapters, static cache), the row kernel cost 1.32x / 0.92x / 1.20x the base
# model at batch 1 / 8 / 32 (medians) where the masked kernel cost 2.2-2.5x /
# 1.0-1.2x / 1.25-1.3x (docs/benchmarks.md).  Raise it to send short rows to the masked kernel.
row_kernel_min_tokens = 1

# The segment kernel (kernels/segments.py): tokens per block, and slots (passes) per block.  With 2 passes every
# segment of at least segment_block_tokens tokens fits at any offset; a mapping with more slots in some block
# runs the sorted kernel (the masked one in small buckets).  Blocks of 32 with 2 passes measured the row kernel's cost on one linear (16
# segments of 32 tokens; docs/benchmarks.md).
segment_block_tokens = 32
segment_slots_per_block = 2

# The sorted kernel (kernels/sorted_tokens.py): tokens per block.  Each slot's tokens are padded to whole blocks, so
# a step computes at most num_slots + 1 blocks more than its tokens fill.  On one 512x512 linear with 512
# tokens mixed at random over 16 adapters, blocks of 16 measured faster than 8 or 32 (docs/benchmarks.md).
sorted_block_tokens = 16


@dataclasses.dataclass(frozen=True)
class Settings:
    """The settings one backend (or one ``rewrite`` call) runs with: the attributes above, read once."""

    passes: Mapping[str, bool]
    fallback_on_error: bool
    dump_dir: Optional[str]
    kernel: str
    row_kernel_min_tokens: int
    segment_block_tokens: int
    segment_slots_per_block: int
    sorted_block_tokens: int


def snapshot(**changes) -> Settings:
    """This module's attributes as they are now, with ``changes`` on top, frozen into one ``Settings``."""
    module = sys.modules[__name__]
    values = {f.name: getattr(module, f.name) for f in dataclasses.fields(Settings)}
    values.update(changes)
    values["passes"] = types.MappingProxyType(dict(values["passes"]))  # a later edit of ``passes`` is not seen
    return Settings(**values)
