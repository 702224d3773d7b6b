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
