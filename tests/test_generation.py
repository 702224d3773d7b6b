"""Issue 14: PEFT's generate on the compiled model, a hand-written static-cache decode loop, and T5, on the
``device`` fixture's device (XLA where torch_xla is installed, else the CPU with aot_eager).

Every reference is eager PEFT on the CPU with ``adapter_names=`` (its own
mixed batch), computed before the model moves to the device.
"""
import pytest
import torch

import xla_lora_pass as xlp
from xla_lora_pass.demo_models import tiny_peft_llama
from xla_lora_pass.serving.static_cache import static_cache

from .generate_cases import (CACHES, NEW_TOKENS, ROWS, adapter_names_of, generate_rows,
                             left_padded_prompts)
from .xla_utils import device_compiles

ROTATIONS = [ROWS, ROWS[1:] + ROWS[:1], ROWS[2:] + ROWS[:2]]
BEAMS = dict(num_beams=2, num_return_sequences=2, max_new_tokens=6)


@pytest.fixture(scope="module")
def llama(device, inner):
    torch._dynamo.reset()
    model, _ = tiny_peft_llama()
    ids, mask = left_padded_prompts()
    refs = {(cache, i): generate_rows(model, ids, mask, rows, cache) for cache in CACHES
            for i, rows in enumerate(ROTATIONS)}
    beam_refs = [generate_rows(model, ids, mask, rows, "dynamic", **BEAMS) for rows in ROTATIONS]
    model.to(device)
    meta = xlp.LoRAMetadata(max_num_tokens=256)
    meta.register_adapters(model)
    backend = xlp.make_backend(meta, inner=inner)
    return dict(model=model, meta=meta, backend=backend, compiled=torch.compile(model, backend=backend), ids=ids,
                mask=mask, refs=refs, beam_refs=beam_refs, device=device)


@pytest.mark.compat
@pytest.mark.parametrize("cache", list(CACHES))
def test_peft_generate_on_the_compiled_model_runs_the_rewritten_programs(llama, cache):
    meta, backend = llama["meta"], llama["backend"]
    for i, rows in enumerate(ROTATIONS):
        steps_before = sum(meta.stats["bucket_hits"].values())
        compiles_before = device_compiles(llama["device"], meta)
        out = generate_rows(llama["compiled"], llama["ids"], llama["mask"], rows, cache, llama["device"])
        assert torch.equal(out, llama["refs"][(cache, i)]), f"rotation {i}:\n{out}\n{llama['refs'][(cache, i)]}"
        # Every forward step (the prompt, then one per further token) ran one of the backend's programs.
        assert sum(meta.stats["bucket_hits"].values()) - steps_before == NEW_TOKENS
        if i == 2:
            assert device_compiles(llama["device"], meta) == compiles_before, "the third generate compiled programs"
    ran = [g for g in backend.graphs if g.programs]
    assert ran and all(g.report.sites for g in ran), [g.report.format() for g in ran]
    assert meta.stats["rewrites"]["lora_linear"] >= 4  # q_proj and v_proj of both layers
    assert meta.stats["compiles"] <= 8, dict(meta.stats["bucket_hits"])
    # The prompt step's lm_head on each row's last position got a contiguous input (fold_linear_inputs).
    assert any(n.op == "call_method" and n.target == "clone" for g in ran for n in g.gm.graph.nodes)


@pytest.mark.compat
def test_beam_search_keeps_the_serving_cache_and_its_programs(llama):
    """Beam search reorders the cache every step; transformers replaces the static tensors to do it,
    which failed Dynamo's identity guard (a retrace of the prompt step on the next generate) and gave
    each generate new XLA programs (27 on a third generate of a tiny Mistral)."""
    meta = llama["meta"]
    for i, rows in enumerate(ROTATIONS):
        compiles_before, device_before = meta.stats["compiles"], device_compiles(llama["device"], meta)
        out = generate_rows(llama["compiled"], llama["ids"], llama["mask"], rows, "dynamic", llama["device"], **BEAMS)
        assert torch.equal(out, llama["beam_refs"][i]), f"rotation {i}:\n{out}\n{llama['beam_refs'][i]}"
        if i > 0:
            assert meta.stats["compiles"] == compiles_before, f"generate {i + 1} compiled the backend again"
        if i == 2:
            assert device_compiles(llama["device"], meta) == device_before, \
                "the third beam-search generate compiled programs"


