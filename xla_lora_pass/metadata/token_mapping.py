"""The token mapping (which slot each token or batch row uses) and every per-step value built from it.

Host first, device once: the mapping is built on the host and each value
derived from it (token indices, row slots, and each kernel's own inputs through ``step_value``)
is copied to the device once per mapping and bucket, into a buffer sized for
``max_num_tokens`` so its shape never changes (the graph narrows it).  All of
them live in one :class:`StepCache`, dropped whenever the mapping changes.

Not locked itself: ``LoRAMetadata`` holds its lock around every call.
"""
from __future__ import annotations

import math
import numbers
from typing import Callable, Dict, Hashable, Iterator, List, Optional, Sequence, Tuple, Union

import torch

from ..errors import UnsupportedMappingError

NO_LORA = -1
TokenAdapter = Union[str, int, None]


class StepCache:
    """Values derived from the current mapping: each built once per key, all dropped together."""

    def __init__(self):
        self._values: Dict[Hashable, object] = {}

    def get(self, key: Hashable, build: Callable[[], object]):
        """The value under ``key``, built by ``build()`` the first time (a build that raises caches nothing)."""
        if key not in self._values:
            self._values[key] = build()
        return self._values[key]

    def clear(self) -> None:
        self._values.clear()

    def __len__(self) -> int:
        return len(self._values)

    def tensors(self) -> Iterator[torch.Tensor]:
        """Every cached tensor, those inside tuples too (e.g. to check their device placement)."""
        for value in self._values.values():
            yield from (t for t in (value if isinstance(value, tuple) else (value,)) if isinstance(t, torch.Tensor))


