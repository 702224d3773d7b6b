"""What the property tests of issue 28's set-ups share: one thread, one compiled model per example, the check.

The set-ups (tests/test_pool_moves_property.py, test_weight_changes_property.py,
test_tied_embeddings_property.py, test_peft_types_property.py) draw a model and
compile it once per example with the backend on the CPU (``inner="aot_eager"``),
then draw what happens to it between calls.
"""
from __future__ import annotations

import pytest
import torch

import xla_lora_pass as xlp

from . import test_peft_configs_property

# As the PEFT configurations' property test: derandomized (CI sees the same examples every run), no deadline, no
# shrinking (an example compiles a model: the failing example is reported as drawn).  Each test sets its count.
SETTINGS = {k: v for k, v in test_peft_configs_property.SETTINGS.items() if k != "max_examples"}

ATOL = 1e-4  # fp32, against eager PEFT ...
ULPS = 16  # ... or 16 fp32 roundings of the output's largest value, where that is more: the drawn adapters (scaling
# up to 8 at every site) reach logits of ~300, where one rounding is 3e-5 and the summation order alone moves
# a logit by 1.5e-4 (measured)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The models are tiny: a second intra-op thread only waits, and on a machine whose other core is busy a
    call took 50x as long (measured: 2 ms -> 100 ms per call of TinyLM)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def compile_served(model, meta: xlp.LoRAMetadata, kernel: str = "auto"):
    """``model`` compiled with a new backend over ``meta`` (registered already) after a Dynamo reset, so every
    example compiles from scratch and never reaches Dynamo's recompile limit (which would run eager)."""
    torch._dynamo.reset()
    backend = xlp.make_backend(meta, inner="aot_eager", settings=xlp.config.snapshot(kernel=kernel))
    return torch.compile(model, backend=backend)


def assert_exact(got, want, what: str = "") -> None:
    """Every output (a tensor, a tuple of them, or a ModelOutput's logits) within ``ATOL`` of eager PEFT's, or
    ``ULPS`` roundings of its largest value where that is more."""
    got, want = (x.logits if hasattr(x, "logits") else x for x in (got, want))
    got, want = (x if isinstance(x, (tuple, list)) else (x,) for x in (got, want))
    assert len(got) == len(want)
    for g, w in zip(got, want):
        err, bound = (g - w).abs().max().item(), max(ATOL, ULPS * torch.finfo(w.dtype).eps * w.abs().max().item())
        assert err < bound, f"{what}: off by {err:.3g} from eager PEFT (bound {bound:.3g})"