def test_generate_past_max_num_tokens_gets_a_longer_cache(device, inner):
    """max_num_tokens bounds the tokens of one call (here 2 rows of 6), not a row's prompt + new tokens (22)."""
    torch._dynamo.reset()
    model, _ = tiny_peft_llama()
    ids, mask = (t[:2] for t in left_padded_prompts())
    rows = ROWS[:2]
    ref = generate_rows(model, ids, mask, rows, "dynamic")
    model.to(device)
    meta = xlp.LoRAMetadata(max_num_tokens=16)
    meta.register_adapters(model)
    compiled = torch.compile(model, backend=xlp.make_backend(meta, inner=inner))
    assert torch.equal(generate_rows(compiled, ids, mask, rows, "dynamic", device), ref)


@pytest.mark.compat
@pytest.mark.parametrize("family", ["llama", "t5"])
def test_generate_of_a_batch_between_buckets_after_another_batch(device, inner, family):
    """4 rows, then 3: Dynamo makes the batch dim dynamic at the second, while the static cache it holds in the
    graph has the real 3 rows, so the batch must not be padded to its bucket of 4 (it raised "expand: attempting
    to expand a dimension of length 3 -> 4")."""
    torch._dynamo.reset()
    model = tiny_peft_llama()[0] if family == "llama" else _peft_t5(initializer_factor=10.0)
    ids, mask = left_padded_prompts() if family == "llama" else _t5_prompts()
    batches = [(ids, mask, ROWS), (ids[:3], mask[:3], ROWS[:3])]
    refs = [generate_rows(model, i, m, rows, "dynamic") for i, m, rows in batches]
    model.to(device)
    meta = xlp.LoRAMetadata(max_num_tokens=256)
    meta.register_adapters(model)
    compiled = torch.compile(model, backend=xlp.make_backend(meta, inner=inner))
    for (i, m, rows), ref in zip(batches, refs):
        assert torch.equal(generate_rows(compiled, i, m, rows, "dynamic", device), ref), f"{len(rows)} rows"


def test_generate_refuses_adapter_names_of_another_batch(llama):
    with pytest.raises(xlp.UnsupportedMappingError, match="adapter_names has 3 names but the prompt has 4 rows"):
        generate_rows(llama["compiled"], llama["ids"], llama["mask"], ROWS[:3], "static", llama["device"])


def _greedy_loop(step, ids, steps):
    """Greedy tokens of a prompt then ``steps`` one-token steps; ``step(ids, position)`` returns logits."""
    tokens = [step(ids, 0)[:, -1].argmax(-1)]
    for i in range(steps):
        tokens.append(step(tokens[-1][:, None], ids.shape[1] + i)[:, -1].argmax(-1))
    return torch.stack([t.cpu() for t in tokens], dim=1)


@pytest.mark.compat
def test_static_cache_decode_loop_with_request_adapters(device, inner):
    """64 decode steps by hand on a StaticCache with set_request_adapters: PEFT's tokens, no compile after step 3."""
    from transformers import DynamicCache

    torch._dynamo.reset()
    model, _ = tiny_peft_llama(seed=1)
    ids = torch.randint(3, 128, (4, 8), generator=torch.Generator().manual_seed(5))
    eager_cache = DynamicCache()

    def eager_step(x, position):
        with torch.no_grad():
            return model(input_ids=x, past_key_values=eager_cache, use_cache=True,
                         adapter_names=adapter_names_of(ROWS)).logits

    reference = _greedy_loop(eager_step, ids, 64)
    model.to(device)
    meta = xlp.LoRAMetadata(max_num_tokens=256)
    meta.register_adapters(model)
    compiled = torch.compile(model, backend=xlp.make_backend(meta, inner=inner))
    meta.set_request_adapters(ROWS)
    cache = static_cache(model.get_base_model().config, 80, 4, torch.float32, device)
    compiles = []  # compiles so far (XLA's on XLA, else the backend's programs), after each step

    def step(x, position):
        # Built on the host and sent: an arange on the device would bake each position into a new program.
        positions = torch.arange(position, position + x.shape[1]).to(device)
        with torch.no_grad():
            logits = compiled(input_ids=x.to(device), past_key_values=cache, cache_position=positions,
                              use_cache=True).logits
        compiles.append(device_compiles(device, meta))
        return logits

    tokens = _greedy_loop(step, ids, 64)
    assert torch.equal(tokens, reference), f"{tokens}\n{reference}"
    assert len(compiles) == 65 and compiles[-1] == compiles[2], f"compiles after each step: {compiles}"
    assert meta.stats["rewrites"]["lora_linear"] >= 4 and meta.stats["compiles"] <= 3


