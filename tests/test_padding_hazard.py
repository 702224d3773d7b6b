"""The padding hazard rule on small graphs: attention over padded keys needs a proof that they are masked.

Graphs are Dynamo's own (``dynamic=True``, so the token dims are symbols), of
functions written to be one near miss apart.
"""
import pytest
import torch
import torch.nn.functional as F

from xla_lora_pass.shapes.padding_hazard import padding_hazard
from xla_lora_pass.shapes.writes import mark_static_inputs


def _captured_graph(fn, *args):
    """The one graph Dynamo captures for ``fn(*args)`` (``dynamic=True``: the token dims are symbols)."""
    graphs = []

    def record(gm, example_inputs):
        mark_static_inputs(gm, example_inputs)  # as the backend's rewrite does
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(fn, backend=record, dynamic=True)(*args)
    [gm] = graphs
    return gm


def _hazard(fn, *args):
    """padding_hazard of the one graph Dynamo captures for ``fn(*args)``, padding every size symbol."""
    gm = _captured_graph(fn, *args)
    symbols = set()
    for p in gm.graph.find_nodes(op="placeholder"):
        value = p.meta["example_value"]
        shape = value.shape if isinstance(value, torch.Tensor) else (value,)
        symbols |= {s.node.expr for s in shape if isinstance(s, torch.SymInt)}
    assert symbols, "the graph has no size symbols: nothing would be padded"
    return padding_hazard(gm, symbols)


def _features(t, *dims):
    """``t`` with ``dims`` static: only the batch and token dims are symbols, as in the backend's graphs."""
    for d in dims:
        torch._dynamo.mark_static(t, d)
    return t


def _qkv(b=2, s=5):
    g = torch.Generator().manual_seed(s)
    return [_features(torch.randn(b, 2, s, 4, generator=g), 1, 3) for _ in range(3)]


def _eager_attention(q, k, v, bias):
    scores = q @ k.transpose(-1, -2) / 2.0 + bias
    return F.softmax(scores, dim=-1) @ v


def test_sdpa_is_causal_is_safe():
    assert _hazard(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), *_qkv()) is None


def test_sdpa_with_an_in_graph_causal_mask_is_safe():
    def attend(q, k, v):
        s = q.shape[-2]
        causal = torch.ones(s, s, dtype=torch.bool).tril()
        return F.scaled_dot_product_attention(q, k, v, attn_mask=causal)

    assert _hazard(attend, *_qkv()) is None


def test_arange_comparison_mask_is_safe():
    """HF's mask builders: ``kv_idx <= q_idx`` over two aranges."""
    def attend(q, k, v):
        s = q.shape[-2]
        causal = torch.arange(s)[None, :] <= torch.arange(s)[:, None]
        bias = torch.zeros(s, s).masked_fill(~causal, float("-inf"))
        return _eager_attention(q, k, v, bias)

    assert _hazard(attend, *_qkv()) is None


def test_sdpa_without_a_mask_is_a_hazard():
    why = _hazard(lambda q, k, v: F.scaled_dot_product_attention(q, k, v), *_qkv())
    assert "attends over padded keys" in why


def test_in_graph_ones_mask_over_the_token_dim_is_a_hazard():
    """BERT without an attention_mask builds ``torch.ones(batch, seq)``: it masks no padding."""
    def attend(q, k, v, ids):
        mask = torch.ones(ids.size())[:, None, None, :]
        bias = (1.0 - mask).masked_fill((1.0 - mask).bool(), torch.finfo(torch.float32).min)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias)

    q, k, v = _qkv()
    assert "attends over padded keys" in _hazard(attend, q, k, v, torch.zeros(2, 5, dtype=torch.long))


def test_mask_from_a_graph_input_is_safe():
    def attend(q, k, v, attention_mask):
        mask = attention_mask[:, None, None, :].to(torch.float32)
        bias = (1.0 - mask).masked_fill((1.0 - mask).bool(), torch.finfo(torch.float32).min)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias)

    q, k, v = _qkv()
    assert _hazard(attend, q, k, v, torch.ones(2, 5, dtype=torch.long)) is None


