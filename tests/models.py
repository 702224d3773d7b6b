"""Small modules for pattern tests: PEFT-wrapped and hand-written."""
import types

import torch
import torch.nn as nn
from peft import LoraConfig, get_peft_model


class TwoLayer(nn.Module):
    """proj (the LoRA target) -> relu -> out."""

    def __init__(self, d_in=16, d_hidden=8, d_out=4):
        super().__init__()
        self.proj = nn.Linear(d_in, d_hidden, bias=False)
        self.out = nn.Linear(d_hidden, d_out)

    def forward(self, x):
        return self.out(torch.relu(self.proj(x)))


def peft_two_layer(adapters=(("sql", 2, 4), ("chat", 4, 4)), seed=0, **lora_kw):
    """TwoLayer with one PEFT adapter per (name, rank, alpha) on ``proj``, active adapter first."""
    return with_peft_adapters(TwoLayer, ["proj"], adapters, seed, **lora_kw)


def with_peft_adapters(make_base, targets, adapters, seed, **lora_kw):
    """``make_base()`` wrapped by PEFT with one adapter per (name, rank, alpha) on ``targets``, the first active."""
    torch.manual_seed(seed)
    model = None
    for name, r, alpha in adapters:
        cfg = LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, init_lora_weights=False, **lora_kw)
        if model is None:
            model = get_peft_model(make_base(), cfg, adapter_name=name)
        else:
            model.add_adapter(name, cfg)
    model.set_adapter(adapters[0][0])
    return model.eval()


def per_row_reference(model, x, rows):
    """Eager PEFT with row i of x on adapter rows[i] (None: base)."""
    with torch.no_grad():
        return model(x, adapter_names=["__base__" if r is None else r for r in rows])


class PooledHead(nn.Module):
    """RoBERTa's classification head: dense -> tanh -> out_proj on each row's first token."""

    def __init__(self, hidden, classes):
        super().__init__()
        self.dense = nn.Linear(hidden, hidden)
        self.out_proj = nn.Linear(hidden, classes)

    def forward(self, h):
        return self.out_proj(torch.tanh(self.dense(h[:, 0, :])))


class TinyLM(nn.Module):
    """An embedding, five linears, an ``lm_head`` and a pooled head: every kind of site, traced in a blink."""

    LINEARS = ("q", "k", "v", "up", "down")

    def __init__(self, vocab=32, hidden=16, classes=3):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.q, self.k, self.v = (nn.Linear(hidden, hidden) for _ in range(3))
        self.up = nn.Linear(hidden, 2 * hidden)
        self.down = nn.Linear(2 * hidden, hidden, bias=False)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        self.classifier = PooledHead(hidden, classes)

    def forward(self, ids):
        h = self.embed(ids)
        h = h + self.q(h) * torch.sigmoid(self.k(h)) + self.v(h)
        h = h + self.down(torch.relu(self.up(h)))
        return self.lm_head(h), self.classifier(h)


def peft_tiny_lm(adapters, dtype=torch.float32, seed=0, base=TinyLM):
    """TinyLM with PEFT adapters, each a dict: name, targets, and optionally r, alpha, modules_to_save,
    use_rslora, lora_bias.  Every LoRA weight and every saved copy is random (PEFT's copies start as the
    original, which would hide a copy served in the wrong row).  The first adapter is active.
    ``base``: what makes the TinyLM (one with tied weights, tests/test_tied_weights.py)."""
    torch.manual_seed(seed)
    model = None
    for spec in adapters:
        cfg = LoraConfig(r=spec.get("r", 2), lora_alpha=spec.get("alpha", 4), target_modules=list(spec["targets"]),
                         modules_to_save=list(spec.get("modules_to_save", ())) or None,
                         use_rslora=spec.get("use_rslora", False), lora_bias=spec.get("lora_bias", False),
                         init_lora_weights=False)
        if model is None:
            model = get_peft_model(base(), cfg, adapter_name=spec["name"])
        else:
            model.add_adapter(spec["name"], cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".modules_to_save." in name or "lora_B" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.set_adapter(adapters[0]["name"])
    return model.to(dtype).eval()


def _peft_mixes(model, rows) -> bool:
    """Whether PEFT's adapter_names= path runs this batch exactly (it raises midway otherwise, leaving its
    hooks, and a wrapper whose active adapter has no copy is disabled: PEFT then runs the original module
    for every row, the copies of the batch's adapters ignored, measured on peft 0.17.1)."""
    from peft.utils.other import ModulesToSaveWrapper

    for module in model.modules():
        if isinstance(module, ModulesToSaveWrapper):
            if not isinstance(module.original_module, (nn.Linear, nn.Embedding)):
                return False
            if any(r is not None and r not in module.modules_to_save for r in rows):
                return False
            if module.disable_adapters and any(r is not None for r in rows):
                return False
    return True


def per_row_eager(model, ids, rows):
    """Eager PEFT with row i on adapter rows[i] (None: base): PEFT's own mixed batch, or, where PEFT refuses
    one, one eager run per row's adapter.  PEFT refuses a saved module that is not a Linear or Embedding
    (TypeError), and fails on a saved module without a copy for one of the batch's adapters (KeyError)."""
    names = ["__base__" if r is None else r for r in rows]
    with torch.no_grad():
        if _peft_mixes(model, rows):
            return model(ids, adapter_names=names)
    return per_row_around(model, model, ids, rows)


def per_row_around(model, peft_model, ids, rows):
    """``model`` (a module that calls ``peft_model`` or reads its layers) run eagerly once per row, row i with
    ``peft_model``'s adapter rows[i] active (None: adapters disabled); outputs concatenated like ``model``'s."""
    active = peft_model.active_adapter
    outs = []
    try:
        with torch.no_grad():
            for i, r in enumerate(rows):
                if r is None:
                    with peft_model.disable_adapter():
                        outs.append(model(ids[i:i + 1]))
                else:
                    peft_model.set_adapter(r)
                    outs.append(model(ids[i:i + 1]))
    finally:
        peft_model.set_adapter(active)
    if hasattr(outs[0], "logits"):  # a transformers ModelOutput
        return types.SimpleNamespace(logits=torch.cat([o.logits for o in outs]))
    if isinstance(outs[0], torch.Tensor):
        return torch.cat(outs)
    return tuple(torch.cat(parts) for parts in zip(*outs))


class TwoStacks(nn.Module):
    """An encoder stack and a decoder stack of other lengths on the same rows, and a head on pooled rows.

    ``enc`` sees ``[B, S]``, ``dec`` ``[B, S2]``, ``head`` the pooled ``[B, H]``
    (the shapes of T5's encoder, decoder and a classification head in one graph).
    """

    def __init__(self, d=16, d_out=4):
        super().__init__()
        self.enc = nn.Linear(d, d, bias=False)
        self.dec = nn.Linear(d, d, bias=False)
        self.head = nn.Linear(d, d_out, bias=False)

    def forward(self, x_enc, x_dec):
        memory = self.enc(x_enc)
        hidden = self.dec(x_dec) + memory.mean(dim=1, keepdim=True)
        return self.head(hidden.mean(dim=1)), hidden


def peft_two_stacks(adapters=(("sql", 2, 4), ("chat", 4, 4)), seed=0):
    """TwoStacks with one PEFT adapter per (name, rank, alpha) on enc, dec and head."""
    return with_peft_adapters(TwoStacks, ["enc", "dec", "head"], adapters, seed)
