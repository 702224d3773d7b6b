"""The BGMV kernels as ``torch.ops.xla_lora`` ops, one file per kernel, and the table that lists them."""