def test_eager_softmax_attention_with_and_without_an_input_mask():
    q, k, v = _qkv()
    masked = lambda q, k, v, m: _eager_attention(q, k, v, (1.0 - m[:, None, None, :].float()) * -1e9)  # noqa: E731
    assert _hazard(masked, q, k, v, torch.ones(2, 5)) is None
    bias_from_positions = lambda q, k, v: _eager_attention(  # noqa: E731
        q, k, v, (torch.arange(q.shape[-2])[None, :] - torch.arange(q.shape[-2])[:, None]).abs().float())
    assert "softmax over a token dim" in _hazard(bias_from_positions, q, k, v)


def test_contraction_over_tokens_is_a_hazard_but_over_features_is_not():
    x = _features(torch.randn(2, 5, 4), 2)
    assert "contracts over a token dim" in _hazard(lambda x: x.transpose(1, 2) @ x, x)
    assert _hazard(lambda x: x @ x.transpose(1, 2), x) is None
    assert "contracts over a token dim" in _hazard(lambda x: torch.einsum("bsd,bse->bde", x, x), x)


@pytest.mark.parametrize("fn, hazard", [(lambda x: torch.min(x, torch.zeros_like(x)), False),
                                        (lambda x: torch.max(x, dim=1).values, True)])
def test_elementwise_min_is_not_a_reduction(fn, hazard):
    """T5's relative-position buckets take ``torch.min(a, b)`` elementwise: no mixing of tokens."""
    assert (_hazard(fn, _features(torch.randn(2, 5, 4), 2)) is not None) == hazard


def _held(batch, length=8):
    """A static-address buffer, as transformers marks its static KV cache (``mark_static_address``, its default
    ``guard``): torch 2.9 guards on it and lifts it into the graph (``get_attr``); torch 2.14 does not guard by
    default and passes it as a graph input, with sizes as dynamic as any input's."""
    buf = torch.zeros(batch, length, 4)
    torch._dynamo.mark_static_address(buf)
    return buf


# Measured: what a static-address tensor is in Dynamo's graph, per torch version.
HELD_AS = {(2, 9): "get_attr", (2, 14): "input"}.get(tuple(int(p) for p in torch.__version__.split(".")[:2]))
HELD_REASON = {"get_attr": "the graph holds", "input": "is a static-address tensor"}


def test_a_held_tensor_written_with_a_token_dim_is_a_hazard():
    """A static cache written at fixed positions with the batch's rows: padding the batch would not pad the
    cache (2.9: lifted, written with a token dim), or would pad a copy of it (2.14: a static-address input)."""
    cache = _held(3)

    def step(x):
        cache.index_copy_(1, torch.arange(5), x)
        return cache.sum(-1)

    why = _hazard(step, _features(torch.randn(3, 5, 4), 1, 2))
    assert why is not None and HELD_REASON[HELD_AS] in why, why


def test_a_write_at_indices_with_a_token_dim_is_a_hazard_whatever_it_writes():
    """transformers 4.57 makes its static cache in the prompt's graph and writes it at ``cache_position``: the
    padded positions are 0 and overwrite position 0's keys (0.5 off on a tiny Llama before this rule)."""
    def prompt(x, positions):
        keys = torch.zeros(x.shape[0], 16, 4)
        keys.index_copy_(1, positions, x)
        return keys

    x = _features(torch.randn(3, 5, 4), 0, 2)
    why = _hazard(prompt, x, torch.arange(5))
    assert why is not None and "writes in place at indices with a token dim" in why, why
    assert _hazard(lambda x: torch.zeros(3, 16, 4).index_copy_(1, torch.arange(5), x), x) is None


def test_a_write_of_a_size_with_a_token_dim_into_an_input_is_a_hazard():
    """transformers 5's StaticLayer adds the prompt's length to its ``cumulative_length`` tensor in place."""
    def prompt(x, length):
        length.add_(x.shape[1])
        return x * 2

    why = _hazard(prompt, _features(torch.randn(3, 5, 4), 0, 2), torch.tensor(0))
    assert why is not None and "writes a graph input in place with a token dim" in why, why


