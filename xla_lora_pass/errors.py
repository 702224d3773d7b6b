"""Errors a user of the backend can catch."""


class UnsupportedMappingError(ValueError):
    """The token mapping asks for something the code about to run cannot compute exactly."""


class UnsupportedAdapterError(ValueError):
    """A LoRA layer that cannot be served exactly; raised by ``register_adapters``, naming the layer."""
