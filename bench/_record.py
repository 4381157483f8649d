"""Shared by the bench scripts that run interleaved rounds: a figure's median with its range, and the
JSON record file each run appends to (``--json``)."""

from __future__ import annotations

import json
import os
import statistics
from typing import Any, Sequence


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
