"""Counting XLA compiles with torch_xla's own metrics."""
import torch_xla.debug.metrics as met


def xla_compiles() -> int:
    """Programs XLA has compiled in this process so far."""
    data = met.metric_data("CompileTime")
    return 0 if data is None else int(data[0])