class TokenMapping:
    """The current token or request mapping, the warm-up state, and the step values derived from them."""

    def __init__(self, max_num_tokens: int):
        self.max_num_tokens = max_num_tokens
        self._tokens: Optional[torch.Tensor] = None  # per flattened token (set_token_adapters)
        self._rows: Optional[torch.Tensor] = None  # per batch row (set_request_adapters)
        self._key: Hashable = None  # what the current mapping was set from (is_current)
        self._mapped: Optional[frozenset] = None
        self.warming_up = False
        self.cache = StepCache()

    def _set(self, tokens: Optional[torch.Tensor], rows: Optional[torch.Tensor], key: Hashable = None) -> None:
        """The one place the mapping changes, so nothing built from the old one survives it."""
        self._tokens, self._rows, self._key = tokens, rows, key
        self._mapped = None  # mapped_slots, once asked
        self.cache.clear()

    def is_current(self, key: Hashable) -> bool:
        """Whether the mapping set with ``key`` (what the caller asked, and the slots it meant) is the current
        one: setting it again would change nothing, so it costs nothing (as vLLM's ``set_lora_mapping``)."""
        return key is not None and key == self._key

    def set_tokens(self, indices: torch.Tensor, key: Hashable = None) -> None:
        """Set one slot per flattened token: host int32 ``indices`` (checked by ``to_indices``)."""
        if len(indices) > self.max_num_tokens:
            raise ValueError(f"set_token_adapters: {len(indices)} tokens exceed max_num_tokens={self.max_num_tokens}")
        self._set(indices, None, key)

    def set_requests(self, indices: torch.Tensor, key: Hashable = None) -> None:
        """Set one slot per batch row: host int32 ``indices`` (checked by ``to_indices``)."""
        if not len(indices):
            raise ValueError("set_request_adapters: give one entry per batch row, got none")
        if len(indices) > self.max_num_tokens:
            raise ValueError(f"set_request_adapters: {len(indices)} rows exceed max_num_tokens={self.max_num_tokens}")
        self._set(None, indices, key)

    def forget(self) -> None:
        """Drop the mapping: slot numbers may now mean other adapters, so an old mapping would pick the wrong ones."""
        self._set(None, None)

    def enter_warm_up(self) -> tuple:
        """Every token on the base model until :meth:`exit_warm_up`; returns the mapping to restore."""
        saved = self._tokens, self._rows, self._key
        self._set(None, None)
        self.warming_up = True
        return saved

    def exit_warm_up(self, saved: tuple) -> None:
        self._set(*saved)
        self.warming_up = False

    # -------------------------------------------------------------- reading
    def mapping(self) -> Optional[torch.Tensor]:
        """The current host int32 token indices (None under a request mapping: see ``token_mapping``)."""
        return self._tokens

    def request_adapters(self) -> Optional[torch.Tensor]:
        """The current host int32 slot of each batch row (None unless ``set_request_adapters`` set it)."""
        return self._rows

    @property
    def has_mapping(self) -> bool:
        return self._tokens is not None or self._rows is not None

    def mapped_slots(self) -> Optional[set]:
        """The slots (and -1) the current mapping uses, or None without a mapping (found once per mapping: every
        compiled call asks)."""
        current = self._tokens if self._tokens is not None else self._rows
        if current is None:
            return None
        if self._mapped is None:
            self._mapped = frozenset(current.unique().tolist())
        return set(self._mapped)

    def token_mapping(self, real_dims: Tuple[int, ...]) -> Optional[torch.Tensor]:
        """Host int32 indices, one per token of a call with token dims ``real_dims`` (row-major).

        A request mapping is laid over the dims: row b's slot for every token
        of row b (``real_dims[0]`` must be the number of rows).  None without
        a mapping.  Raises ``UnsupportedMappingError`` naming both sizes when
        the mapping does not fit this call.
        """
        real_dims = tuple(int(d) for d in real_dims)
        self._check_fits(real_dims)
        rows = self._rows
        if rows is not None:
            want = math.prod(real_dims)
            return rows.repeat_interleave(want // rows.numel()) if want else rows[:0]
        return self._tokens

    def _check_fits(self, real_dims: Tuple[int, ...]) -> None:
        """Raise ``UnsupportedMappingError``, naming both sizes, unless the mapping fits token dims ``real_dims``."""
        want = math.prod(real_dims)
        rows = self._rows
        if rows is not None:
            if not real_dims or real_dims[0] != rows.numel():
                raise UnsupportedMappingError(
                    f"the request mapping has {rows.numel()} rows but this call has a batch of "
                    f"{real_dims[0] if real_dims else 0} (token dims {list(real_dims)}); call "
                    "set_request_adapters with one entry per batch row")
        elif self._tokens is not None and self._tokens.numel() != want:
            raise UnsupportedMappingError(
                f"the token mapping has {self._tokens.numel()} entries but this call has {want} tokens "
                f"(token dims {list(real_dims)}); set one entry per flattened token, or one per batch row "
                "with set_request_adapters")

    def check_fits(self, real_dims: Tuple[int, ...]) -> None:
        """Raise as :meth:`token_mapping` does unless the mapping fits a call with token dims ``real_dims``;
        every compiled call checks, so each mapping and token dims is checked once."""
        real_dims = tuple(int(d) for d in real_dims)

        def check() -> bool:
            self._check_fits(real_dims)  # a raise caches nothing
            return True
        self.cache.get(("fits", real_dims), check)

    def _padded_grid(self, real_dims, padded_dims) -> torch.Tensor:
        """Host int32 indices of the padded bucket, flattened: the mapping, -1 on padding."""
        mapping = self.token_mapping(real_dims)
        if mapping is None:
            mapping = torch.full((math.prod(real_dims),), NO_LORA, dtype=torch.int32)
        grid = torch.full(tuple(padded_dims), NO_LORA, dtype=torch.int32)
        grid[tuple(slice(0, d) for d in real_dims)] = mapping.reshape(tuple(real_dims))
        return grid.reshape(-1)

    def _full_buffer(self, values: torch.Tensor) -> torch.Tensor:
        """Host int32 ``[max_num_tokens]``: ``values`` first, -1 after, so the tail never picks an adapter."""
        host = torch.full((self.max_num_tokens,), NO_LORA, dtype=torch.int32)
        host[: values.numel()] = values
        return host

    # ------------------------------------------------------ per-step values
    def token_indices(self, device, real_dims, padded_dims) -> torch.Tensor:
        """Device int32 indices ``[max_num_tokens]`` laid out for ``padded_dims``.

        The mapping is row-major over ``real_dims``; padded positions and the
        tail past the bucket get -1, so padding can never pick up an adapter.
        """
        key = ("token_indices", str(device), tuple(real_dims), tuple(padded_dims))
        return self.cache.get(key, lambda: self._full_buffer(self._padded_grid(real_dims, padded_dims)).to(device))

    def rows_uniform(self, real_dims) -> bool:
        """Whether the mapping is constant along each row (the innermost dim) of ``real_dims``.

        True for one adapter per request, the row kernel's case; False for a
        mapping that mixes adapters within a row (then the masked kernel
        runs).  Computed once per mapping and token dims.
        """
        return self.cache.get(("rows_uniform", tuple(real_dims)), lambda: self._rows_uniform(real_dims))

    def _rows_uniform(self, real_dims) -> bool:
        mapping = self._tokens
        if self._rows is not None:
            return True  # one adapter per request: every row is uniform
        if mapping is None or len(real_dims) < 2 or mapping.numel() != math.prod(real_dims):
            return mapping is None  # every token on the base model is uniform
        grid = mapping.reshape(-1, real_dims[-1])
        return bool((grid == grid[:, :1]).all())

    def row_slots(self, device, real_dims, padded_dims, *, pooled: bool = False) -> torch.Tensor:
        """Device int32 ``[max_num_tokens]``: the slot of each row of the padded grid, -1 past the real rows.

        Refused unless :meth:`rows_uniform`: a row kernel fed a mixed row
        would give the whole row its first token's adapter, and so would a
        saved head that pools each row to one output (``pooled``, named in the
        error).  The graph narrows it to the bucket's row count.
        """
        if not (self.warming_up or self.rows_uniform(real_dims)):
            if pooled:
                raise UnsupportedMappingError(
                    f"the mapping gives tokens of one row (token dims {list(real_dims)}) different adapters, but "
                    "this graph has a saved module (PEFT modules_to_save) that pools each row to one output, so a "
                    "row can only have one adapter; give every token of a row the same adapter")
            raise UnsupportedMappingError(
                f"the mapping gives tokens of one row (token dims {list(real_dims)}) different adapters: a graph "
                "rewritten with the row kernel cannot run it (the backend switches to the masked kernel; "
                "rewrite(..., kernel='masked') does the same for a graph rewritten by hand)")

        def build():
            return self._full_buffer(self._padded_rows(real_dims, padded_dims)).to(device)
        return self.cache.get(("row_slots", str(device), tuple(real_dims), tuple(padded_dims)), build)

    def _padded_rows(self, real_dims, padded_dims) -> torch.Tensor:
        """Host int32 slot of each row (innermost dim) of the padded bucket, flattened, -1 on padding rows.

        A request mapping is padded as rows, never expanded to tokens: each
        request's slot for the rows of its batch entry.
        """
        real_dims, padded_dims = tuple(int(d) for d in real_dims), tuple(int(d) for d in padded_dims)
        if self._rows is None or len(real_dims) < 2:
            return self._padded_grid(real_dims, padded_dims).reshape(-1, padded_dims[-1])[:, 0]
        self._check_fits(real_dims)
        grid = torch.full(padded_dims[:-1], NO_LORA, dtype=torch.int32)
        lead = real_dims[:-1]
        grid[tuple(slice(0, d) for d in lead)] = self._rows.reshape((-1,) + (1,) * (len(lead) - 1)).expand(lead)
        return grid.reshape(-1)

    def step_value(self, key: Hashable, real_dims, padded_dims, build: Callable[[torch.Tensor], object]):
        """``build(grid)`` for this step, cached until the mapping changes: ``grid`` is the padded bucket's
        host int32 indices, flattened, -1 on padding.  How a kernel's own per-step inputs are made
        (xla_lora_pass/kernels/table.py), without this module knowing any kernel."""
        full_key = (key, tuple(real_dims), tuple(padded_dims))
        return self.cache.get(full_key, lambda: build(self._padded_grid(real_dims, padded_dims)))


def to_indices(entries: Union[Sequence[TokenAdapter], torch.Tensor], slots: List[Optional[str]], caller: str,
               unit: str, loadable: Sequence[str] = ()) -> torch.Tensor:
    """Host int32 slot numbers of ``entries`` (names, slot numbers, None / -1 for base), each checked.

    ``loadable``: names no slot holds that count as known (the pool can load
    them); the i-th gets the number ``len(slots) + i``.  A slot number must
    name a loaded slot.
    """
    if isinstance(entries, torch.Tensor):
        if entries.dim() != 1 or entries.dtype.is_floating_point or entries.dtype == torch.bool:
            raise TypeError(f"{caller}: expected a 1-d integer tensor, got {entries.dtype} {list(entries.shape)}")
        entries = entries.tolist()
    elif isinstance(entries, (str, bytes)) or not isinstance(entries, Sequence):
        raise TypeError(f"{caller}: expected a sequence with one entry per {unit}, got {entries!r:.80}")
    names = {name: slot for slot, name in enumerate(list(slots) + list(loadable)) if name is not None}
    out = []
    for pos, entry in enumerate(entries):
        if entry is None:
            out.append(NO_LORA)
        elif isinstance(entry, str):
            if entry not in names:
                hint = (" (the base model is None here; \"__base__\" is its name in PEFT's adapter_names)"
                        if entry == "__base__" else "")
                raise KeyError(f"{caller}: {unit} {pos}: unknown adapter {entry!r}{hint}; "
                               f"registered: {sorted(names)}")
            out.append(names[entry])
        elif isinstance(entry, numbers.Integral) and not isinstance(entry, bool):
            entry = int(entry)  # numpy integers too
            if entry != NO_LORA and not (0 <= entry < len(slots) and slots[entry] is not None):
                raise ValueError(f"{caller}: {unit} {pos}: slot {entry} is not a loaded slot; "
                                 f"valid: -1 and {[s for s, n in enumerate(slots) if n is not None]}")
            out.append(entry)
        else:
            raise TypeError(f"{caller}: {unit} {pos}: expected str, int or None, got {entry!r:.80}")
    return torch.tensor(out, dtype=torch.int32)


__all__ = ["NO_LORA", "TokenAdapter", "StepCache", "TokenMapping", "to_indices"]
