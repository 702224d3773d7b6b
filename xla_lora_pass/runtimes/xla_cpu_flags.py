"""XLA:CPU's memory scheduler, chosen before the XLA runtime starts.

XLA:CPU schedules a program breadth-first by default
(``--xla_cpu_enable_concurrency_optimized_scheduler``), to run independent
ops at once.  On the LoRA graphs that hoists every site's small weight
gathers and matmuls away from the activations they read, and on a 2-core
machine measured 1.55x the base model for the row kernel against 1.11x with
the depth-first scheduler (a 4-layer model, 28 sites, same run); the base
model's own time did not move (60.3 vs 61.0 ms).  bench/step_time.py prints
both.

XLA reads ``XLA_FLAGS`` once, when its runtime starts (the first
``torch_xla.device()``), so this must run before that: importing
``xla_lora_pass`` does it, for the CPU only (``PJRT_DEVICE=CPU``), and never
overrides the flag when ``XLA_FLAGS`` already sets it either way.
"""
from __future__ import annotations

import logging
import os
import sys

log = logging.getLogger(__name__)

SCHEDULER_FLAG = "--xla_cpu_enable_concurrency_optimized_scheduler"


def runtime_started() -> bool:
    """Whether torch_xla's runtime already read XLA_FLAGS (without importing torch_xla)."""
    torch_xla = sys.modules.get("torch_xla")
    if torch_xla is None:
        return False
    try:
        return bool(torch_xla._XLAC._xla_runtime_is_initialized())
    except AttributeError:  # a torch_xla without the query: assume the worst
        return True


def set_cpu_scheduler_flag() -> str:
    """Add ``SCHEDULER_FLAG=false`` to XLA_FLAGS when it can still take effect; returns what was done."""
    if os.environ.get("PJRT_DEVICE", "").upper() != "CPU":
        return "not on the CPU"
    flags = os.environ.get("XLA_FLAGS", "")
    if SCHEDULER_FLAG in flags:
        return "set by the user"
    if runtime_started():
        return "too late: the XLA runtime already started"
    os.environ["XLA_FLAGS"] = f"{flags} {SCHEDULER_FLAG}=false".strip()
    return "set"


def scheduler_flag_in_effect() -> bool:
    """Whether this process's XLA:CPU programs use the depth-first scheduler."""
    return f"{SCHEDULER_FLAG}=false" in os.environ.get("XLA_FLAGS", "").replace("False", "false")


CPU_SCHEDULER_STATUS = set_cpu_scheduler_flag()
