"""What every pass gets besides the graph: the caller's limits and kernels, and the report to fill."""
from __future__ import annotations

import dataclasses
from typing import Dict, FrozenSet, Optional, Tuple

from .kernel_spec import KernelSpec
from .report import RewriteReport


@dataclasses.dataclass
class RewriteContext:
    """What every pass gets besides the graph: limits from the caller, and the report to fill."""

    max_num_tokens: int
    report: RewriteReport
    # The kernel this rewrite emits for the sites it applies to (its KernelSpec.site_inputs says which), and
    # every kernel of the caller's table in order, the fallback last: it reads the token
    # indices, so it serves every site the chosen kernel does not.
    kernel: KernelSpec
    kernels: Tuple[KernelSpec, ...]
    token_layout: Optional[Tuple] = None  # example dims (int/SymInt) the mapping is laid out over
    # Nodes whose rows are token_layout flattened row-major (passes/flat_tokens.py): OPT's [B*S, H].
    flat_token_nodes: FrozenSet = frozenset()
    # Nodes whose rows are those of a row selection of token_layout (passes/row_selections.py), to that
    # selection: BERT's classifier after its pooler's hidden[:, 0].
    row_selections: Dict = dataclasses.field(default_factory=dict)
    num_slots: int = 1  # adapter slots of every site (the sorted kernel sizes its layout for them and the base)

    @property
    def fallback(self) -> KernelSpec:
        """The kernel of every site ``kernel`` does not apply to."""
        return self.kernels[-1]