def _peft_t5(initializer_factor: float = 1.0):
    """A tiny T5 with PEFT adapters sql, chat and code of different ranks on q and v."""
    from peft import LoraConfig, get_peft_model
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    config = T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
                      decoder_start_token_id=0, pad_token_id=0, eos_token_id=None,
                      initializer_factor=initializer_factor)
    model = None
    for name, rank, alpha in (("sql", 4, 8), ("chat", 8, 16), ("code", 2, 2)):
        cfg = LoraConfig(r=rank, lora_alpha=alpha, target_modules=["q", "v"], init_lora_weights=False)
        model = get_peft_model(T5ForConditionalGeneration(config).eval(), cfg, adapter_name=name) \
            if model is None else model
        if name not in model.peft_config:
            model.add_adapter(name, cfg)
    return model.eval()


def test_t5_encoder_and_decoder_of_different_lengths_on_per_row_adapters(device, inner):
    torch._dynamo.reset()
    model = _peft_t5()
    gen = torch.Generator().manual_seed(1)
    ids, decoder_ids = torch.randint(1, 64, (4, 8), generator=gen), torch.randint(1, 64, (4, 4), generator=gen)
    with torch.no_grad():
        reference = model(input_ids=ids, decoder_input_ids=decoder_ids, adapter_names=adapter_names_of(ROWS)).logits
    model.to(device)
    meta = xlp.LoRAMetadata(max_num_tokens=256)
    meta.register_adapters(model)
    compiled = torch.compile(model, backend=xlp.make_backend(meta, inner=inner))
    meta.set_request_adapters(ROWS)
    with torch.no_grad():
        logits = compiled(input_ids=ids.to(device), decoder_input_ids=decoder_ids.to(device)).logits.cpu()
    assert (logits - reference).abs().max().item() < 1e-4
    # q and v of 2 encoder blocks, and of the decoder's self- and cross-attention (v of cross-attention on the
    # encoder's 8 tokens, in the decoder's graph): all 12 sites rewritten, none left to compute one adapter.
    assert meta.stats["rewrites"] == {"lora_linear": 12}


@pytest.mark.compat
@pytest.mark.parametrize("cache", list(CACHES))
def test_t5_generate_on_the_compiled_model_is_exact_with_bounded_programs(device, inner, cache):
    """T5's generate: an encoder-decoder static cache, so a third generate with the rows rotated compiles nothing."""
    torch._dynamo.reset()
    model = _peft_t5(initializer_factor=10.0)  # larger weights: greedy tokens that change from step to step
    ids, mask = _t5_prompts()
    refs = [generate_rows(model, ids, mask, rows, cache) for rows in ROTATIONS]
    assert len({tuple(r.flatten().tolist()) for r in refs}) == 3, "the rotations must give different tokens"
    model.to(device)
    meta = xlp.LoRAMetadata(max_num_tokens=256)
    meta.register_adapters(model)
    compiled = torch.compile(model, backend=xlp.make_backend(meta, inner=inner))
    compiles = []
    for i, rows in enumerate(ROTATIONS):
        steps_before, compiles_before = sum(meta.stats["bucket_hits"].values()), device_compiles(device, meta)
        out = generate_rows(compiled, ids, mask, rows, cache, device)
        assert torch.equal(out, refs[i]), f"rotation {i}:\n{out}\n{refs[i]}"
        # The encoder once, then one decoder step per new token, each through a rewritten program.
        assert sum(meta.stats["bucket_hits"].values()) - steps_before == NEW_TOKENS + 1
        compiles.append(device_compiles(device, meta) - compiles_before)
    assert compiles[2] == 0, f"compiles per generate: {compiles}"
    assert meta.stats["compiles"] <= 8, dict(meta.stats["bucket_hits"])
    # q and v of the encoder's 2 blocks (4), the first decoder step's self- and cross-attention (8), the later
    # steps' (6: cross-attention's v reads the cache): every site rewritten, none left to compute one adapter.
    assert meta.stats["rewrites"] == {"lora_linear": 18}


