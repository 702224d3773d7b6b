"""``layer_norm`` on XLA tensors with symbolic sizes, so LayerNorm models bucket.

torch_xla 2.9 registers its own ``AutogradXLA`` kernel for
``aten::native_layer_norm``; it calls ATen's C++ composite, which reads
``numel()``.  A tensor with symbolic sizes (Dynamo's fake tensors once a
token dim turns dynamic) has none, so Dynamo fails on every LayerNorm model
(GPT-2, OPT, GPT-NeoX, BERT, Phi, Falcon, ...) at its second token count:
``Cannot call numel() on tensor with symbolic sizes``.

``install()`` puts a kernel in front of torch_xla's that runs torch's own
decomposition of ``native_layer_norm`` (the one Inductor uses, written in
SymInt-aware ops, with autograd through those ops) only when a size is
symbolic, exactly the calls that raised before, and hands every other call
to torch_xla's kernel untouched.  Real tensors never have symbolic sizes, so
eager code, training and every compiled program keep torch_xla's lowering:
the backend compiles each bucket from static example inputs, so only
Dynamo's shape propagation ever takes the decomposition.

Only ``native_layer_norm`` needs it: ``native_group_norm`` (torch_xla's
other norm kernel at this key), ``rms_norm``, HF's RMSNorm (written in torch
ops), ``batch_norm`` and ``instance_norm`` all trace with symbolic sizes
(tests/test_symbolic_layer_norm.py).
"""
from __future__ import annotations

import logging
import threading
import warnings

import torch

log = logging.getLogger(__name__)

OP = "aten::native_layer_norm"
DISPATCH_KEY = "AutogradXLA"

_lock = threading.Lock()
_library = None  # the torch.library.Library holding the kernel, kept alive for the process
_status = "not installed"


def has_symbolic_size(tensor: torch.Tensor, normalized_shape) -> bool:
    """Whether a size torch_xla's kernel would read is symbolic (then that kernel raises)."""
    return any(isinstance(s, torch.SymInt) for s in (*tensor.shape, *normalized_shape))


def _decomposition():
    from torch._decomp import decomposition_table

    return decomposition_table[torch.ops.aten.native_layer_norm.default]


def install() -> str:
    """Put the symbolic-size kernel in front of torch_xla's, once per process; returns what was done.

    Needs torch_xla imported first (its kernel is the one kept for static
    sizes) and ``torch.library.get_kernel`` (torch >= 2.9).
    """
    global _library, _status
    with _lock:
        if _library is not None:
            return _status
        try:
            import torch_xla  # noqa: F401  registers the kernel this one falls back to
        except ImportError:
            _status = "skipped: torch_xla is not installed"
            return _status
        if not hasattr(torch.library, "get_kernel"):
            _status = ("skipped: this torch has no torch.library.get_kernel, so LayerNorm models need "
                       "static shapes (torch.compile(..., dynamic=False))")
            log.warning("symbolic layer_norm kernel %s", _status)
            return _status
        xla_kernel = torch.library.get_kernel(OP, DISPATCH_KEY)
        decomposed = _decomposition()

        def native_layer_norm(keyset, input, normalized_shape, weight, bias, eps):
            if has_symbolic_size(input, normalized_shape):
                return decomposed(input, normalized_shape, weight, bias, eps)
            return xla_kernel.call_boxed(keyset, input, normalized_shape, weight, bias, eps)

        library = torch.library.Library("aten", "IMPL")
        with warnings.catch_warnings():
            # "Overriding a previously registered kernel": that is the point; the old one stays reachable.
            warnings.filterwarnings("ignore", message=".*[Oo]verrid.*")
            library.impl("native_layer_norm", native_layer_norm, DISPATCH_KEY, with_keyset=True)
        _library = library
        _status = "installed"
        log.info("aten::native_layer_norm on AutogradXLA: torch's decomposition for symbolic sizes, "
                 "torch_xla's kernel otherwise")
        return _status


def status() -> str:
    """What ``install()`` did in this process."""
    return _status
