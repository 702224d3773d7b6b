"""What a rewrite did: every site rewritten and every near miss, with reasons."""
from __future__ import annotations

import dataclasses
from typing import Dict, FrozenSet, List, Optional, Tuple


@dataclasses.dataclass
class SiteRewrite:
    """A LoRA site replaced by BGMV calls."""

    site: str
    pattern: str
    adapter: str  # the adapter the captured graph had active
    x_shape: Optional[Tuple]
    out_shape: Optional[Tuple]
    rank: int  # the site's stacked (max) rank
    num_slots: int
    replaced: List[str]  # names of the graph nodes that went away


@dataclasses.dataclass
class NearMiss:
    """A LoRA computation left exactly as it was, and why."""

    site: Optional[str]
    pattern: Optional[str]
    reason: str
    nodes: List[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class RewriteContext:
    """What every pass gets besides the graph: limits from the caller, and the report to fill."""

    max_num_tokens: int
    report: "RewriteReport"
    token_layout: Optional[Tuple] = None  # example dims (int/SymInt) the mapping is laid out over
    # Nodes whose rows are token_layout flattened row-major (flat_tokens.py): OPT's [B*S, H].
    flat_token_nodes: FrozenSet = frozenset()
    # "auto": the row kernel where the site is on a [B, S] layout (the backend falls back to a "masked"
    # rewrite for mappings that mix adapters within a row); "masked": every slot's columns;
    # "blocked": tokens sorted by slot into row blocks; "segments": blocks of consecutive tokens, each with
    # at most segment_slots_per_block slots (packed batches).
    kernel: str = "masked"
    row_kernel_min_tokens: int = 2  # "auto" keeps the masked kernel for a static row length below this
    block_size: int = 32
    num_slots: int = 0  # for the blocked layout's block count
    segment_block_tokens: int = 32  # the segment kernel's block length and passes per block
    segment_slots_per_block: int = 2


@dataclasses.dataclass
class RewriteReport:
    sites: List[SiteRewrite] = dataclasses.field(default_factory=list)
    near_misses: List[NearMiss] = dataclasses.field(default_factory=list)
    error: Optional[str] = None  # set when the rewrite failed and the graph was left alone
    token_layout: Optional[Tuple] = None  # the graph's token dims (int/SymInt), when it has LoRA sites
    shrinks_fused: int = 0  # shrink calls saved by fusing sites that share an input

    def counts(self) -> Dict[str, int]:
        """Sites rewritten per pattern name."""
        out: Dict[str, int] = {}
        for s in self.sites:
            out[s.pattern] = out.get(s.pattern, 0) + 1
        return out

    def format(self) -> str:
        """A human-readable table of sites and near misses."""
        lines = [f"{len(self.sites)} LoRA sites rewritten, {len(self.near_misses)} near misses"]
        for s in self.sites:
            lines.append(f"  rewritten  {s.site}  [{s.pattern}]  x{list(s.x_shape or ())} -> "
                         f"{list(s.out_shape or ())}  rank {s.rank}  slots {s.num_slots}  "
                         f"replaced {', '.join(s.replaced)}")
        for n in self.near_misses:
            lines.append(f"  near miss  {n.site}  [{n.pattern or '-'}]  {n.reason}")
        if self.error:
            lines.append(f"  rewrite failed, graph left unchanged: {self.error}")
        return "\n".join(lines)
