"""Checkpoint metadata counters, and restore of a partial / corrupt checkpoint (issue 16 item 7).

Through the public Learner API only: ``save(..., rl_step=)`` / ``restore(step=)``.
"""

from __future__ import annotations

import logging
import shutil

import pytest

from jax_rl.checkpoint import CheckpointCorruptError
from jax_rl.learner.learner import Learner

from ._util import init_params, make_batch, make_cfg

pytestmark = pytest.mark.slow


def test_counters_and_fallback_past_corrupt_steps(tmp_path, caplog):
    # ppo_ewma (an ewma item) with 2 epochs x 2 minibatches: opt_step != version
    cfg = make_cfg("ppo_ewma", B=4, mesh={"data": 1, "fsdp": -1, "tensor": 1, "expert": 1},
                   optim={"ppo_epochs": 2, "minibatches": 2}, checkpoint={"max_to_keep": 5})
    ck = tmp_path / "ck"
    a = Learner(cfg, init_params=init_params(cfg))
    for s in (1, 2, 3):
        a.train_step(make_batch(s, B=4, T=16))
        a.checkpoints.save(ck, {"rl_steps": s}, rl_step=s)
    a.checkpoints.wait()
    a.close()

    b = Learner(cfg, init_params=init_params(cfg, seed=1))
    meta = b.checkpoints.restore(ck)
    assert (meta["checkpoint_step"], meta["rl_step"], meta["version"], meta["opt_step"]) == (3, 3, 3, 12)
    assert meta["skipped_checkpoints"] == []

    shutil.rmtree(ck / "3" / "ewma")  # a deleted item
    (ck / "2" / "metadata" / "metadata").write_text('{"version": 2, ')  # bad JSON
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="jax_rl.learner.learner"):
        meta = b.checkpoints.restore(ck)
    assert meta["checkpoint_step"] == 1 and meta["rl_step"] == 1 and b.version == 1 and b.step == 4
    assert [s for s, _ in meta["skipped_checkpoints"]] == [3, 2]
    warns = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warns) == 2 and all("\n" not in w for w in warns)
    assert "3" in warns[0] and "missing item(s) ewma" in warns[0]
    assert "unreadable metadata" in warns[1]

    # an explicit bad step is an error (one line), never a silent fallback
    with pytest.raises(CheckpointCorruptError, match="missing item\\(s\\) ewma") as e:
        b.checkpoints.restore(ck, step=3)
    assert "\n" not in str(e.value)
    with pytest.raises(CheckpointCorruptError, match="unreadable metadata"):
        b.checkpoints.restore(ck, step=2)
    with pytest.raises(FileNotFoundError, match="step 7"):
        b.checkpoints.restore(ck, step=7)

    # array data that does not restore: caught too; nothing good left -> one-line error
    for f in (ck / "1" / "state").rglob("*"):
        if f.is_file() and f.parent.name == "d":
            f.write_bytes(b"garbage")
    with pytest.raises(CheckpointCorruptError, match="no restorable checkpoint") as e:
        b.checkpoints.restore(ck)
    assert "\n" not in str(e.value) and "failed to restore" in str(e.value)
    b.close()
