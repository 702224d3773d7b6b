"""Graph dumps: the graph before and after the rewrite, and the site report."""
from __future__ import annotations

import itertools
import logging
import os

log = logging.getLogger(__name__)
_counter = itertools.count()


def dump_graphs(dump_dir: str, before, after, report) -> str:
    """Write before.py, after.py and report.txt into a new folder under ``dump_dir``."""
    folder = os.path.join(dump_dir, f"graph_{next(_counter):03d}")
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "before.py"), "w") as f:
        f.write(before.print_readable(print_output=False))
    with open(os.path.join(folder, "after.py"), "w") as f:
        f.write(after.print_readable(print_output=False))
    with open(os.path.join(folder, "report.txt"), "w") as f:
        f.write(report.format() + "\n")
    log.info("dumped graphs to %s", folder)
    return folder
