"""Tiny models with LoRA that PEFT did not make: torchtune, loralib and hand-written modules.

Every adapter weight is random and non-zero (the libraries initialise B to
zero, which would hide a wrong result).  Each factory returns the model in
eval mode; its inputs are token ids ``[B, S]`` over ``VOCAB``.
"""
import torch
import torch.nn as nn

VOCAB = 64


def randomize_lora(model: nn.Module, seed: int) -> dict:
    """A new random value for every LoRA parameter, keyed as in the model's own state dict."""
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(v.shape, generator=g) * 0.3 for k, v in model.state_dict().items() if _is_lora(k)}


def without_lora(model: nn.Module) -> dict:
    """Every LoRA B zeroed: the base model's output, computed by the module itself."""
    return {k: torch.zeros_like(v) for k, v in model.state_dict().items() if _is_lora(k) and _is_b(k)}


def _is_lora(key: str) -> bool:
    return any(p in ("lora_a", "lora_b", "lora_A", "lora_B") for p in key.split("."))


def _is_b(key: str) -> bool:
    return any(p in ("lora_b", "lora_B") for p in key.split("."))


def torchtune_llama():
    """torchtune's ``lora_llama2`` builder on a tiny config, LoRA on q/v projections and the MLP."""
    from torchtune.models.llama2 import lora_llama2

    torch.manual_seed(0)
    model = lora_llama2(lora_attn_modules=["q_proj", "v_proj"], apply_lora_to_mlp=True, vocab_size=VOCAB,
                        num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=32, max_seq_len=128,
                        lora_rank=4, lora_alpha=8.0)
    model.load_state_dict(randomize_lora(model, 1), strict=False)
    return model.eval()


class LoralibNet(nn.Module):
    """loralib ``Embedding`` -> ``Linear`` -> relu -> ``Linear`` (fan_in_fan_out, GPT-2 layout) -> logits."""

    def __init__(self):
        super().__init__()
        import loralib

        self.embed = loralib.Embedding(VOCAB, 24, r=4, lora_alpha=8, merge_weights=False)
        self.up = loralib.Linear(24, 32, r=4, lora_alpha=4, merge_weights=False)
        self.down = loralib.Linear(32, 24, r=2, lora_alpha=6, fan_in_fan_out=True, merge_weights=False)
        self.head = nn.Linear(24, VOCAB)

    def forward(self, ids):
        return self.head(self.down(torch.relu(self.up(self.embed(ids)))))


def loralib_net():
    torch.manual_seed(0)
    model = LoralibNet()
    model.load_state_dict(randomize_lora(model, 1), strict=False)
    model.eval()  # loralib's train() returns None: no chaining
    return model


class LoralibMergedNet(nn.Module):
    """loralib ``MergedLinear`` qkv (LoRA on q and v) -> ``MergedLinear`` (fan_in_fan_out, LoRA on half) -> logits."""

    def __init__(self):
        super().__init__()
        import loralib

        self.embed = nn.Embedding(VOCAB, 24)
        self.qkv = loralib.MergedLinear(24, 72, r=4, lora_alpha=8, enable_lora=[True, False, True],
                                        lora_dropout=0.1, merge_weights=False)
        self.proj = loralib.MergedLinear(72, 24, r=2, lora_alpha=6, enable_lora=[False, True], fan_in_fan_out=True,
                                         merge_weights=False)
        self.head = nn.Linear(24, VOCAB)

    def forward(self, ids):
        h = self.embed(ids)
        q, k, v = self.qkv(h).chunk(3, dim=-1)
        return self.head(h + self.proj(torch.cat([q * torch.sigmoid(k), v, q], dim=-1)))


def loralib_merged_net():
    torch.manual_seed(0)
    model = LoralibMergedNet()
    model.load_state_dict(randomize_lora(model, 1), strict=False)
    model.eval()
    return model


class MatmulLoRA(nn.Module):
    """``base(x) + (x @ A.T @ B.T) * s`` with A and B as parameters."""

    def __init__(self, d_in, d_out, rank, scaling):
        super().__init__()
        self.base = nn.Linear(d_in, d_out)
        self.lora_A = nn.Parameter(torch.zeros(rank, d_in))
        self.lora_B = nn.Parameter(torch.zeros(d_out, rank))
        self.scaling = scaling

    def forward(self, x):
        return self.base(x) + (x @ self.lora_A.T @ self.lora_B.T) * self.scaling


class LinearChildrenLoRA(nn.Module):
    """``base(x) + lora_B(lora_A(dropout(x))) * (alpha / rank)`` with nn.Linear children."""

    def __init__(self, d_in, d_out, rank, alpha):
        super().__init__()
        self.base = nn.Linear(d_in, d_out, bias=False)
        self.lora_A = nn.Linear(d_in, rank, bias=False)
        self.lora_B = nn.Linear(rank, d_out, bias=False)
        self.dropout = nn.Dropout(0.1)
        self.alpha, self.rank = alpha, rank

    def forward(self, x):
        return self.base(x) + self.lora_B(self.lora_A(self.dropout(x))) * (self.alpha / self.rank)


class HandwrittenNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 24)
        self.attn = MatmulLoRA(24, 24, rank=4, scaling=0.5)
        self.mlp = LinearChildrenLoRA(24, 24, rank=2, alpha=4.0)
        self.head = nn.Linear(24, VOCAB)

    def forward(self, ids):
        h = self.embed(ids)
        h = h + torch.tanh(self.attn(h))
        return self.head(h + self.mlp(h))


def handwritten_net():
    torch.manual_seed(0)
    model = HandwrittenNet()
    model.load_state_dict(randomize_lora(model, 1), strict=False)
    return model.eval()
