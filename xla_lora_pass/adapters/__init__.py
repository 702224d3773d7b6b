"""What an adapter is, read from any LoRA library: the records, the format readers, saved modules, DoRA's constants."""
