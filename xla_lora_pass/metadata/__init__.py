"""``LoRAMetadata``, the one shared object, and the state it owns: stacks, mapping, pool, stats, sharding."""
from .lora_metadata import NO_LORA, LoRAMetadata, TokenAdapter

__all__ = ["LoRAMetadata", "NO_LORA", "TokenAdapter"]
