"""Numbers must not move: a 4-step synchronous run of each correction mode reproduces the
``metrics.jsonl`` recorded before the correction-home redesign (issue "One home for the
off-policy correction").

The fixtures in ``tests/runtime/fixtures/numbers_<mode>.json`` were written by this file with
``JAXRL_RECORD_FIXTURES=1`` on the code before the redesign. ``async.max_staleness=0`` makes the
run synchronous, so with a fixed ``run.seed`` every batch is the same from run to run.
Values compare at rtol 1e-6, except the keys in ``CHANGED_ON_PURPOSE`` (a definition that
changed on purpose) and wall-clock figures.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

from jax_rl.config import CONFIG_DIR, load_config
from jax_rl.metrics import read_jsonl
from jax_rl.runtime.train import TIMING_KEYS, run_train

FIXTURES = Path(__file__).parent / "fixtures"
MODES = ["ppo", "decoupled", "linear_prox", "ppo_ewma", "exact"]
# clip_frac: the redesign makes it the *active* clip fraction (verl's pg_clipfrac), on purpose;
# prox_source repeats the mode name and may be dropped
CHANGED_ON_PURPOSE = {"clip_frac", "prox_source"}



def _changed(key: str) -> bool:
    """clip_frac changed definition everywhere it appears, the staleness buckets' included."""
    return key in CHANGED_ON_PURPOSE or key.endswith("/clip_frac")


RUN = [
    "run.steps=4",
    "run.seed=7",
    "sft.steps=20",
    "sft.batch_size=4",
    "sft.num_demos=16",
    "eval.every=0",
    "eval.num_tasks=2",
    "eval.k=2",
    "async.max_staleness=0",
    "optim.batch_size=8",
    "optim.minibatches=2",
    "rollout.group_size=4",
    "rollout.slots=8",
    "logging.progress=false",
    "logging.tensorboard=false",
    "checkpoint.every=0",
    "optim.warmup_steps=50",  # pinned: the recorded lr schedule must not follow later tiny_cpu edits
]


def _numbers(row: dict) -> dict:
    """The row without wall-clock figures, buffer counters (thread timing) and non-numbers."""
    return {k: v for k, v in row.items()
            if k not in TIMING_KEYS and not k.endswith("_s") and "per_s" not in k
            and not k.startswith("buffer/") and isinstance(v, (int, float)) and not isinstance(v, bool)}


def _run(tmp_path: Path, mode: str) -> list[dict]:
    cfg = load_config(CONFIG_DIR / "tiny_cpu.yaml", RUN + [f"loss.correction={mode}", f"run.dir={tmp_path / mode}"])
    assert run_train(cfg) == 0
    return [_numbers(r) for r in read_jsonl(tmp_path / mode / "metrics.jsonl")]


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("mode", MODES)
def test_metrics_match_the_recorded_run(tmp_path, mode):
    rows = _run(tmp_path, mode)
    path = FIXTURES / f"numbers_{mode}.json"
    if os.environ.get("JAXRL_RECORD_FIXTURES") == "1":
        path.parent.mkdir(exist_ok=True)
        path.write_text(json.dumps(rows, indent=1, sort_keys=True) + "\n")
        pytest.skip(f"recorded {path}")
    want = json.loads(path.read_text())
    assert [r["step"] for r in rows] == [r["step"] for r in want] == [1, 2, 3, 4]
    for got, exp in zip(rows, want):
        missing = {k for k in set(exp) - set(got) if not _changed(k)}
        assert not missing, f"step {exp['step']}: metrics gone: {sorted(missing)}"
        for k, v in exp.items():
            if _changed(k):
                continue
            g = got[k]
            ok = (math.isnan(v) and math.isnan(g)) or math.isclose(g, v, rel_tol=1e-6, abs_tol=1e-9)
            assert ok, f"{mode} step {exp['step']} {k}: got {g!r}, recorded {v!r}"
