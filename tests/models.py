"""Small modules for pattern tests: PEFT-wrapped and hand-written."""
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
    torch.manual_seed(seed)
    model = None
    for name, r, alpha in adapters:
        cfg = LoraConfig(r=r, lora_alpha=alpha, target_modules=["proj"], init_lora_weights=False, **lora_kw)
        if model is None:
            model = get_peft_model(TwoLayer(), cfg, adapter_name=name)
        else:
            model.add_adapter(name, cfg)
    model.set_adapter(adapters[0][0])
    return model.eval()


def per_row_reference(model, x, rows):
    """Eager PEFT with row i of x on adapter rows[i] (None: base)."""
    with torch.no_grad():
        return model(x, adapter_names=["__base__" if r is None else r for r in rows])


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
    torch.manual_seed(seed)
    model = None
    for name, r, alpha in adapters:
        cfg = LoraConfig(r=r, lora_alpha=alpha, target_modules=["enc", "dec", "head"], init_lora_weights=False)
        if model is None:
            model = get_peft_model(TwoStacks(), cfg, adapter_name=name)
        else:
            model.add_adapter(name, cfg)
    model.set_adapter(adapters[0][0])
    return model.eval()
