"""Shared by the bench scripts: a figure's median with its range, the JSON record file each run appends to
(``--json``), and :data:`SMALL_DIMS`, the ``small`` model size they measure beside the tiny preset."""

from __future__ import annotations

import json
import os
import statistics
from typing import Any, Sequence


SMALL_DIMS = {"hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4, "num_attention_heads": 8,
              "num_key_value_heads": 4, "head_dim": 32}
"""The benches' ``small`` Qwen3 (HF config names, over the ``tiny_dense`` preset; the vocabulary is each
bench's own): where compute rather than dispatch dominates a step on the CPU."""


def median_range(xs: Sequence[float]) -> tuple[float, float, float]:
    """``(median, min, max)`` of one figure over the rounds."""
    return statistics.median(xs), min(xs), max(xs)


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
