"""Every ```bash block in docs/*.md runs as written and succeeds.

How a block runs: as one ``bash -euo pipefail`` script, cwd = the repository
root, with this interpreter's directory (the venv's bin, holding ``python``
and ``xla-lora-dump``) prepended to PATH, and PJRT_DEVICE=CPU unless set.
Blocks must stay cheap (seconds); examples that are not meant to run here are
fenced as ```text, ```console or ```python.
"""
import glob
import os
import re
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FENCE = re.compile(r"^```bash\n(.*?)^```$", re.S | re.M)


def bash_blocks():
    """(doc path relative to the repo, line number, script) for every ```bash block under docs/."""
    blocks = []
    for path in sorted(glob.glob(os.path.join(REPO, "docs", "*.md"))):
        with open(path) as f:
            text = f.read()
        for m in FENCE.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            blocks.append((os.path.relpath(path, REPO), line, m.group(1)))
    return blocks


BLOCKS = bash_blocks()


def test_docs_have_runnable_examples():
    """The collection below must not silently become empty (a renamed folder, a broken fence pattern)."""
    docs = {doc for doc, _, _ in BLOCKS}
    assert {"docs/architecture.md", "docs/user-guide.md", "docs/kernels.md", "docs/pattern-authoring.md"} <= docs


@pytest.mark.parametrize("doc, line, script", BLOCKS, ids=[f"{d}:{n}" for d, n, _ in BLOCKS])
def test_bash_block_runs(doc, line, script):
    env = dict(os.environ)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    env.setdefault("PJRT_DEVICE", "CPU")
    run = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, (f"{doc}:{line} exited {run.returncode}\n--- script\n{script}"
                                 f"--- stdout\n{run.stdout[-3000:]}\n--- stderr\n{run.stderr[-3000:]}")
