"""The pass alone on ``TinyLM`` (tests/models.py): its ids, a registered metadata, a mapping, a rewrite."""
import torch

import xla_lora_pass as xlp

from .helpers import capture_graphs

SEQ = 5
ROWS = ["sql", "chat", None, "code"]


def tiny_ids(rows=ROWS, seq=SEQ, seed=0):
    return torch.randint(0, 32, (len(rows), seq), generator=torch.Generator().manual_seed(seed))


def registered(model):
    meta = xlp.LoRAMetadata(max_num_tokens=64)
    meta.register_adapters(model)
    return meta


def map_rows(meta, rows, seq):
    meta.set_token_adapters([r for r in rows for _ in range(seq)])


def rewritten(model, meta, ids, kernel="masked"):
    """(Dynamo's graph, its example inputs, the rewritten graph, the report) of ``model(ids)``."""
    (gm, example_inputs), = capture_graphs(model, ids)
    new_gm, report = xlp.rewrite(gm, example_inputs, meta, kernel=kernel)
    assert report.error is None, report.error
    return gm, example_inputs, new_gm, report
