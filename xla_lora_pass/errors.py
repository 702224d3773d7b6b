"""Errors a user of the backend can catch."""


class UnsupportedMappingError(ValueError):
    """The token mapping asks for something the code about to run cannot compute exactly."""


class UnsupportedAdapterError(ValueError):
    """A LoRA layer that cannot be served exactly, or a PEFT adapter of another type than LoRA; raised by
    ``register_adapters``, naming the layer or the adapter."""


class AdapterFileError(ValueError):
    """A saved adapter's directory or file cannot be read as one (truncated, corrupt, not JSON, missing)."""


class AdapterFileNotFoundError(AdapterFileError, FileNotFoundError):
    """A saved adapter's directory or one of its files is missing (still a ``FileNotFoundError``, as before)."""
