"""Inputs at exactly a bucket's size that are strided slices, under inductor, which specialises each program on
its inputs' strides: exact against eager PEFT, in either order (a padded call first, or the strided one)."""
import pytest
import torch

import xla_lora_pass as xlp
from xla_lora_pass.demo_models import eager_reference, tiny_peft_llama

ROWS = ["sql", "chat", None, "code"]


@pytest.fixture(scope="module")
def served():
    model, _ = tiny_peft_llama(targets=("q_proj", "v_proj", "o_proj"))
    meta = xlp.LoRAMetadata(max_num_tokens=256)
    meta.register_adapters(model)
    backend = xlp.make_backend(meta, inner="inductor")
    meta.set_request_adapters(ROWS)
    return model, meta, torch.compile(model, backend=backend)


def _check(served, ids):
    model, meta, compiled = served
    with torch.no_grad():
        got = compiled(input_ids=ids).logits
    torch.testing.assert_close(got, eager_reference(model, ids, ROWS), rtol=0, atol=1e-4)


def test_strided_input_at_a_bucket_size(served):
    wide = torch.randint(0, 128, (len(ROWS), 64), generator=torch.Generator().manual_seed(0))
    _check(served, wide[:, :5].contiguous())  # Dynamo's first, static graph
    _check(served, wide[:, :6].contiguous())  # bucket 8, compiled for the padded (contiguous) input
    assert not wide[:, :8].is_contiguous()
    _check(served, wide[:, :8])  # exactly bucket 8, strided: the same program
    _check(served, wide[:, :16])  # bucket 16 compiled by a strided input first
    _check(served, wide[:, :11].contiguous())  # then padded into it
    # Dynamo's graph for strided inputs takes the stride as one more size; it must not key the programs, or
    # each contiguous length would compile one.
    compiles = served[1].stats["compiles"]
    for n in (9, 10, 12, 13):
        _check(served, wide[:, :n].contiguous())
    _check(served, wide[:, :7])
    assert served[1].stats["compiles"] == compiles