@pytest.mark.parametrize("write", ["slice", "narrow"])
def test_a_write_through_a_view_of_an_input_is_a_hazard(write):
    """``buf[:, :n].copy_(x)`` writes the input ``buf`` itself: with ``n`` a token count, padding would write
    the padded zeros into ``buf`` past the real tokens."""
    def step(x, buf):
        n = x.shape[1]
        view = buf[:, :n] if write == "slice" else buf.narrow(1, 0, n)
        view.copy_(x)
        return x * 2

    buf = _features(torch.zeros(3, 16), 0, 1)
    why = _hazard(step, _features(torch.randn(3, 5), 0), buf)
    assert why is not None and "writes a graph input in place with a token dim" in why, why

    def fixed(x, buf):  # a view of fixed sizes written with a value that has no token dim: safe
        buf[:, :2].copy_(buf[:, 2:4])
        return x * 2

    assert _hazard(fixed, _features(torch.randn(3, 5), 0), buf) is None


def test_a_held_tensor_tied_to_a_padded_dim_is_a_hazard_and_one_that_is_not_is_safe():
    """Read only: a held tensor of the batch's traced size is the batch dim, unpadded (batch 3 meets 4)."""
    def read(x, held):
        return x + held.sum()

    tied = _held(3)
    why = _hazard(lambda x: read(x, tied), _features(torch.randn(3, 5, 4), 2))
    assert why is not None and {"get_attr": "equals the traced value of the padded",
                                "input": "is a static-address tensor"}[HELD_AS] in why, why
    # No size of it is 3 or 5, the traced batch and token dims; static sizes (2.14 would give an input's
    # dims symbols of their own, which this helper pads as it pads every symbol).
    untied = _features(_held(7, length=9), 0, 1, 2)
    assert _hazard(lambda x: read(x, untied), _features(torch.randn(3, 5, 4), 2)) is None



def _hazard_padding_first_input(fn, *args):
    """(padding_hazard of ``fn``'s graph when only its first input's size symbols are padded, the symbols of
    the other inputs that are not padded)."""
    gm = _captured_graph(fn, *args)
    placeholders = [p for p in gm.graph.find_nodes(op="placeholder")
                    if isinstance(p.meta["example_value"], torch.Tensor)]
    symbols = {s.node.expr for s in placeholders[0].meta["example_value"].shape if isinstance(s, torch.SymInt)}
    others = {s.node.expr for p in placeholders[1:] for s in getattr(p.meta["example_value"], "shape", ())
              if isinstance(s, torch.SymInt)}
    return padding_hazard(gm, symbols), others - symbols


def test_indices_over_a_padded_dim_into_another_unpadded_size_are_a_hazard():
    """T5's mask lookup on torch 2.14: the mask's rows (its own batch symbol) picked by an arange over the
    ids' batch (the padded one); padded, the arange points past the mask's real rows."""
    def mask_rows(ids, mask):
        return ids * mask[torch.arange(ids.shape[0])[:, None], torch.arange(ids.shape[1])]

    why, unpadded = _hazard_padding_first_input(mask_rows, _features(torch.ones(3, 8), 1),
                                                _features(torch.ones(5, 8), 1))
    assert unpadded, "the mask's batch must be a symbol of its own"
    assert why is not None and "indexes a dim of another, unpadded size" in why, why


def test_indices_over_a_padded_dim_into_a_fixed_size_are_safe():
    """A table of fixed size (rotary positions) indexed by a padded tensor: nothing varies that padding could
    outgrow."""
    table = torch.randn(64, 4)
    why, unpadded = _hazard_padding_first_input(lambda ids, x: (table[ids], x * 2), torch.ones(3, 8, dtype=torch.long),
                                                _features(torch.ones(5, 4), 1))
    assert unpadded and why is None, why