def _t5_prompts():
    """Four prompts of 8 ids, the second left-padded by 3: the encoder's mask reaches the cross-attention."""
    ids = torch.randint(1, 64, (4, 8), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    return ids, mask


# (model, prompts, programs at least: llama's prompt step and decode step; T5's encoder, first and later
# decoder steps)
PRECOMPILED = {"llama": (lambda: tiny_peft_llama(seed=2)[0], left_padded_prompts, 2),
               "t5": (lambda: _peft_t5(initializer_factor=10.0), _t5_prompts, 3)}


@pytest.mark.parametrize("family", ["llama", pytest.param("t5", marks=pytest.mark.compat)])
def test_precompile_generate_warms_the_programs_generate_runs(device, inner, family):
    torch._dynamo.reset()
    make_model, prompts, programs = PRECOMPILED[family]
    model = make_model()
    ids, mask = prompts()
    reference = generate_rows(model, ids, mask, ROWS, "dynamic")
    model.to(device)
    meta = xlp.LoRAMetadata(max_num_tokens=256)
    meta.register_adapters(model)
    backend = xlp.make_backend(meta, inner=inner)
    compiled = torch.compile(model, backend=backend)
    warmed = backend.precompile_generate(compiled, batch_sizes=[4], prompt_lengths=[ids.shape[1]],
                                         max_new_tokens=NEW_TOKENS, progress=False)
    assert warmed == meta.stats["compiles"] >= programs
    device_before = device_compiles(device, meta)
    out = generate_rows(compiled, ids, mask, ROWS, "dynamic", device)
    assert torch.equal(out, reference)
    assert meta.stats["compiles"] == warmed, "generate compiled a program precompile_generate did not warm"
    # On XLA every program of the generate counts, HF's own per-step ops (one per sequence length) included.
    assert device_compiles(device, meta) == device_before, "the warmed generate compiled programs"


@pytest.mark.compat
def test_t5_beam_search_runs_its_encoder_on_the_prompt_rows(device, inner):
    """HF's generate runs an encoder-decoder's encoder once on the prompt rows and only then repeats each row
    for its beams and returned sequences; the encoder's call gets one mapping row per prompt row, every
    decoder step one per beam (this raised "the request mapping has 8 rows but this call has a batch of 4")."""
    torch._dynamo.reset()
    model = _peft_t5()  # T5's own initialisation: larger weights saturate the softmax and tie beams' scores
    ids, mask = _t5_prompts()
    refs = [generate_rows(model, ids, mask, rows, "dynamic", **BEAMS) for rows in ROTATIONS[:2]]
    assert not torch.equal(refs[0], refs[1]), "the rotations must give different tokens"
    model.to(device)
    meta = xlp.LoRAMetadata(max_num_tokens=256)
    meta.register_adapters(model)
    compiled = torch.compile(model, backend=xlp.make_backend(meta, inner=inner))
    for i, rows in enumerate(ROTATIONS[:2]):
        out = generate_rows(compiled, ids, mask, rows, "dynamic", device, **BEAMS)
        assert torch.equal(out, refs[i]), f"rotation {i}:\n{out}\n{refs[i]}"
    assert meta.stats["rewrites"]["lora_linear"] >= 18
