"""Shared by the two "numbers must not move" tests: record or compare per-step metric rows
against a JSON fixture written before the correction-home redesign."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

# XLA's CPU code differs between hosts (AVX2 vs AVX-512 vector widths change reduction orders):
# a grad norm recorded on one host reads 5e-6 relative off on another. A change of the math moves
# these metrics by far more than this tolerance.
RTOL = 1e-4

# the redesign changed clip_frac's definition on purpose (the active clip, verl's pg_clipfrac),
# the staleness buckets' included; prox_source repeated the mode name and was dropped
CHANGED_ON_PURPOSE = {"clip_frac", "prox_source"}


def changed_on_purpose(key: str) -> bool:
    return key in CHANGED_ON_PURPOSE or key.endswith("/clip_frac")


def record_or_compare(rows: list[dict], path: Path, label: str, *, abs_tol: float) -> None:
    """With ``JAXRL_RECORD_FIXTURES=1`` write ``rows`` to ``path`` and skip; else every recorded
    metric (but the ones changed on purpose) must still be there and equal at rtol ``RTOL``."""
    if os.environ.get("JAXRL_RECORD_FIXTURES") == "1":
        path.parent.mkdir(exist_ok=True)
        path.write_text(json.dumps(rows, indent=1, sort_keys=True) + "\n")
        pytest.skip(f"recorded {path}")
    want = json.loads(path.read_text())
    assert len(rows) == len(want), (len(rows), len(want))
    for i, (got, exp) in enumerate(zip(rows, want)):
        missing = {k for k in set(exp) - set(got) if not changed_on_purpose(k)}
        assert not missing, f"{label} row {i}: metrics gone: {sorted(missing)}"
        for k, v in exp.items():
            if changed_on_purpose(k):
                continue
            g = got[k]
            ok = (math.isnan(v) and math.isnan(g)) or math.isclose(g, v, rel_tol=RTOL, abs_tol=abs_tol)
            assert ok, f"{label} row {i} {k}: got {g!r}, recorded {v!r}"
