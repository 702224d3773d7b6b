"""``LoRAMetadata``: the one object that says which adapter each token uses.

It owns, for every registered LoRA site, the per-slot stacked weights
(A ``[N, R, in]``, B ``[N, out, R]`` with each adapter's scaling folded into
B, ranks zero-padded to the site's max rank, which is exact), and the int32
token indices of the current step (-1 = base model only).  Compiled graphs
receive both as graph inputs, so a new mapping or new adapter weights never
recompile anything.

Host first, device once: the mapping is built on the host and copied to the
device once per step in one transfer (an in-place update of an XLA tensor
would be a lazy op, i.e. one more XLA program to compile).

Bad input is refused in eager Python before any device work, and a refused
call changes nothing: ``set_token_adapters`` keeps the old mapping,
``load_adapter`` leaves every slot and stack as it was (docs/reliability.md
lists every check).

Thread safety.  Safe: every method takes the object's lock, so concurrent
calls on one object never corrupt it and each call is all-or-nothing; two
objects share no state (mappings, slots, stacked weights, stats), so two
models, each with its own object, may be served alternately or from two
threads, as far as Dynamo and torch_xla allow.  Not safe: the mapping belongs
to the object, not to a thread, and a compiled call reads it when it runs, so
``set_token_adapters`` followed by the model call is one step that another
thread must not split (one serving loop per object, or hold your own lock
around both); ``load_adapter`` while another thread runs the model may give
that call some sites old and some new weights.  One model, one object: a
second object registering the same model would add its own eager guards.
"""
from __future__ import annotations

import contextlib
import logging
import math
import numbers
import threading
import types
import warnings
from typing import Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch

from graph_rewrites import GROUP_SEPARATOR

from . import eager_guard
from .adapters import AdapterWeights, SiteSpec, adapter_names, iter_lora_sites
from .errors import UnsupportedMappingError
from .generation import route_generate
from .saved_modules import SavedModuleSpec, iter_saved_modules
from .ops_blocked import padded_layout
from .ops_segments import SegmentLayout, build_segment_layout

log = logging.getLogger(__name__)

NO_LORA = -1
TokenAdapter = Union[str, int, None]


