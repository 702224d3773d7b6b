"""What a backend installs on the model its metadata registered: the eager guard's hooks and the routed generate.

The metadata only holds state; it never touches the user's model.
``make_backend`` hands it one ``ModelServing`` (``meta.set_server``), which
serves the registered model now and after every later ``register_adapters``.
A newer backend's takes over: the older one's hooks go.
"""
from __future__ import annotations

from typing import Optional

import torch

from . import eager_guard
from .generate import GenerateRoute


class ModelServing:
    """The hooks and the ``generate`` route one backend puts on the registered model."""

    def __init__(self, backend):
        self.meta = backend.meta
        self.route = GenerateRoute(backend)
        self._hooks: list = []

    def __call__(self, model: Optional[torch.nn.Module]) -> None:
        """Serve ``model`` (just registered with the metadata): guard its LoRA layers and route its generate."""
        meta = self.meta
        self._hooks = eager_guard.install(meta, meta.sites.values(), meta.saved_modules.values(), self._hooks)
        if model is not None and meta.sites:
            self.route.install(model)  # HF's generate never calls the compiled module: generate.py

    def detach(self) -> None:
        """Remove this backend's hooks (a newer backend serves the model)."""
        self._hooks = eager_guard.install(self.meta, (), (), self._hooks)
