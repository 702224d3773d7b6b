"""A saved PEFT adapter directory (``save_pretrained``), read as data only.

``adapter_config.json`` is parsed as JSON (no PEFT import, no code run) and
the weights come from ``adapter_model.safetensors`` (a flat table of
tensors), or else ``adapter_model.bin`` through ``torch.load(weights_only=True)``,
which unpickles tensors and plain containers only.  Whatever does not fit the
registered sites is refused by ``load_adapter`` before any slot changes.  A
file that cannot be read as what it should be (truncated, corrupt, not JSON,
missing) raises ``AdapterFileError`` naming the file, whatever the library
underneath raised: a serving loop catches one type, and the message says which
adapter and which file to fix.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from typing import Dict, Mapping, Tuple

import torch

from ...errors import AdapterFileError, AdapterFileNotFoundError

CONFIG_FILE = "adapter_config.json"
SAFETENSORS_FILE = "adapter_model.safetensors"
PICKLE_FILE = "adapter_model.bin"


@dataclasses.dataclass(frozen=True)
class SavedLoraConfig:
    """The fields of a saved ``LoraConfig`` that decide each site's scaling."""

    lora_alpha: float
    use_rslora: bool = False
    use_dora: bool = False
    alpha_pattern: Mapping[str, float] = dataclasses.field(default_factory=dict)

    def scaling_for(self, site: str, rank: int) -> float:
        """PEFT's scaling at ``site`` for an adapter of ``rank``: alpha / r, or alpha / sqrt(r) with rsLoRA."""
        alpha = self.lora_alpha
        for pattern, value in self.alpha_pattern.items():  # PEFT matches a pattern against the key's end
            if re.match(rf"(.*\.)?{pattern}$", site):
                alpha = value
                break
        return alpha / math.sqrt(rank) if self.use_rslora else alpha / rank


def read_adapter_dir(where: str, path) -> Tuple[Dict[str, torch.Tensor], SavedLoraConfig]:
    """(state dict, config) of a saved PEFT LoRA adapter; refuses what load_adapter cannot serve."""
    path = os.fspath(path)
    config_path = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(config_path):
        raise AdapterFileNotFoundError(f"{where}: {path!r} has no {CONFIG_FILE}: give a directory written by PEFT's "
                                       "save_pretrained, or a state dict")
    try:
        with open(config_path, encoding="utf-8") as f:
            raw = json.load(f)
    except (OSError, ValueError) as e:  # unreadable, not UTF-8, not JSON (JSONDecodeError is a ValueError)
        raise AdapterFileError(f"{where}: {config_path!r} cannot be read as JSON ({_why(e)}); save the adapter "
                               "again with PEFT's save_pretrained") from e
    if not isinstance(raw, dict):
        raise AdapterFileError(f"{where}: {config_path!r} is not a JSON object (got a {type(raw).__name__})")
    if raw.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{where}: {config_path} is a {raw.get('peft_type')} adapter; only LoRA is served")
    for field, why in (("modules_to_save", "full module copies"), ("lora_bias", "a LoRA bias")):
        if raw.get(field):
            raise ValueError(f"{where}: {config_path} sets {field}: {why} cannot be loaded into a slot; "
                             "register a model that holds this adapter instead")
    alpha = raw.get("lora_alpha")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise AdapterFileError(f"{where}: {config_path!r} has no finite number lora_alpha (got {alpha!r:.40})")
    alpha_pattern = raw.get("alpha_pattern") or {}
    if not isinstance(alpha_pattern, dict) or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) for v in alpha_pattern.values()):
        raise AdapterFileError(f"{where}: {config_path!r} alpha_pattern must map patterns to numbers")
    config = SavedLoraConfig(lora_alpha=float(alpha), use_rslora=bool(raw.get("use_rslora", False)),
                             use_dora=bool(raw.get("use_dora", False)),
                             alpha_pattern={str(k): float(v) for k, v in alpha_pattern.items()})
    return _read_weights(where, path), config


def _read_weights(where: str, path: str) -> Dict[str, torch.Tensor]:
    tensors = os.path.join(path, SAFETENSORS_FILE)
    if os.path.isfile(tensors):
        from safetensors.torch import load_file

        try:
            return load_file(tensors, device="cpu")
        except Exception as e:  # noqa: BLE001  SafetensorError, OSError, ...: all say the file is bad
            raise AdapterFileError(f"{where}: {tensors!r} is not a readable safetensors file ({_why(e)}); save "
                                   "the adapter again with PEFT's save_pretrained") from e
    pickled = os.path.join(path, PICKLE_FILE)
    if os.path.isfile(pickled):
        try:
            state = torch.load(pickled, map_location="cpu", weights_only=True)  # tensors and containers only
        except Exception as e:  # noqa: BLE001  a corrupt archive, or a pickled object weights_only refuses
            raise AdapterFileError(f"{where}: {pickled!r} cannot be loaded with torch.load(weights_only=True) "
                                   f"({_why(e)})") from e
        if not isinstance(state, dict):
            raise AdapterFileError(f"{where}: {pickled!r} holds a {type(state).__name__}, not a state dict")
        return state
    raise AdapterFileNotFoundError(f"{where}: {path!r} has neither {SAFETENSORS_FILE} nor {PICKLE_FILE}")


def _why(error: Exception) -> str:
    """The library's own error in one line: its type and the first line of its message."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"
