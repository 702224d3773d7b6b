"""Mapping fuzzing (hypothesis): ``set_token_adapters`` accepts exactly the valid mappings, and a refused one
changes nothing.  CPU only; derandomized, so CI sees the same 300 cases every run."""
from __future__ import annotations

import numbers

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import xla_lora_pass as xlp

from .models import peft_two_layer
from .test_properties import SETTINGS

FUZZ_EXAMPLES = 300


NAMES = ["sql", "chat"]  # slots 0, 1 loaded; slot 2 free (max_slots=3)
MAX_TOKENS = 64

_entries = st.one_of(
    st.none(), st.integers(-4, 5), st.integers(), st.sampled_from(NAMES + ["nope", "", "SQL", "__base__"]),
    st.booleans(), st.floats(allow_nan=True), st.text(max_size=3), st.binary(max_size=2),
    st.sampled_from([np.int64(1), np.int32(-1), np.int8(7), np.uint8(0), np.bool_(True), np.float32(1.0)]),
    st.lists(st.integers(0, 1), max_size=2), st.just(torch.tensor(1)), st.complex_numbers(max_magnitude=2),
)


@st.composite
def _tensor_mapping(draw):
    """Tensors of every dtype kind and of 0, 1 or 2 dims."""
    dtype = draw(st.sampled_from([torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.float32,
                                  torch.bool, torch.complex64]))
    values = draw(st.lists(st.integers(0 if dtype == torch.uint8 else -2, 3), max_size=10))
    t = torch.tensor(values, dtype=torch.int64).to(dtype)
    dims = draw(st.sampled_from([0, 1, 2]))
    if dims == 2:
        return t.reshape(1, -1)
    return t.reshape(()) if dims == 0 and len(values) == 1 else t


_mappings = st.one_of(
    st.lists(_entries, max_size=8), st.lists(st.sampled_from(NAMES + [None, -1, 0, 1]), min_size=60, max_size=70),
    st.tuples(_entries, _entries), _tensor_mapping(), st.text(max_size=4), st.integers(), st.none(),
    st.dictionaries(st.integers(0, 3), st.sampled_from(NAMES), max_size=3), st.sets(st.integers(0, 1), max_size=2),
)


def _expected(mapping):
    """The oracle: (indices, None) if the mapping must be accepted, else (None, the exception type)."""
    if isinstance(mapping, torch.Tensor):
        if mapping.dim() != 1 or mapping.dtype.is_floating_point or mapping.dtype == torch.bool:
            return None, TypeError
        mapping = mapping.tolist()
    elif isinstance(mapping, (str, bytes)) or not isinstance(mapping, (list, tuple)):
        return None, TypeError
    if len(mapping) > MAX_TOKENS:
        return None, ValueError
    out = []
    for entry in mapping:
        if entry is None:
            out.append(-1)
        elif isinstance(entry, str):
            if entry not in NAMES:
                return None, KeyError
            out.append(NAMES.index(entry))
        elif isinstance(entry, numbers.Integral) and not isinstance(entry, bool):
            if int(entry) not in (-1, 0, 1):
                return None, ValueError
            out.append(int(entry))
        else:
            return None, TypeError
    return out, None


@pytest.fixture(scope="module")
def fuzz_meta():
    meta = xlp.LoRAMetadata(max_num_tokens=MAX_TOKENS, max_slots=3)
    meta.register_adapters(peft_two_layer())
    assert meta.slots == NAMES + [None]
    return meta


@settings(max_examples=FUZZ_EXAMPLES, **SETTINGS)
@given(mapping=_mappings)
def test_set_token_adapters_accepts_exactly_the_valid_mappings(fuzz_meta, mapping):
    meta = fuzz_meta
    meta.set_token_adapters(["chat", None, "sql"])
    want, error = _expected(mapping)
    if error is None:
        meta.set_token_adapters(mapping)
        assert meta.mapping().dtype == torch.int32 and meta.mapping().tolist() == want
        assert meta.num_tokens == len(want)
    else:
        with pytest.raises(error) as caught:
            meta.set_token_adapters(mapping)
        assert type(caught.value) in (TypeError, ValueError, KeyError)  # not an IndexError or the like
        assert str(caught.value).strip("'\"").startswith("set_token_adapters:"), caught.value
        assert meta.mapping().tolist() == [1, -1, 0]
