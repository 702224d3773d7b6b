"""Shape bucketing: a few padded sizes per token dim, and when padding is safe.  Knows nothing of LoRA."""
from .bucketing import Buckets, GraphShapes

__all__ = ["Buckets", "GraphShapes"]
