"""The mapping half of the ``LoRAMetadata`` facade: setting the token or request mapping, and reading it.

``LoRAMetadata`` inherits these methods; they use its lock, its token
mapping (``self._tokens``), its pool and its adapter stacks.
"""
from __future__ import annotations

import contextlib
from typing import Optional, Sequence, Union

import torch

from .locking import forward as _forward
from .locking import locked as _locked
from .token_mapping import TokenAdapter, TokenMapping


class MappingFacade:
    """Which adapter each token uses: set once per step, read by every compiled call."""

    # --------------------------------------------------------------- mapping
    @_locked
    def set_token_adapters(self, mapping: Union[Sequence[TokenAdapter], torch.Tensor]) -> None:
        """Set each flattened token's adapter: a name, a slot number, or None / -1 for base.

        Valid for calls with exactly that many tokens; replaces a request mapping.
        """
        self._set_mapping(self._tokens.set_tokens, mapping, "set_token_adapters", "token")

    @_locked
    def set_request_adapters(self, rows: Union[Sequence[TokenAdapter], torch.Tensor]) -> None:
        """Set each batch row's adapter (a name, a slot number, or None / -1 for base), for every later call.

        Each compiled graph lays the rows over its own token dims: every token
        of row b (``[B, S]`` prompts, ``[B, 1]`` decode steps, a pooled
        ``[B]``, an encoder and a decoder of different lengths) uses
        ``rows[b]``, until the next ``set_request_adapters`` or
        ``set_token_adapters``.  A call whose batch is not ``len(rows)`` is refused.
        """
        self._set_mapping(self._tokens.set_requests, rows, "set_request_adapters", "row")

    def _set_mapping(self, set_fn, mapping, caller: str, unit: str) -> None:
        """Check the mapping, turn it into slot numbers once, loading what no slot holds (``AdapterPool.slots_for``),
        then set it.  The mapping set last, asked again, only counts its adapters as used again.  Refused after a swap, the old mapping
        goes too."""
        slots = list(self._adapters.slots)
        entries = _entries_key(mapping)
        key = (unit, entries, tuple(slots))
        if entries is not None and self._tokens.is_current(key):
            self._pool.reuse_last()  # the same hits and recency as before; no conversion, no rebuilt step values
            return
        try:
            indices = self._pool.slots_for(mapping, caller, unit)
            set_fn(indices, (unit, entries, tuple(self._adapters.slots)))
        except Exception:
            if self._adapters.slots != slots:
                self._tokens.forget()  # its slot numbers may now mean other adapters
            raise

    @contextlib.contextmanager
    def warming_up(self):
        """Within: compiled graphs skip the mapping checks and every token is on the base model."""
        with self._lock:
            saved = self._tokens.enter_warm_up()
        try:
            yield self
        finally:
            with self._lock:
                self._tokens.exit_warm_up(saved)

    @property
    @_locked
    def is_warming_up(self) -> bool:
        return self._tokens.warming_up

    @property
    @_locked
    def num_tokens(self) -> Optional[int]:
        """Length of the current token mapping (None without one, e.g. under a request mapping)."""
        mapping = self._tokens.mapping()
        return None if mapping is None else int(mapping.numel())

    @property
    @_locked
    def has_mapping(self) -> bool:
        """Whether a token or a request mapping is set."""
        return self._tokens.has_mapping

    mapping = _forward("_tokens", TokenMapping.mapping)
    request_adapters = _forward("_tokens", TokenMapping.request_adapters)
    mapped_slots = _forward("_tokens", TokenMapping.mapped_slots)
    token_mapping = _forward("_tokens", TokenMapping.token_mapping)
    check_mapping_fits = _forward("_tokens", TokenMapping.check_fits)

    # ------------------------------------------- per-step values (metadata/token_mapping.py)
    token_indices = _forward("_tokens", TokenMapping.token_indices)
    rows_uniform = _forward("_tokens", TokenMapping.rows_uniform)
    row_slots = _forward("_tokens", TokenMapping.row_slots)

    step_value = _forward("_tokens", TokenMapping.step_value)


def _entries_key(mapping) -> Optional[tuple]:
    """What a mapping asked for, comparable with the next one's (a tensor by its values); None for what is no
    mapping at all (the checks refuse it)."""
    if isinstance(mapping, torch.Tensor):
        return ("tensor", str(mapping.dtype), tuple(mapping.shape), tuple(mapping.reshape(-1).tolist()))
    if isinstance(mapping, Sequence) and not isinstance(mapping, (str, bytes)):
        return tuple(mapping)
    return None
