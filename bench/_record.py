"""Shared by the bench scripts: their preamble, a figure's median with its range, the median time of a jitted
call, the JSON record file each run appends to (``--json``), and :data:`SMALL_DIMS`, the ``small`` model size
they measure beside the tiny preset.

The preamble: a bench script's first project import is ``from _record import ...`` (``bench/`` is on
``sys.path`` as the script's own directory, or by ``tests/bench_module.load_bench``); importing this module
puts the repository root (:data:`ROOT`) first on ``sys.path``, so ``jax_rl`` and ``rollout`` come from the
checkout the script sits in, not from an installed copy. It imports no jax (a script may set XLA flags first).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

ROOT = Path(__file__).resolve().parents[1]
"""The repository root (the bench scripts' checkout)."""
if not sys.path or sys.path[0] != str(ROOT):
    sys.path.insert(0, str(ROOT))


SMALL_DIMS = {"hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4, "num_attention_heads": 8,
              "num_key_value_heads": 4, "head_dim": 32}
"""The benches' ``small`` Qwen3 (HF config names, over the ``tiny_dense`` preset; the vocabulary is each
bench's own): where compute rather than dispatch dominates a step on the CPU."""


def median_range(xs: Sequence[float]) -> tuple[float, float, float]:
    """``(median, min, max)`` of one figure over the rounds."""
    return statistics.median(xs), min(xs), max(xs)


def median_time(fn: Callable, *args: Any, reps: int = 3) -> float:
    """Median wall seconds of ``fn(*args)`` over ``reps`` calls, each waited for (``jax.block_until_ready``),
    after one untimed call (compile, warm-up)."""
    import jax

    jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def append_record(path: str, rec: dict[str, Any]) -> None:
    """Append ``rec`` to the JSON list at ``path`` (created with its directory when missing)."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    old = []
    if os.path.exists(path):
        with open(path) as f:
            old = json.load(f)
    with open(path, "w") as f:
        json.dump(old + [rec], f, indent=1)
    print(f"appended to {path}")


def finish(args: Any, load_before: tuple, load_after: tuple, results: dict, **extra: Any) -> dict:
    """Print the load average after the rounds and, with ``args.json``, append the run's record (date, the
    arguments, both load averages, ``results`` and ``extra``) to that file. Returns the record."""
    import datetime as dt

    print(f"load average after: {load_after[0]:.1f} {load_after[1]:.1f} {load_after[2]:.1f}")
    rec = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "args": vars(args), **extra,
           "load_before": load_before, "load_after": load_after, "results": results}
    if getattr(args, "json", None):
        append_record(args.json, rec)
    return rec
