"""The decode benchmark's stream: a model, its static KV cache and the next cache position (bench/decode_step.py)."""
from __future__ import annotations

import _common  # noqa: F401  (sets PJRT_DEVICE before torch_xla loads)
import torch


def static_cache(model, max_len: int, batch: int = 1):
    """HF's ``StaticCache`` of ``max_len`` positions for ``batch`` rows of ``model``, allocated on the model's
    device at once (transformers 5 otherwise keeps a host tensor until the first update, inside the program)."""
    from xla_lora_pass.serving.static_cache import static_cache as make

    weight = next(model.parameters())
    return make(model.config, max_len, batch, weight.dtype, weight.device)


class Stream:
    """One configuration's model, cache and next cache position: prefill, then one decode step per call."""

    def __init__(self, model, prompt_ids, decode_ids, max_len: int):
        self.model, self.prompt_ids, self.decode_ids, self.max_len = model, prompt_ids, decode_ids, max_len
        self.cache, self.pos = None, None
        self.device = prompt_ids.device

    @torch.no_grad()
    def prefill(self, logits_to_keep: int = 0):
        """A fresh cache filled with the prompt; returns the logits on the CPU (of the last ``logits_to_keep``
        positions, 0: all)."""
        if self.cache is None:
            self.cache = static_cache(self.model, self.max_len, self.prompt_ids.shape[0])
        else:
            self.cache.reset()  # transformers 5's StaticLayer writes at its own count: reset before reuse
        s = self.prompt_ids.shape[1]
        out = self.model(input_ids=self.prompt_ids, past_key_values=self.cache, use_cache=True,
                         cache_position=torch.arange(s, device=self.device), logits_to_keep=logits_to_keep)
        self.pos = s
        return out.logits.cpu()

    def prompt(self):
        """The prefill as generate's prompt step runs it: the last position's logits only."""
        return self.prefill(logits_to_keep=1)

    @torch.no_grad()
    def decode(self):
        """One [B, 1] step at the next position; returns the logits on the CPU."""
        if self.pos is None or self.pos >= self.max_len:
            self.prefill()
        out = self.model(input_ids=self.decode_ids, past_key_values=self.cache, use_cache=True,
                         cache_position=torch.tensor([self.pos], device=self.device))
        self.pos += 1
        return out.logits.cpu()


def eager_decode_reference(peft_cpu, prompt, step_ids, rows, max_len):
    """Eager PEFT's mixed batch (``adapter_names=``): the logits of the first decode step after the prompt."""
    names = ["__base__" if a is None else a for a in rows]
    cache = static_cache(peft_cpu, max_len, prompt.shape[0])
    with torch.no_grad():
        peft_cpu(input_ids=prompt, past_key_values=cache, use_cache=True, adapter_names=names,
                 cache_position=torch.arange(prompt.shape[1]))
        return peft_cpu(input_ids=step_ids, past_key_values=cache, use_cache=True, adapter_names=names,
                        cache_position=torch.tensor([prompt.shape[1]])).logits
