"""``python -m xla_lora_pass.dump``: the same as the ``xla-lora-dump`` console script."""
from .cli import main

raise SystemExit(main())
