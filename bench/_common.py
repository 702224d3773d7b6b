"""Helpers shared by the bench scripts: XLA compile counters and markdown tables."""
from __future__ import annotations

import os

os.environ.setdefault("PJRT_DEVICE", "CPU")

from typing import List, Sequence  # noqa: E402


def xla_compile_stats():
    """(programs compiled so far, seconds spent compiling) from torch_xla's metrics."""
    import torch_xla.debug.metrics as met

    data = met.metric_data("CompileTime")
    return (0, 0.0) if data is None else (int(data[0]), float(data[1]) / 1e9)


def xla_execute_seconds() -> float:
    """Seconds XLA has spent executing programs so far (torch_xla's ``ExecuteTime`` metric)."""
    import torch_xla.debug.metrics as met

    data = met.metric_data("ExecuteTime")
    return 0.0 if data is None else float(data[1]) / 1e9


def markdown_table(header: Sequence[str], rows: List[Sequence]) -> str:
    def fmt(v):
        return f"{v:.3g}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)
