"""The graph passes besides the patterns: analysis, attaching unserved sites, saved modules, fusion, folding."""
