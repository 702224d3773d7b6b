"""Every setting of the pass in one place.  Tests patch these attributes.

Read once here, never inside a pass: ``XLA_LORA_DUMP_DIR`` is the only
environment variable the package reads.
"""
import os

# Which graph_rewrites passes run (name -> on/off); a missing name is on.
passes = {
    "normalize": True,
    "lora_linear": True,
}

# When a pass raises on an unexpected graph: True compiles the graph unrewritten
# (counted in stats["fallbacks"], still correct for uniform mappings); False
# re-raises, which tests use to see the failure itself.
fallback_on_error = True

# Write every graph the backend sees (before, after, report) under this folder,
# one subfolder per compile.  None: no dumps.
dump_dir = os.environ.get("XLA_LORA_DUMP_DIR") or None
