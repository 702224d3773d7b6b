"""Tiny PEFT models built from configs with random weights (nothing is downloaded).

Shared by the demo, the dump tool's built-in factories, the tests and bench/.
"""
from __future__ import annotations

from typing import Sequence, Tuple

import torch

DEFAULT_ADAPTERS = (("sql", 4, 8), ("chat", 8, 16), ("code", 2, 2))  # (name, rank, alpha): every scaling differs


def tiny_llama_config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, **kw):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
                       num_hidden_layers=num_hidden_layers, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=2048, **kw)


def tiny_peft_llama(targets: Sequence[str] = ("q_proj", "v_proj"), adapters=DEFAULT_ADAPTERS, seed: int = 0,
                    dtype=torch.float32, **config_kw) -> Tuple[torch.nn.Module, list]:
    """A tiny ``LlamaForCausalLM`` with PEFT LoRA adapters of non-zero random weights, in eval mode."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_llama_config(**config_kw)).to(dtype).eval()
    return _add_adapters(model, targets, adapters, get_peft_model, LoraConfig, dtype)


def tiny_peft_gpt2(targets: Sequence[str] = ("c_attn",), adapters=DEFAULT_ADAPTERS, seed: int = 0,
                   dtype=torch.float32) -> Tuple[torch.nn.Module, list]:
    """A tiny ``GPT2LMHeadModel`` (Conv1D layers) with PEFT LoRA adapters, in eval mode."""
    from peft import LoraConfig, get_peft_model
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=128, n_embd=32, n_layer=2, n_head=4, n_positions=2048)
    model = GPT2LMHeadModel(cfg).to(dtype).eval()
    return _add_adapters(model, targets, adapters, get_peft_model, LoraConfig, dtype, fan_in_fan_out=True)


def _add_adapters(model, targets, adapters, get_peft_model, LoraConfig, dtype, **lora_kw):
    names = []
    peft_model = None
    for name, rank, alpha in adapters:
        cfg = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets) if not isinstance(targets, str)
                         else targets, init_lora_weights=False, **lora_kw)
        if peft_model is None:
            peft_model = get_peft_model(model, cfg, adapter_name=name)
        else:
            peft_model.add_adapter(name, cfg)
        names.append(name)
    peft_model.set_adapter(names[0])
    return peft_model.to(dtype).eval(), names


def per_sequence_mapping(adapter_per_row: Sequence, seq_len: int) -> list:
    """One entry per flattened token: every token of row i uses ``adapter_per_row[i]``."""
    return [a for a in adapter_per_row for _ in range(seq_len)]


def eager_reference(peft_model, input_ids: torch.Tensor, adapter_per_row: Sequence) -> torch.Tensor:
    """Logits of eager PEFT with each sequence on its own adapter (None = base model)."""
    names = ["__base__" if a is None else a for a in adapter_per_row]
    with torch.no_grad():
        return peft_model(input_ids=input_ids, adapter_names=names).logits


def adapter_table(peft_model) -> dict:
    """``{site: {adapter: (A [r, in], B [out, r], scaling)}}`` copied from the PEFT LoRA linear layers."""
    from peft.tuners.lora import Linear as LoraLinear

    table = {}
    for name, mod in peft_model.named_modules():
        if isinstance(mod, LoraLinear):
            table[name] = {a: (mod.lora_A[a].weight.detach().clone(), mod.lora_B[a].weight.detach().clone(),
                               float(mod.scaling[a])) for a in mod.lora_A}
    return table


def per_token_reference(peft_model, input_ids: torch.Tensor, mapping: Sequence, table=None) -> torch.Tensor:
    """Logits of the eager base model plus each token's own adapter delta at every LoRA linear layer.

    ``mapping`` has one adapter name (or None: base only) per flattened
    token.  The ground truth for mappings PEFT's ``adapter_names=`` (one
    adapter per sequence) cannot express, such as requests packed into one
    row; computed with plain matmuls, nothing of this package.  ``table``
    (``adapter_table``) when the model's own weights are not the ones to use.
    """
    from peft.tuners.lora import Linear as LoraLinear

    table = adapter_table(peft_model) if table is None else table
    handles = []

    def hook(site, module, args, out):
        x = args[0].reshape(-1, args[0].shape[-1])
        delta = torch.zeros(x.shape[0], out.shape[-1], dtype=out.dtype, device=out.device)
        for adapter, (a, b, s) in table.get(site, {}).items():
            rows = torch.tensor([m == adapter for m in mapping], device=x.device)
            delta[rows] = (s * (x[rows] @ a.t().to(x) @ b.t().to(x))).to(out.dtype)
        return out + delta.reshape(out.shape)

    for name, mod in peft_model.named_modules():
        if isinstance(mod, LoraLinear):
            handles.append(mod.register_forward_hook(lambda m, a, o, site=name: hook(site, m, a, o)))
    try:
        with peft_model.disable_adapter(), torch.no_grad():
            return peft_model(input_ids=input_ids).logits
    finally:
        for h in handles:
            h.remove()


# ---------------------------------------------------------------------------
# Factories for ``xla-lora-dump MODULE:FACTORY``: each returns (model, example
# inputs), the inputs a dict of keyword arguments or a tuple of positional ones.
# ---------------------------------------------------------------------------


def _demo_input_ids(batch: int, seq_len: int) -> torch.Tensor:
    return torch.randint(0, 128, (batch, seq_len), generator=torch.Generator().manual_seed(1))


def demo_llama(batch: int = 2, seq_len: int = 6):
    """The demo's tiny PEFT Llama (adapters sql, chat, code on q_proj and v_proj) and its ``input_ids``.

    Every LoRA site is rewritten: 4 sites, no near miss.
    """
    model, _ = tiny_peft_llama()
    return model, {"input_ids": _demo_input_ids(batch, seq_len)}


DORA_ADAPTER = "dora"


def demo_llama_with_dora(batch: int = 2, seq_len: int = 6):
    """``demo_llama`` plus a fourth adapter using DoRA on v_proj: every site is rewritten.

    The v_proj sites also rescale the rows of DoRA slots per token
    (``bgmv_dora``), with magnitude / ||W + s*B@A|| folded into per-slot
    constants at registration; rows of other adapters are left as the
    expand made them.
    """
    from peft import LoraConfig

    model, names = tiny_peft_llama()
    model.add_adapter(DORA_ADAPTER, LoraConfig(r=2, lora_alpha=4, target_modules=["v_proj"], use_dora=True,
                                               init_lora_weights=False))
    model.set_adapter(names[0])
    return model.eval(), {"input_ids": _demo_input_ids(batch, seq_len)}


def demo_llama_with_near_misses(batch: int = 2, seq_len: int = 6):
    """``demo_llama`` whose v_proj layers scale their delta per output channel: the v_proj sites are near misses.

    A layer that multiplies its delta by a vector instead of one number per
    adapter (a custom variant) is not the computation the kernels do, so both
    v_proj sites are left alone and reported with that reason, while both
    q_proj sites are rewritten.  (One number held in a tensor, as PEFT's
    ``prepare_model_for_compiled_hotswap`` makes it, is served.)
    """
    import torch

    model, names = tiny_peft_llama()
    for name, module in model.named_modules():
        if name.endswith("v_proj") and hasattr(module, "scaling"):
            module.scaling[names[0]] = torch.full((module.out_features,), module.scaling[names[0]])
    return model, {"input_ids": _demo_input_ids(batch, seq_len)}
