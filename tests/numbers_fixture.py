"""Shared by the two "numbers must not move" tests: record or compare per-step metric rows
against a JSON fixture written before the correction-home redesign."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

# Row 0 is the first step, at the recorded initial params: forward math and one gradient, equal
# to ~1e-4 across hosts (XLA's CPU code differs between AVX2 and AVX-512) and layouts (scanned vs
# unrolled layers reduce in another order). Later rows follow AdamW at lr 3e-2, which turns those
# roundings on near-zero gradients into +-lr steps: measured up to 3% apart by step 4 between two
# hosts, and as far between two meshes of one host. A changed correction formula moves row 0 by
# far more than RTOL_FIRST.
RTOL_FIRST = 1e-3
RTOL_LATER = 5e-2
RTOL = RTOL_FIRST

# the redesign changed clip_frac's definition on purpose (the active clip, verl's pg_clipfrac),
# the staleness buckets' included; prox_source repeated the mode name and was dropped
CHANGED_ON_PURPOSE = {"clip_frac", "prox_source"}


def changed_on_purpose(key: str) -> bool:
    return key in CHANGED_ON_PURPOSE or key.endswith("/clip_frac")


def record_or_compare(rows: list[dict], path: Path, label: str, *, abs_tol: float) -> None:
    """With ``JAXRL_RECORD_FIXTURES=1`` write ``rows`` to ``path`` and skip; else every recorded
    metric (but the ones changed on purpose) must still be there and equal at ``RTOL_FIRST`` (row 0) / ``RTOL_LATER``."""
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
            rtol = RTOL_FIRST if i == 0 else RTOL_LATER
            ok = (math.isnan(v) and math.isnan(g)) or math.isclose(g, v, rel_tol=rtol, abs_tol=abs_tol)
            assert ok, f"{label} row {i} {k}: got {g!r}, recorded {v!r}"
