"""Generate cases shared by the generation tests: four left-padded prompts, rows on adapters, one call."""
import torch

ROWS = ["sql", "chat", None, "code"]
NEW_TOKENS = 16
CACHES = {"dynamic": {}, "static": {"cache_implementation": "static"}}


def adapter_names_of(rows):
    return ["__base__" if r is None else r for r in rows]


def left_padded_prompts():
    """Four left-padded prompts of lengths 6, 4, 5 and 3."""
    ids = torch.randint(3, 128, (4, 6), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    for row, pad in enumerate((0, 2, 1, 3)):
        ids[row, :pad], mask[row, :pad] = 0, 0
    return ids, mask


def generate_rows(model, ids, mask, rows, cache, device=None, **extra):
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0,
              adapter_names=adapter_names_of(rows), **CACHES[cache])
    kw.update(extra)
    if device is not None:
        kw.update(input_ids=ids.to(device), attention_mask=mask.to(device))
    with torch.no_grad():
        return model.generate(**kw).cpu()
