"""The LoRA-site patterns, one file each (an example computation, its replacement and its check), and their table."""
from typing import Tuple

from ..pattern_matcher import Pattern
from .lora_bias import LORA_BIAS
from .lora_dora import LORA_DORA
from .lora_embedding import LORA_EMBEDDING
from .lora_linear import LORA_LINEAR
from .lora_merged import LORA_MERGED

# The pattern table, in the order the "patterns" pass runs them, each on the
# graph the earlier ones left: the more specific linear forms (a LoRA bias,
# DoRA's rescaling) before pattern 1's plain delta.  Each is switched by its
# name in the backend's settings (``passes``; a missing name is on).
PATTERNS: Tuple[Pattern, ...] = (LORA_EMBEDDING, LORA_BIAS, LORA_DORA, LORA_MERGED, LORA_LINEAR)

__all__ = ["PATTERNS"]
