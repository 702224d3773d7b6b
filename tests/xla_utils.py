"""Counting compiles: XLA's with torch_xla's own metrics, or the backend's programs off XLA.

torch_xla is imported inside the calls, so a module importing this one is collected where torch_xla is not
installed (tests/conftest.py marks and skips the tests that call ``xla_compiles``)."""
import torch


def xla_compiles() -> int:
    """Programs XLA has compiled in this process so far."""
    import torch_xla.debug.metrics as met

    data = met.metric_data("CompileTime")
    return 0 if data is None else int(data[0])


def device_compiles(device: torch.device, meta) -> int:
    """Programs compiled so far for ``device``: XLA's own count on torch_xla's device (it also sees a program
    compiled outside the backend, e.g. a stack write), else the backend's inner-backend programs
    (``meta.stats["compiles"]``), the only compiles a CPU run makes besides Dynamo's traces."""
    return xla_compiles() if device.type == "xla" else meta.stats["compiles"]
