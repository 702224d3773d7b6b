"""What a rewrite did: every site rewritten and every near miss, with reasons."""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Tuple


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
    # The number the traced graph scaled the delta by, which the stacks carry now (None: a tensor did, the
    # adapter's scaling tensor or input; or a pass that reads no scale).  The caller keeps the stacks at it.
    scale: Optional[float] = None


@dataclasses.dataclass
class NearMiss:
    """A LoRA computation left exactly as it was, and why."""

    site: Optional[str]
    pattern: Optional[str]
    reason: str
    nodes: List[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class RewriteReport:
    sites: List[SiteRewrite] = dataclasses.field(default_factory=list)
    near_misses: List[NearMiss] = dataclasses.field(default_factory=list)
    error: Optional[str] = None  # set when the rewrite failed and the graph was left alone
    token_layout: Optional[Tuple] = None  # the graph's token dims (int/SymInt), when it has LoRA sites
    shrinks_fused: int = 0  # shrink calls saved by fusing sites that share an input
    # (site, adapter) of branches removed: another active adapter's at a site rewritten for the mapped one
    dropped_branches: List[Tuple[str, str]] = dataclasses.field(default_factory=list)

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
        for site, adapter in self.dropped_branches:
            lines.append(f"  removed    {site}  adapter {adapter!r}'s branch: another active adapter's, the site "
                         "adds the mapped adapter's delta")
        for n in self.near_misses:
            lines.append(f"  near miss  {n.site}  [{n.pattern or '-'}]  {n.reason}")
        if self.error:
            lines.append(f"  rewrite failed, graph left unchanged: {self.error}")
        return "\n".join(lines)