class LoRAMetadata:
    """Shared multi-LoRA state: slots, stacked weights and token indices."""

    def __init__(self, max_num_tokens: int = 8192, *, max_slots: Optional[int] = None,
                 max_rank: Optional[int] = None):
        if max_num_tokens < 1:
            raise ValueError(f"max_num_tokens must be >= 1, got {max_num_tokens}")
        self.max_num_tokens = int(max_num_tokens)
        self.max_slots = max_slots
        self.max_rank = max_rank
        self._slots: List[Optional[str]] = []
        self._sites: Dict[str, SiteSpec] = {}
        self._param_index: Dict[int, Tuple[str, str, str]] = {}
        self._saved: Dict[str, SavedModuleSpec] = {}  # PEFT modules_to_save, by path
        self._base_index: Dict[int, str] = {}  # id(base weight) -> site
        self._saved_index: Dict[int, Tuple[str, Optional[str], str]] = {}  # id(tensor) -> (module, adapter, name)
        self._host_stacks: Dict[str, Tuple[torch.Tensor, torch.Tensor]] = {}
        self._device_stacks: Dict[Tuple[str, str, str], torch.Tensor] = {}  # (site, role, device)
        self._host_bias: Dict[str, torch.Tensor] = {}
        self._mapping: Optional[torch.Tensor] = None  # per token (set_token_adapters)
        self._request_rows: Optional[torch.Tensor] = None  # per batch row (set_request_adapters)
        self._index_cache: Dict[tuple, torch.Tensor] = {}  # device index tensors per mapping and bucket
        self._uniform_cache: Dict[tuple, bool] = {}  # rows_uniform per mapping and token dims
        self._segment_cache: Dict[tuple, Optional[SegmentLayout]] = {}  # host segment layouts per mapping and bucket
        self._lock = threading.Lock()
        self._hook_handles: list = []
        self._warming = False
        self._sharding = None  # sharding.AdapterSharding after shard(mesh)
        self._stats = {
            "compiles": 0,
            "rewrites": {},
            "bucket_hits": {},
            "fallbacks": 0,
            "padded_tokens": 0,
            "real_tokens": 0,
        }

    # ------------------------------------------------------------------ slots
    @property
    def slots(self) -> List[Optional[str]]:
        """Slot names by slot number (None for a free slot)."""
        return list(self._slots)

    @property
    def num_slots(self) -> int:
        return len(self._slots)

    @property
    def sites(self) -> Mapping[str, SiteSpec]:
        return types.MappingProxyType(self._sites)

    @property
    def saved_modules(self) -> Mapping[str, SavedModuleSpec]:
        """PEFT ``modules_to_save`` served per token or row, by module path."""
        return types.MappingProxyType(self._saved)

    def slot_of(self, adapter: str) -> int:
        """The slot number of a registered adapter name."""
        try:
            return self._slots.index(adapter)
        except ValueError:
            raise KeyError(
                f"unknown adapter {adapter!r}; registered: {[s for s in self._slots if s is not None]}"
            ) from None

    def register_adapters(self, model: torch.nn.Module) -> List[str]:
        """Stack every loaded adapter of every LoRA layer of ``model``; return slot names.

        Registering again replaces what was registered before.
        """
        sites = list(iter_lora_sites(model))
        saved = list(iter_saved_modules(model))  # refuses, by name, a kind it cannot serve exactly
        if not sites:
            warnings.warn(
                f"{type(model).__name__} has no LoRA layers: the backend will compile it unchanged",
                stacklevel=2,
            )
        names = adapter_names(model) if sites or saved else []
        num_slots = self.max_slots if self.max_slots is not None else len(names)
        if len(names) > num_slots:
            raise ValueError(f"{len(names)} adapters {names} do not fit max_slots={num_slots}")
        with self._lock:
            slots = list(names) + [None] * (num_slots - len(names))
            host_stacks = {s.name: self._stack_site(s, slots) for s in sites}
            self._slots = slots
            self._sites = {s.name: s for s in sites}
            self._saved = {m.name: m for m in saved}
            self.refresh_param_index()
            self._host_stacks = host_stacks
            self._host_bias = {s.name: self._stack_bias(s, slots) for s in sites
                               if any(w.bias is not None for w in s.adapters.values())}
            self._device_stacks.clear()
            if self._sharding is not None:
                self._sharding.forget()
            # Slot numbers may now mean other adapters: an old mapping would pick the wrong ones.
            self._mapping = self._request_rows = None
            self._drop_mapping_caches()
            self._hook_handles = eager_guard.install(self, sites, saved, self._hook_handles)
        if sites:
            route_generate(self, model)  # HF's generate never calls the compiled module: generation.py
        log.info("registered %d LoRA sites and %d saved modules, slots %s", len(sites), len(saved), self._slots)
        return list(names)

    def _site_rank(self, site: SiteSpec) -> int:
        ranks = [w.rank for w in site.adapters.values()]
        return max(ranks + [self.max_rank or 1])

    def _stack_site(self, site: SiteSpec, slots: List[Optional[str]]) -> Tuple[torch.Tensor, torch.Tensor]:
        """Host stacks of one site; slots whose adapter is absent here stay zero."""
        any_w = next(iter(site.adapters.values()))
        dtype = any_w.lora_a.dtype
        rank = self._site_rank(site)
        stack_a = torch.zeros(len(slots), rank, site.in_features, dtype=dtype)
        stack_b = torch.zeros(len(slots), site.out_features, rank, dtype=dtype)
        for slot, name in enumerate(slots):
            if name in site.adapters:
                where = f"register_adapters: {site.name} adapter {name!r}"
                self._write_slot(stack_a, stack_b, slot, *_host_slot_weights(where, site.adapters[name], dtype))
        return stack_a, stack_b

    @staticmethod
    def _stack_bias(site: SiteSpec, slots) -> torch.Tensor:
        """Host ``[N, out]`` LoRA-bias rows, each scaled by its adapter's scaling; zero where absent."""
        dtype = next(iter(site.adapters.values())).lora_b.dtype
        bias = torch.zeros(len(slots), site.out_features, dtype=dtype)
        for slot, name in enumerate(slots):
            w = site.adapters.get(name)
            if w is not None and w.bias is not None:
                bias[slot] = (w.bias.detach().to("cpu", torch.float32) * w.scaling).to(dtype)
        return bias

    @staticmethod
    def _write_slot(stack_a, stack_b, slot: int, lora_a: torch.Tensor, scaled_b: torch.Tensor) -> None:
        r = lora_a.shape[0]
        with torch.no_grad():
            stack_a[slot].zero_()
            stack_b[slot].zero_()
            stack_a[slot, :r] = lora_a
            stack_b[slot, :, :r] = scaled_b

    def load_adapter(self, name: str, state: Mapping[str, torch.Tensor], *, scaling: Optional[float] = None,
                     config=None) -> int:
        """Load one adapter's weights into its slot (or the first free one); never recompiles.

        ``state`` is a PEFT-style state dict (``<site>.lora_A.weight`` /
        ``<site>.lora_B.weight``, an adapter name may stand before ``.weight``).
        The scaling comes from ``scaling`` or from a PEFT ``LoraConfig``.

        Weights may be of any floating dtype, cast to the site's stack dtype
        (the model's LoRA dtype), and on any device that holds data (CPU, XLA,
        ...): they are copied into the host stacks, one device-to-host transfer
        each, and no reference to them is kept.  Refused before any slot is
        touched: a shape that does not fit the site, a non-floating dtype, a
        meta or sparse tensor, a NaN or inf (after the cast and the scaling).
        """
        if not isinstance(name, str) or not name:
            raise TypeError(f"load_adapter: the adapter name must be a non-empty str, got {name!r:.80}")
        if not isinstance(state, Mapping):
            raise TypeError(f"load_adapter({name!r}): state must be a mapping of name -> tensor, got "
                            f"{type(state).__name__}")
        if not self._sites:
            raise RuntimeError(f"load_adapter({name!r}): no LoRA sites are registered; call "
                               "register_adapters(model) with a model that has LoRA layers first")
        saved = sorted(m.name for m in self._saved.values() if name in m.adapters)
        if saved:
            raise ValueError(f"load_adapter({name!r}): this adapter has PEFT modules_to_save copies ({saved}) that "
                             "load_adapter cannot replace, so its rows would mix new LoRA weights with the old "
                             "copies; load it into the PEFT model and call register_adapters(model) again")
        per_site = _split_state(state, self._sites)
        if not per_site:
            raise ValueError(f"load_adapter({name!r}): state holds no lora_A / lora_B weights")
        weights: Dict[str, Tuple[torch.Tensor, torch.Tensor]] = {}
        for site_name, (lora_a, lora_b) in per_site.items():
            site = self._sites[site_name]
            stack_a, _ = self._host_stacks[site_name]
            self._check_loaded(name, site, stack_a, lora_a, lora_b)
            loaded = AdapterWeights(lora_a, lora_b, _scaling_for(name, lora_a.shape[0], scaling, config))
            weights[site_name] = _host_slot_weights(f"load_adapter({name!r}): {site_name}", loaded, stack_a.dtype)
        with self._lock:
            if name in self._slots:
                slot = self._slots.index(name)
            elif None in self._slots:
                slot = self._slots.index(None)
            else:
                raise ValueError(
                    f"load_adapter({name!r}): all {self.num_slots} slots are taken by {self._slots}; "
                    "create the metadata with a larger max_slots"
                )
            self._slots[slot] = name
            for site_name, (stack_a, stack_b) in self._host_stacks.items():
                if site_name in weights:
                    self._write_slot(stack_a, stack_b, slot, *weights[site_name])
                else:
                    stack_a[slot].zero_()
                    stack_b[slot].zero_()
            for bias in self._host_bias.values():
                bias[slot].zero_()  # a loaded adapter brings no LoRA bias
            # Fresh transfers at the next call rather than in-place device writes: no program to compile.
            self._device_stacks.clear()
        return slot

    @staticmethod
    def _check_loaded(name: str, site: SiteSpec, stack_a: torch.Tensor, lora_a, lora_b) -> None:
        max_rank = stack_a.shape[1]
        where = f"load_adapter({name!r}): {site.name}"
        for what, t in (("lora_A", lora_a), ("lora_B", lora_b)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{where}.{what}: expected a floating-point tensor, got {type(t).__name__}")
            if not t.is_floating_point():
                raise TypeError(f"{where}.{what}: expected a floating-point tensor, got {t.dtype} {list(t.shape)}")
            if t.layout != torch.strided:
                raise TypeError(f"{where}.{what}: expected a dense tensor, got layout {t.layout}")
            if t.device.type == "meta":
                raise ValueError(f"{where}.{what}: a meta tensor holds no data; give the weights on any "
                                 "real device (they are copied to the host)")
        r = lora_a.shape[0] if lora_a.dim() == 2 else -1
        if lora_a.dim() != 2 or lora_a.shape[1] != site.in_features or not 1 <= r <= max_rank:
            raise ValueError(
                f"{where}.lora_A: expected [r, {site.in_features}] with 1 <= r <= {max_rank} "
                f"(the site's stacked rank), got {list(lora_a.shape)}"
            )
        if list(lora_b.shape) != [site.out_features, r]:
            raise ValueError(f"{where}.lora_B: expected {[site.out_features, r]}, got {list(lora_b.shape)}")

    # -------------------------------------------------------- graph lookups
    def refresh_param_index(self) -> None:
        """Re-read parameter identities from the live modules.

        ``model.to(xla_device)`` replaces Parameter objects, so identities
        taken at registration go stale; the rewrite refreshes once per graph.
        """
        self._param_index = {
            pid: (s.name, adapter, role) for s in self._sites.values()
            for pid, (adapter, role) in s.param_roles().items()
        }
        self._base_index = {id(w): s.name for s in self._sites.values() if (w := s.base_weight()) is not None}
        self._saved_index = {}
        for m in self._saved.values():
            for adapter in (None,) + m.adapters:
                for name, tensor in m.tensors(adapter).items():
                    self._saved_index.setdefault(id(tensor), (m.name, adapter, name))

    def lookup(self, tensor) -> Optional[Tuple[str, str, str]]:
        """``(site, adapter, role)`` if ``tensor`` is a registered LoRA parameter."""
        return self._param_index.get(id(tensor))

    def lookup_base(self, tensor) -> Optional[str]:
        """The site whose base-layer weight ``tensor`` is, if any."""
        return self._base_index.get(id(tensor))

    def lookup_saved(self, tensor) -> Optional[Tuple[str, Optional[str], str]]:
        """``(saved module, adapter or None for the original, tensor name)`` if ``tensor`` belongs to one."""
        return self._saved_index.get(id(tensor))

    def saved_tensor(self, module: str, adapter: Optional[str], name: str, device) -> torch.Tensor:
        """One tensor of a saved module's variant, the live one (the model's own, on ``device``)."""
        tensor = self._saved[module].tensors(adapter)[name]
        return tensor if tensor.device == torch.device(device) else tensor.to(device)

    def site_rank(self, site_name: str) -> int:
        return self._host_stacks[site_name][0].shape[1]

    def stacked_weights(self, site_name: str, device) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The site's stacked (A, B) on ``device``, each transferred once and cached.

        ``site_name`` may join several sites with "+" (sites fused on one
        input): A is then their stacks concatenated along the rank dim, B None.
        """
        single = GROUP_SEPARATOR not in site_name
        return self.stacked_a(site_name, device), self.stacked_b(site_name, device) if single else None

    def stacked_a(self, site_name: str, device, transposed: bool = False) -> torch.Tensor:
        """The site's (or fused group's) stacked A ``[N, R, in]`` on ``device`` (``[N, in, R]`` if transposed)."""
        return self._device_stack(site_name, "A", device, transposed)

    def stacked_b(self, site_name: str, device, transposed: bool = False) -> torch.Tensor:
        """The site's stacked B ``[N, out, R]`` on ``device`` (``[N, R, out]`` if transposed), scalings folded in."""
        return self._device_stack(site_name, "B", device, transposed)

    def _device_stack(self, site_name: str, role: str, device, transposed: bool = False) -> torch.Tensor:
        # A and B are cached apart: a site in a fused group needs only its B on
        # the device (its A travels inside the group's concatenated A).  The
        # transposed copies are the row kernel's (made only if a graph uses it).
        key = (site_name, role + ("_T" if transposed else ""), str(device))
        with self._lock:
            if key not in self._device_stacks:
                names = site_name.split(GROUP_SEPARATOR)
                if role == "B":
                    host = self._host_stacks[site_name][1]
                elif len(names) == 1:
                    host = self._host_stacks[site_name][0]
                else:
                    host = torch.cat([self._host_stacks[n][0] for n in names], dim=1)
                if transposed:
                    host = host.transpose(1, 2).contiguous()
                tensor = host.to(device)
                if self._sharding is not None and torch.device(device).type == "xla":
                    self._sharding.place_stacks(site_name, tensor if role == "A" else None,
                                                tensor if role == "B" else None, transposed=transposed)
                self._device_stacks[key] = tensor
            return self._device_stacks[key]

    def stacked_bias(self, site_name: str, device) -> torch.Tensor:
        """The site's per-slot LoRA bias ``[N, out]`` (scaled) on ``device``."""
        key = (site_name, "bias", str(device))
        with self._lock:
            if key not in self._device_stacks:
                self._device_stacks[key] = self._host_bias[site_name].to(device)
                if self._sharding is not None and torch.device(device).type == "xla":
                    self._sharding.place_bias(site_name, self._device_stacks[key])
            return self._device_stacks[key]

    def shard(self, mesh, layout=None, *, axis: Optional[str] = None, both: bool = False):
        """Shard the stacked adapter buffers over a torch_xla SPMD ``mesh`` like their base weights.

        Per site: ``column`` (base weight split on out: B split on out, A
        replicated), ``row`` (split on in: A split on in, B replicated) or
        ``replicated``, from ``layout`` (``{leaf module name or site: layout}``,
        e.g. ``sharding.MEGATRON_LLAMA``, or a callable) or else read off the
        base weight's sharding spec.  ``both=True`` also splits the stack the
        layout leaves whole (A of a column site on its input dim, B of a row
        site on its output dim): 1/devices of the memory, for one more
        collective per site that the partitioner inserts.  Index buffers stay
        replicated.  Returns
        the ``sharding.AdapterSharding``; ``shard(None)`` turns it off.
        docs/scale-out.md.
        """
        from .sharding import AdapterSharding

        sharding = None if mesh is None else AdapterSharding(self, mesh, layout, axis, both)
        with self._lock:
            self._sharding = sharding
            self._device_stacks.clear()  # the next call transfers annotated copies
        return sharding

    @property
    def sharding(self):
        """The ``AdapterSharding`` set by ``shard(mesh)``, or None."""
        return self._sharding

    # --------------------------------------------------------------- mapping
    def set_token_adapters(self, mapping: Union[Sequence[TokenAdapter], torch.Tensor]) -> None:
        """Set each flattened token's adapter: a name, a slot number, or None / -1 for base.

        Valid for calls with exactly that many tokens; replaces a request mapping.
        """
        indices = self._to_indices(mapping, "set_token_adapters", "token")
        if len(indices) > self.max_num_tokens:
            raise ValueError(f"set_token_adapters: {len(indices)} tokens exceed max_num_tokens={self.max_num_tokens}")
        with self._lock:
            self._mapping, self._request_rows = indices, None
            self._drop_mapping_caches()

    def set_request_adapters(self, rows: Union[Sequence[TokenAdapter], torch.Tensor]) -> None:
        """Set each batch row's adapter (a name, a slot number, or None / -1 for base), for every later call.

        Each compiled graph lays the rows over its own token dims: every token
        of row b (``[B, S]`` prompts, ``[B, 1]`` decode steps, a pooled
        ``[B]``, an encoder and a decoder of different lengths) uses
        ``rows[b]``, until the next ``set_request_adapters`` or
        ``set_token_adapters``.  A call whose batch is not ``len(rows)`` is refused.
        """
        indices = self._to_indices(rows, "set_request_adapters", "row")
        if not len(indices):
            raise ValueError("set_request_adapters: give one entry per batch row, got none")
        if len(indices) > self.max_num_tokens:
            raise ValueError(f"set_request_adapters: {len(indices)} rows exceed max_num_tokens={self.max_num_tokens}")
        with self._lock:
            self._mapping, self._request_rows = None, indices
            self._drop_mapping_caches()

    def _to_indices(self, mapping, caller: str, unit: str) -> torch.Tensor:
        if isinstance(mapping, torch.Tensor):
            if mapping.dim() != 1 or mapping.dtype.is_floating_point or mapping.dtype == torch.bool:
                raise TypeError(f"{caller}: expected a 1-d integer tensor, got {mapping.dtype} "
                                f"{list(mapping.shape)}")
            mapping = mapping.tolist()
        elif isinstance(mapping, (str, bytes)) or not isinstance(mapping, Sequence):
            raise TypeError(f"{caller}: expected a sequence with one entry per {unit}, got {mapping!r:.80}")
        names = {name: slot for slot, name in enumerate(self._slots) if name is not None}
        out = []
        for pos, entry in enumerate(mapping):
            if entry is None:
                out.append(NO_LORA)
            elif isinstance(entry, str):
                if entry not in names:
                    raise KeyError(f"{caller}: {unit} {pos}: unknown adapter {entry!r}; "
                                   f"registered: {sorted(names)}")
                out.append(names[entry])
            elif isinstance(entry, numbers.Integral) and not isinstance(entry, bool):
                entry = int(entry)  # numpy integers too
                if entry != NO_LORA and not (0 <= entry < self.num_slots and self._slots[entry] is not None):
                    raise ValueError(f"{caller}: {unit} {pos}: slot {entry} is not a loaded slot; "
                                     f"valid: -1 and {[s for s, n in enumerate(self._slots) if n is not None]}")
                out.append(entry)
            else:
                raise TypeError(f"{caller}: {unit} {pos}: expected str, int or None, got {entry!r:.80}")
        return torch.tensor(out, dtype=torch.int32)

    @contextlib.contextmanager
    def warming_up(self):
        """Within: compiled graphs skip the mapping checks and every token is on the base model."""
        saved = self._mapping, self._request_rows
        self._mapping, self._request_rows, self._warming = None, None, True
        self._drop_mapping_caches()
        try:
            yield self
        finally:
            (self._mapping, self._request_rows), self._warming = saved, False
            self._drop_mapping_caches()

    @property
    def is_warming_up(self) -> bool:
        return self._warming

    @property
    def num_tokens(self) -> Optional[int]:
        """Length of the current token mapping (None without one, e.g. under a request mapping)."""
        return None if self._mapping is None else int(self._mapping.numel())

    @property
    def has_mapping(self) -> bool:
        """Whether a token or a request mapping is set."""
        return self._mapping is not None or self._request_rows is not None

    def mapping(self) -> Optional[torch.Tensor]:
        """The current host int32 token indices (None under a request mapping: see ``token_mapping``)."""
        return self._mapping

    def request_adapters(self) -> Optional[torch.Tensor]:
        """The current host int32 slot of each batch row (None unless ``set_request_adapters`` set it)."""
        return self._request_rows

    def mapped_slots(self) -> Optional[set]:
        """The slots (and -1) the current mapping uses, or None without a mapping."""
        current = self._mapping if self._mapping is not None else self._request_rows
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
        rows = self._request_rows
        if rows is not None:
            if not real_dims or real_dims[0] != rows.numel():
                raise UnsupportedMappingError(
                    f"the request mapping has {rows.numel()} rows but this call has a batch of "
                    f"{real_dims[0] if real_dims else 0} (token dims {list(real_dims)}); call "
                    "set_request_adapters with one entry per batch row")
            return rows.repeat_interleave(want // rows.numel()) if want else rows[:0]
        mapping = self._mapping
        if mapping is not None and mapping.numel() != want:
            raise UnsupportedMappingError(
                f"the token mapping has {mapping.numel()} entries but this call has {want} tokens "
                f"(token dims {list(real_dims)}); set one entry per flattened token, or one per batch row "
                "with set_request_adapters")
        return mapping

    def token_indices(self, device, real_dims: Tuple[int, ...], padded_dims: Tuple[int, ...]) -> torch.Tensor:
        """Device int32 indices ``[max_num_tokens]`` laid out for ``padded_dims``.

        The mapping is row-major over ``real_dims``; padded positions and the
        tail past the bucket get -1, so padding can never pick up an adapter.
        """
        key = (str(device), tuple(real_dims), tuple(padded_dims))
        with self._lock:
            cached = self._index_cache.get(key)
            if cached is None:
                host = torch.full((self.max_num_tokens,), NO_LORA, dtype=torch.int32)
                grid = self._padded_grid(real_dims, padded_dims)
                host[: grid.numel()] = grid
                cached = self._index_cache[key] = host.to(device)
            return cached

    def _padded_grid(self, real_dims, padded_dims) -> torch.Tensor:
        """Host int32 indices of the padded bucket, flattened: the mapping, -1 on padding."""
        mapping = self.token_mapping(real_dims)
        if mapping is None:
            mapping = torch.full((math.prod(real_dims),), NO_LORA, dtype=torch.int32)
        grid = torch.full(tuple(padded_dims), NO_LORA, dtype=torch.int32)
        grid[tuple(slice(0, d) for d in real_dims)] = mapping.reshape(tuple(real_dims))
        return grid.reshape(-1)

    def _drop_mapping_caches(self) -> None:
        """Everything derived from the mapping (or the slots) goes when it changes."""
        self._index_cache.clear()
        self._uniform_cache.clear()
        self._segment_cache.clear()

    def rows_uniform(self, real_dims: Tuple[int, ...]) -> bool:
        """Whether the mapping is constant along each row (the innermost dim) of ``real_dims``.

        True for one adapter per request, the row kernel's case; False for a
        mapping that mixes adapters within a row (then the masked kernel
        runs).  Computed once per mapping and token dims.
        """
        key = tuple(real_dims)
        with self._lock:
            cached = self._uniform_cache.get(key)
            if cached is None:
                mapping = self._mapping
                if self._request_rows is not None:
                    cached = True  # one adapter per request: every row is uniform
                elif mapping is None or len(real_dims) < 2 or mapping.numel() != math.prod(real_dims):
                    cached = mapping is None  # every token on the base model is uniform
                else:
                    grid = mapping.reshape(-1, real_dims[-1])
                    cached = bool((grid == grid[:, :1]).all())
                self._uniform_cache[key] = cached
            return cached

    def row_slots(self, device, real_dims: Tuple[int, ...], padded_dims: Tuple[int, ...], *,
                  pooled: bool = False) -> torch.Tensor:
        """Device int32 ``[max_num_tokens]``: the slot of each row of the padded grid, -1 past the real rows.

        Refused unless :meth:`rows_uniform`: a row kernel fed a mixed row
        would give the whole row its first token's adapter, and so would a
        saved head that pools each row to one output (``pooled``, named in the
        error).  The graph narrows it to the bucket's row count.
        """
        if not (self._warming or self.rows_uniform(real_dims)):
            if pooled:
                raise UnsupportedMappingError(
                    f"the mapping gives tokens of one row (token dims {list(real_dims)}) different adapters, but "
                    "this graph has a saved module (PEFT modules_to_save) that pools each row to one output, so a "
                    "row can only have one adapter; give every token of a row the same adapter")
            raise UnsupportedMappingError(
                f"the mapping gives tokens of one row (token dims {list(real_dims)}) different adapters: a graph "
                "rewritten with the row kernel cannot run it (the backend switches to the masked kernel; "
                "rewrite(..., kernel='masked') does the same for a graph rewritten by hand)")
        key = ("row_slots", str(device), tuple(real_dims), tuple(padded_dims))
        with self._lock:
            cached = self._index_cache.get(key)
            if cached is None:
                rows = self._padded_grid(real_dims, padded_dims).reshape(-1, padded_dims[-1])[:, 0]
                host = torch.full((self.max_num_tokens,), NO_LORA, dtype=torch.int32)
                host[: rows.numel()] = rows
                cached = self._index_cache[key] = host.to(device)
            return cached

    def block_layout(self, device, real_dims: Tuple[int, ...], padded_dims: Tuple[int, ...]):
        """The blocked kernel's layout for this step (row_token, block_slot, token_row) on ``device``.

        Built once per mapping and bucket on the host (a few numpy ops on T
        ints) and shared by every LoRA layer of every call until the mapping
        changes; buffers sized for ``max_num_tokens`` so their shapes never
        change (the graph narrows them).
        """
        key = ("blocks", str(device), tuple(real_dims), tuple(padded_dims))
        with self._lock:
            cached = self._index_cache.get(key)
            if cached is None:
                layout = padded_layout(self._padded_grid(real_dims, padded_dims), self.num_slots,
                                       self.max_num_tokens)
                cached = self._index_cache[key] = tuple(t.to(device) for t in layout)
            return cached

    def _host_segment_layout(self, real_dims, padded_dims, block_tokens: int,
                             slots_per_block: int) -> Optional[SegmentLayout]:
        """The segment layout of the padded bucket on the host, or None when a block needs more passes.

        Called with the lock held; built once per mapping, bucket and block shape.
        """
        key = (tuple(real_dims), tuple(padded_dims), block_tokens, slots_per_block)
        if key not in self._segment_cache:
            self._segment_cache[key] = build_segment_layout(self._padded_grid(real_dims, padded_dims),
                                                            block_tokens, slots_per_block)
        return self._segment_cache[key]

    def segments_fit(self, real_dims: Tuple[int, ...], padded_dims: Tuple[int, ...], block_tokens: int,
                     slots_per_block: int) -> bool:
        """Whether the segment kernel can run this mapping: no block of ``block_tokens`` consecutive
        (padded) tokens uses more than ``slots_per_block`` slots.  True for requests packed as
        contiguous segments of at least ``block_tokens`` tokens each (with 2 passes per block)."""
        with self._lock:
            return self._host_segment_layout(real_dims, padded_dims, block_tokens, slots_per_block) is not None

    def segment_layout(self, device, real_dims: Tuple[int, ...], padded_dims: Tuple[int, ...], block_tokens: int,
                       slots_per_block: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """The segment kernel's (block_slots, pick) for this step on ``device`` (ops_segments.py).

        Built once per mapping and bucket on the host and shared by every LoRA
        layer; buffers sized for ``max_num_tokens`` (``[ceil(max_num_tokens /
        block_tokens), slots_per_block]`` and ``[max_num_tokens]``), so their
        shapes never change (the graph narrows them).  Refused when the mapping
        does not fit (:meth:`segments_fit`): the kernel would give a token
        another token's adapter.
        """
        key = ("segments", str(device), tuple(real_dims), tuple(padded_dims), block_tokens, slots_per_block)
        with self._lock:
            cached = self._index_cache.get(key)
            if cached is None:
                layout = self._host_segment_layout(real_dims, padded_dims, block_tokens, slots_per_block)
                if layout is None:
                    raise UnsupportedMappingError(
                        f"the mapping uses more than {slots_per_block} adapters in some block of {block_tokens} "
                        f"consecutive tokens (token dims {list(real_dims)}): a graph rewritten with the segment "
                        "kernel cannot run it (the backend switches to the masked kernel; rewrite(..., "
                        "kernel='masked') does the same for a graph rewritten by hand)")
                block_slots = torch.zeros(-(-self.max_num_tokens // block_tokens), slots_per_block, dtype=torch.int32)
                block_slots[: layout.block_slots.shape[0]] = layout.block_slots
                pick = torch.full((self.max_num_tokens,), NO_LORA, dtype=torch.int32)
                pick[: layout.pick.numel()] = layout.pick
                cached = self._index_cache[key] = (block_slots.to(device), pick.to(device))
            return cached

    # ------------------------------------------------------------------ stats
    @property
    def stats(self) -> Mapping:
        """Counters: compiles, rewrites, bucket_hits, fallbacks, padded_token_fraction."""
        with self._lock:  # a snapshot: the nested counters are copied, not shared
            out = {k: dict(v) if isinstance(v, dict) else v for k, v in self._stats.items()}
        total = out["padded_tokens"] + out["real_tokens"]
        out["padded_token_fraction"] = out["padded_tokens"] / total if total else 0.0
        return types.MappingProxyType(out)

    def _count(self, key: str, sub=None, n: int = 1) -> None:
        with self._lock:
            if sub is None:
                self._stats[key] += n
            else:
                self._stats[key][sub] = self._stats[key].get(sub, 0) + n


def _scaling_for(name: str, rank: int, scaling: Optional[float], config) -> float:
    if scaling is not None:
        if isinstance(scaling, bool) or not isinstance(scaling, numbers.Real):
            raise TypeError(f"load_adapter({name!r}): scaling must be a real number, got {scaling!r:.80}")
        if not math.isfinite(scaling):
            raise ValueError(f"load_adapter({name!r}): scaling must be finite, got {scaling}")
        return float(scaling)
    if config is not None:
        alpha = config.lora_alpha
        return alpha / math.sqrt(rank) if getattr(config, "use_rslora", False) else alpha / rank
    raise ValueError(f"load_adapter({name!r}): give scaling= or a LoraConfig as config=")


def _host_slot_weights(where: str, w: AdapterWeights, dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor]:
    """A and scaling * B as host tensors of the stack dtype; refused if any value is not finite.

    Why refuse: the fused expand multiplies every slot's B by zeros for the
    tokens on other slots, and 0 * inf is NaN, so one bad slot would reach
    every token of the batch, not only its own.
    """
    with torch.no_grad():
        lora_a = w.lora_a.detach().to("cpu", dtype)
        # Folding the scaling into B lets every adapter keep its own alpha/r.
        scaled_b = (w.lora_b.detach().to("cpu", torch.float32) * w.scaling).to(dtype)
    for what, t in (("lora_A", lora_a), (f"lora_B * scaling ({w.scaling})", scaled_b)):
        bad = int((~torch.isfinite(t)).sum())
        if bad:
            raise ValueError(f"{where}: {what} has {bad} NaN or inf value(s) (as {dtype}); adapter weights "
                             "must be finite")
    return lora_a, scaled_b


def _split_state(state: Mapping[str, torch.Tensor], sites: Mapping[str, SiteSpec]):
    """Group a PEFT-style state dict by site: {site: (A, B)}; unknown keys are errors."""
    found: Dict[str, Dict[str, torch.Tensor]] = {}
    for key, tensor in state.items():
        if not isinstance(key, str):
            raise TypeError(f"load_adapter: state keys must be str, got {key!r:.80}")
        parts = key.split(".")
        role_at = next((i for i, p in enumerate(parts) if p in ("lora_A", "lora_B", "lora_embedding_A",
                                                                 "lora_embedding_B")), None)
        is_embedding = role_at is not None and parts[role_at].startswith("lora_embedding")
        if role_at is None or not (parts[-1] == "weight" or is_embedding):
            raise KeyError(f"load_adapter: {key!r} is not a lora_A / lora_B weight")
        prefix = ".".join(parts[:role_at])
        site = _match_site(prefix, sites)
        if site is None:
            raise KeyError(f"load_adapter: {key!r} names no registered LoRA site")
        role = "A" if parts[role_at].endswith("A") else "B"
        found.setdefault(site, {})[role] = tensor
    out = {}
    for site, roles in found.items():
        if set(roles) != {"A", "B"}:
            raise KeyError(f"load_adapter: site {site!r} has {sorted(roles)} but needs both lora_A and lora_B")
        out[site] = (roles["A"], roles["B"])
    return out


def _match_site(prefix: str, sites: Mapping[str, SiteSpec]) -> Optional[str]:
    if prefix in sites:
        return prefix
    hits = [s for s in sites if s.endswith("." + prefix) or prefix.endswith("." + s)]
    return hits[0] if len(hits) == 1 else None
