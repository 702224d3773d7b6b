"""What Dynamo needs to trace PEFT's DoRA linear forward in one graph.

PEFT's DoRA forward reads its base weight through
``peft.utils.integrations.dequantize_module_weight``, which asks
``type(module.weight).__module__.startswith("torchao.")``.  torch 2.14's
Dynamo cannot trace ``str.startswith`` on that attribute of the ``Parameter``
class and breaks the graph there, so no graph holds a whole DoRA layer: the
rewrite cannot see the layer, and mixed batches with a DoRA adapter would be
refused.  torch 2.9 traces it.

``allow_whole_dora_graphs`` registers with Dynamo a stand-in for that
function, used only while tracing: for a module whose weight is a plain
``Parameter`` (and that is not HQQ-quantized) it returns the weight, as PEFT
does; any other weight (torchao, bitsandbytes, FSDP) goes to PEFT's own
function, run outside the graph, so those keep PEFT's behaviour and its
graph break.  Eager calls are unaffected.
"""
from __future__ import annotations

import functools
import logging

import torch

log = logging.getLogger(__name__)


@functools.lru_cache(maxsize=None)
def allow_whole_dora_graphs() -> bool:
    """Register the stand-in once per process; False where this PEFT has no such function (nothing to do)."""
    try:
        from peft.utils import integrations
    except ImportError:
        return False
    original = getattr(integrations, "dequantize_module_weight", None)
    if original is None:
        return False
    # Dynamo must not trace PEFT's function (it would meet the break again, or, from inside the stand-in that
    # replaces it, recurse into the stand-in): a weight that is not a plain Parameter is PEFT's, run eagerly.
    untraced = torch.compiler.disable(original)

    def dequantize_module_weight(module):
        weight = module.weight
        if type(weight) is torch.nn.Parameter and not hasattr(module, "W_q"):
            return weight  # PEFT: neither HQQ nor torchao nor bitsandbytes, returned as is
        return untraced(module)

    torch.compiler.substitute_in_graph(original, skip_signature_check=True)(dequantize_module_weight)
    log.debug("registered a Dynamo stand-in for peft's dequantize_module_weight (whole DoRA graphs)")
    return True


__all__ = ["allow_whole_dora_graphs"]
