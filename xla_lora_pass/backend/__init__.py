"""The ``torch.compile`` backend: rewrite each Dynamo graph, bucket its token dims, compile one program per bucket."""
from .lora_backend import LoRABackend, make_backend

__all__ = ["LoRABackend", "make_backend"]
