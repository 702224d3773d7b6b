"""Every setting of the pass in one place.  Tests patch these attributes.

Read once here, never inside a pass: ``XLA_LORA_DUMP_DIR`` is the only
environment variable the package reads.
"""
import os

# Which graph_rewrites passes run (name -> on/off); a missing name is on.
passes = {
    "normalize": True,
    "lora_embedding": True,
    "lora_bias": True,
    "lora_linear": True,
    "fuse_shared_shrink": True,
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

# torch_xla turns Dynamo's automatic dynamic shapes off when it is imported,
# so every new token count would be a new static graph (and past
# recompile_limit, eager).  Bucketing needs the token dims symbolic, so
# make_backend turns it back on.  Set False to keep torch_xla's choice; then
# pass dynamic=True to torch.compile to get bucketing.
enable_automatic_dynamic_shapes = True

# The BGMV kernel the pass emits for sites on the graph's token layout.
# "masked" multiplies every token by every slot's weights and selects (no
# layout input).  "blocked" sorts tokens by slot into 32-row blocks, with the
# layout built once per step on the host and shared by every layer: 1/N of the
# LoRA FLOPs, but a per-site weight gather.  Measured here (XLA on the CPU,
# hidden 512, 4 layers, all-linear r=16, 16 adapters, 512 tokens, one run, 5
# reps): masked 1.48x the base model, blocked 1.54x; on one 512x512 linear
# blocked was faster (1.53x vs 2.08x).  docs/benchmarks.md has the tables.
kernel = "masked"
