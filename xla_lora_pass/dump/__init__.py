"""Graph dumps: every graph before and after the rewrite, and the site report.

Two users:

* the backend calls :func:`dump_graphs` for every graph Dynamo hands it: the
  graphs and report go to the structured trace (``TORCH_TRACE``, read by
  tlparse) as artifacts, and, with the settings' ``dump_dir`` set, into a new
  folder per compile;
* ``xla-lora-dump`` / ``python -m xla_lora_pass.dump`` (``cli.py``) builds a
  model from a ``MODULE:FACTORY``, captures its Dynamo graphs, rewrites them
  and prints or writes one of the views in ``views.py``.

A package rather than a module so that ``python -m xla_lora_pass.dump`` runs
``__main__.py``, not a module the backend has already imported.  This module
never imports ``cli.py``: the command line builds a backend, and the backend
imports this module.
"""
from __future__ import annotations

import logging
import os
from typing import Optional

import torch
import torch.fx as fx

from graph_rewrites import RewriteReport

from .views import GraphDump, render_html

log = logging.getLogger(__name__)

# Names of the TORCH_TRACE artifacts; tlparse lists them per compile.
TRACE_BEFORE, TRACE_AFTER, TRACE_REPORT = "xla_lora_graph_before", "xla_lora_graph_after", "xla_lora_report"


def trace_graphs(before: fx.GraphModule, after: fx.GraphModule, report: RewriteReport) -> None:
    """The graphs and the report as structured-trace artifacts; free when tracing is off (lazy payloads)."""
    payloads = ((TRACE_BEFORE, lambda: before.print_readable(print_output=False)),
                (TRACE_AFTER, lambda: after.print_readable(print_output=False)),
                (TRACE_REPORT, report.format))
    for name, payload in payloads:
        torch._logging.trace_structured(
            "artifact", metadata_fn=lambda name=name: {"name": name, "encoding": "string"}, payload_fn=payload)


def _new_folder(dump_dir: str) -> str:
    """A fresh ``compile_NNN`` folder, numbered on from those present, so runs never overwrite each other."""
    os.makedirs(dump_dir, exist_ok=True)
    n = 0
    while True:
        folder = os.path.join(dump_dir, f"compile_{n:03d}")
        try:
            os.mkdir(folder)
            return folder
        except FileExistsError:
            n += 1


def dump_graphs(dump_dir: Optional[str], before: fx.GraphModule, after: fx.GraphModule,
                report: RewriteReport) -> Optional[str]:
    """Record one compile: trace artifacts, and before.py, after.py, report.txt, view.html under ``dump_dir``.

    Returns the new folder, or None when ``dump_dir`` is unset or unwritable
    (a dump is a diagnostic: it must never cost the compile).
    """
    trace_graphs(before, after, report)
    if not dump_dir:
        return None
    from torch._guards import CompileContext

    compile_id = CompileContext.current_compile_id()
    dump = GraphDump(0, before, after, report)
    files = {
        "before.py": before.print_readable(print_output=False),
        "after.py": after.print_readable(print_output=False),
        "report.txt": f"Dynamo compile id: {compile_id}\n{report.format()}\n",
        "view.html": render_html([dump], title=f"compile {compile_id}"),
    }
    try:
        folder = _new_folder(dump_dir)
        for name, text in files.items():
            with open(os.path.join(folder, name), "w") as f:
                f.write(text)
    except OSError as exc:
        log.warning("could not write the graph dump under %s: %s", dump_dir, exc)
        return None
    log.info("dumped compile %s to %s", compile_id, folder)
    return folder


__all__ = ["GraphDump", "TRACE_AFTER", "TRACE_BEFORE", "TRACE_REPORT", "dump_graphs", "trace_graphs"]
