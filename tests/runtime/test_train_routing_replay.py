"""``jax-rl train configs/tiny_moe_cpu.yaml loss.correction=exact moe.routing_replay=r3`` end to
end (embedded runtime): the run finishes, logs ``routing_agreement``, its checkpointed buffer
carries each pending trajectory's routes aligned with its tokens, and a resume continues."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from jax_rl.config import CONFIG_DIR, load_config
from jax_rl.runtime.train import run_train

from .test_train import TINY
from .test_train_dedicated import ROOT, _pending, _rows

R3 = ["loss.correction=exact", "moe.routing_replay=r3", "async.max_staleness=2"]


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_cli_train_exact_r3_then_resume(tmp_path):
    d = tmp_path / "r3"
    args = [sys.executable, "-m", "jax_rl.cli", "train", str(CONFIG_DIR / "tiny_moe_cpu.yaml"), *TINY, *R3,
            "run.steps=2", "checkpoint.every=2", f"run.dir={d}"]
    p = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rows = _rows(d)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert 0.0 <= r["routing_agreement"] <= 1.0 and r["routing_pairs"] > 0
    pend = [t for g in _pending(d, 2) for t in g]
    for t in pend:  # routes survive the checkpoint, one [n_moe_layers, k] per token
        r = np.asarray(t["routes"])
        assert r.shape[0] == len(t["tokens"]) and r.shape[1:] == (2, 2) and t["routes_dtype"] == "int8"
        assert np.all(r[:-1] >= 0)  # every position but the last was run by the engine
    cfg = load_config(CONFIG_DIR / "tiny_moe_cpu.yaml", TINY + R3 + ["run.steps=3", f"run.dir={d}", "resume=true"])
    assert run_train(cfg) == 0
    assert [r["step"] for r in _rows(d)] == [1, 2, 3]
