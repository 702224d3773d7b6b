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
        self.warming_up = False
        self.cache = StepCache()

    def _set(self, tokens: Optional[torch.Tensor], rows: Optional[torch.Tensor]) -> None:
        """The one place the mapping changes, so nothing built from the old one survives it."""
        self._tokens, self._rows = tokens, rows
        self.cache.clear()

    def set_tokens(self, entries, slots: List[Optional[str]]) -> None:
        indices = to_indices(entries, slots, "set_token_adapters", "token")
        if len(indices) > self.max_num_tokens:
            raise ValueError(f"set_token_adapters: {len(indices)} tokens exceed max_num_tokens={self.max_num_tokens}")
        self._set(indices, None)

    def set_requests(self, entries, slots: List[Optional[str]]) -> None:
        indices = to_indices(entries, slots, "set_request_adapters", "row")
        if not len(indices):
            raise ValueError("set_request_adapters: give one entry per batch row, got none")
        if len(indices) > self.max_num_tokens:
            raise ValueError(f"set_request_adapters: {len(indices)} rows exceed max_num_tokens={self.max_num_tokens}")
        self._set(None, indices)

    def forget(self) -> None:
        """Drop the mapping: slot numbers may now mean other adapters, so an old mapping would pick the wrong ones."""
        self._set(None, None)

    def enter_warm_up(self) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """Every token on the base model until :meth:`exit_warm_up`; returns the mapping to restore."""
        saved = self._tokens, self._rows
        self._set(None, None)
        self.warming_up = True
        return saved

    def exit_warm_up(self, saved: Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]) -> None:
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
        """The slots (and -1) the current mapping uses, or None without a mapping."""
        current = self._tokens if self._tokens is not None else self._rows
        return None if current is None else set(current.unique().tolist())

    def token_mapping(self, real_dims: Tuple[int, ...]) -> Optional[torch.Tensor]:
        """Host int32 indices, one per token of a call with token dims ``real_dims`` (row-major).

        A request mapping is laid over the dims: row b's slot for every token
        of row b (``real_dims[0]`` must be the number of rows).  None without
        a mapping.  Raises ``UnsupportedMappingError`` naming both sizes when
        the mapping does not fit this call.
        """
        real_dims = tuple(int(d) for d in real_dims)
        want = math.prod(real_dims)
        rows = self._rows
        if rows is not None:
            if not real_dims or real_dims[0] != rows.numel():
                raise UnsupportedMappingError(
                    f"the request mapping has {rows.numel()} rows but this call has a batch of "
                    f"{real_dims[0] if real_dims else 0} (token dims {list(real_dims)}); call "
                    "set_request_adapters with one entry per batch row")
            return rows.repeat_interleave(want // rows.numel()) if want else rows[:0]
        if self._tokens is not None and self._tokens.numel() != want:
            raise UnsupportedMappingError(
                f"the token mapping has {self._tokens.numel()} entries but this call has {want} tokens "
                f"(token dims {list(real_dims)}); set one entry per flattened token, or one per batch row "
                "with set_request_adapters")
        return self._tokens

    def check_fits(self, real_dims: Tuple[int, ...]) -> None:
        """Raise as :meth:`token_mapping` does unless the mapping fits a call with token dims ``real_dims``;
        every compiled call checks, so each mapping and token dims is checked once."""
        real_dims = tuple(int(d) for d in real_dims)

        def check() -> bool:
            self.token_mapping(real_dims)  # raises when it does not fit; a raise caches nothing
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
            rows = self._padded_grid(real_dims, padded_dims).reshape(-1, padded_dims[-1])[:, 0]
            return self._full_buffer(rows).to(device)
        return self.cache.get(("row_slots", str(device), tuple(real_dims), tuple(padded_dims)), build)

    def step_value(self, key: Hashable, real_dims, padded_dims, build: Callable[[torch.Tensor], object]):
        """``build(grid)`` for this step, cached until the mapping changes: ``grid`` is the padded bucket's
        host int32 indices, flattened, -1 on padding.  How a kernel's own per-step inputs are made
        (xla_lora_pass/kernels/table.py), without this module knowing any kernel."""
        full_key = (key, tuple(real_dims), tuple(padded_dims))
        return self.cache.get(full_key, lambda: build(self._padded_grid(real_dims, padded_dims)))


def to_indices(entries: Union[Sequence[TokenAdapter], torch.Tensor], slots: List[Optional[str]], caller: str,
               unit: str) -> torch.Tensor:
    """Host int32 slot numbers of ``entries`` (names, slot numbers, None / -1 for base), each checked."""
    if isinstance(entries, torch.Tensor):
        if entries.dim() != 1 or entries.dtype.is_floating_point or entries.dtype == torch.bool:
            raise TypeError(f"{caller}: expected a 1-d integer tensor, got {entries.dtype} {list(entries.shape)}")
        entries = entries.tolist()
    elif isinstance(entries, (str, bytes)) or not isinstance(entries, Sequence):
        raise TypeError(f"{caller}: expected a sequence with one entry per {unit}, got {entries!r:.80}")
    names = {name: slot for slot, name in enumerate(slots) if name is not None}
    out = []
    for pos, entry in enumerate(entries):
        if entry is None:
            out.append(NO_LORA)
        elif isinstance(entry, str):
            if entry not in names:
                raise KeyError(f"{caller}: {unit} {pos}: unknown adapter {entry!r}; registered: {sorted(names)}")
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
