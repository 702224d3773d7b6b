"""Interleaved timing: every figure is a ratio to a baseline measured in the same repetition.

The machine is shared (2 cores, other jobs), so configurations are never timed
one after the other in long runs: each repetition runs every configuration
once, in a rotating order, and each ratio is taken within one repetition.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from typing import Callable, Dict, List, Sequence

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(BENCH_DIR)
OUT_DIR = os.path.join(BENCH_DIR, "out")


def time_interleaved(fns: Dict[str, Callable[[], None]], reps: int, steps: int,
                     clock: Callable[[], float] = time.perf_counter) -> Dict[str, List[float]]:
    """Seconds per call of each fn, one list entry per repetition (mean of ``steps`` calls).

    Each fn must finish its work before returning (``.cpu()`` or a device wait).
    ``clock``: wall time by default; ``time.process_time`` counts the CPU time
    of this process's threads only, which other jobs on the cores inflate less.
    """
    names = list(fns)
    out = {n: [] for n in names}
    for rep in range(reps):
        order = names[rep % len(names):] + names[:rep % len(names)]  # rotate: no config always runs first
        for name in order:
            fn = fns[name]
            start = clock()
            for _ in range(steps):
                fn()
            out[name].append((clock() - start) / steps)
    return out


def ratios(times: Dict[str, List[float]], base: str) -> Dict[str, List[float]]:
    """Per-repetition ratio of every config to ``base`` (same repetition)."""
    return {n: [t / b for t, b in zip(ts, times[base])] for n, ts in times.items()}


def summary(values: Sequence[float], fmt: str = "{:.2f}") -> str:
    """'median [min-max]'."""
    med = statistics.median(values)
    return f"{fmt.format(med)} [{fmt.format(min(values))}-{fmt.format(max(values))}]"


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def run_child(script: str, args: Sequence[str], label: str, env: Dict[str, str] = None) -> dict:
    """Run ``script args`` in a fresh process (XLA's program cache and Dynamo's caches start empty),
    with ``env`` added to the environment; return the JSON it prints on a line starting with ``ROW ``."""
    cmd = [sys.executable, os.path.join(BENCH_DIR, script), *args]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **(env or {})})
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-8000:])
        raise RuntimeError(f"{label}: {' '.join(cmd)} failed with exit code {proc.returncode}")
    print(f"  done: {label} ({time.perf_counter() - start:.0f} s)", file=sys.stderr, flush=True)
    return json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("ROW "))[4:])


def emit(row: dict) -> None:
    print("ROW " + json.dumps(row), flush=True)
