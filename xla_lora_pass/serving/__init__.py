"""Serving a registered model through a backend: PEFT's ``generate``, its static caches, and the eager guard."""
from .model_serving import ModelServing

__all__ = ["ModelServing"]
