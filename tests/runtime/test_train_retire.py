"""``jax-rl train ... loss.correction=exact old_logits.route=interrupt|retire`` end to end
(embedded runtime): the CLI run finishes with every batch scored on the rollout side, its
checkpointed buffer carries each pending trajectory's ``old_logp``, and a resume continues from it."""

from __future__ import annotations

import subprocess
import sys

import pytest

from jax_rl.config import CONFIG_DIR, load_config
from jax_rl.runtime.train import run_train

from .test_train import TINY
from .test_train_dedicated import ROOT, _conserved, _pending, _rows, _sum


@pytest.mark.timeout(900)
@pytest.mark.parametrize("route", ["interrupt", "retire"])
def test_cli_train_then_resume(tmp_path, route):
    d = tmp_path / route
    over = ["loss.correction=exact", f"old_logits.route={route}", "async.max_staleness=2"]
    args = [sys.executable, "-m", "jax_rl.cli", "train", str(CONFIG_DIR / "tiny_cpu.yaml"), *TINY, *over,
            "run.steps=2", f"run.dir={d}"]
    p = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert f"old_logits.route={route}" in p.stdout
    rows = _rows(d)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["old_logits_forwards"] == 0.0  # the learner's own: none
        assert 1 <= r["old_logits_versions"] <= 2 and r["old_logits_max_held"] <= 2
        assert r["old_logits_dropped"] == 0 and r["old_logits_retire_errors"] == 0
        assert r["old_logits_stall_s"] >= 0 and r["buffer/dropped_unscored"] == 0
    s = _sum(d)
    assert s["old_logits_retired"] >= 1 and s["old_logits_dropped"] == 0
    _conserved(s)
    pend = [t for g in _pending(d, 2) for t in g]
    assert all(len(t["old_logp"]) == len(t["tokens"]) for t in pend)  # the old logits survive the checkpoint

    cfg = load_config(CONFIG_DIR / "tiny_cpu.yaml", TINY + over + ["run.steps=3", f"run.dir={d}", "resume=true"])
    assert run_train(cfg) == 0
    rows = _rows(d)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[-1]["buffer/dropped_unscored"] == 0 and rows[-1]["old_logits_forwards"] == 0.0
    _conserved(_sum(d))
