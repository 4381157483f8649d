"""Readers never write to a checkpoint dir (issue 63 item 1): a read-only Checkpointer (what ``jax-rl eval`` /
``export`` restore through) removes no ``<step>.orbax-checkpoint-tmp`` dir (a live writer's save in flight),
lists and restores only committed steps, and refuses to save or delete; the writer (the run-dir lock's holder)
still cleans what a killed save left. A save that fails to commit is one line naming the step and the dir."""

from __future__ import annotations

import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_rl.checkpoint import Checkpointer, CheckpointCommitError


def _state(v: int) -> dict:
    return {"w": jnp.full((4,), float(v)), "version": jnp.asarray(v, jnp.int32)}


def _target() -> dict:
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), _state(0))


def _run_dir(tmp_path):
    d = tmp_path / "checkpoints"
    with Checkpointer(d, max_to_keep=5, async_save=False) as w:
        for s in (1, 2):
            w.save(s, state=_state(s), metadata={"version": s})
    # an uncommitted save (what a live writer has in flight, or a killed one left): step 3's tmp dir
    shutil.copytree(d / "2", d / "3.orbax-checkpoint-tmp")
    return d


def test_reader_keeps_uncommitted_dir_and_takes_newest_committed(tmp_path):
    d = _run_dir(tmp_path)
    before = sorted(p.name for p in d.iterdir())
    r = Checkpointer(d, read_only=True)
    try:
        assert r.all_steps() == [1, 2]  # the tmp dir is not a step
        out = r.restore(None, state=_target())
        assert int(out["metadata"]["version"]) == 2
        np.testing.assert_array_equal(np.asarray(out["state"]["w"]), np.full((4,), 2.0))
        with pytest.raises(PermissionError, match="read-only"):
            r.save(4, state=_state(4), metadata={"version": 4})
        with pytest.raises(PermissionError, match="read-only"):
            r.delete(1)
    finally:
        r.close()
    assert sorted(p.name for p in d.iterdir()) == before  # nothing removed, nothing added
    assert (d / "3.orbax-checkpoint-tmp").is_dir()

    # the writer (the lock holder) cleans it when it opens the dir (done by its next save at the latest)
    with Checkpointer(d, max_to_keep=5, async_save=False) as w:
        w.save(4, state=_state(4), metadata={"version": 4})
    assert sorted(p.name for p in d.iterdir()) == ["1", "2", "4"]


def test_learner_reader_restore_removes_nothing(tmp_path):
    """The learner's read-only restore (eval / export): the same through LearnerCheckpoints."""
    from jax_rl.learner.learner import Learner

    from ._util import init_params, make_cfg

    cfg = make_cfg("ppo_ewma", B=4, mesh={"data": 1, "fsdp": -1, "tensor": 1, "expert": 1},
                   checkpoint={"max_to_keep": 5, "async_save": False})
    ck = tmp_path / "ck"
    a = Learner(cfg, init_params=init_params(cfg))
    for s in (1, 2):
        a.checkpoints.save(ck, {"rl_steps": s}, rl_step=s, wait=True)
    a.close()
    shutil.copytree(ck / "2", ck / "3.orbax-checkpoint-tmp")
    b = Learner(cfg, init_params=init_params(cfg, seed=1))
    try:
        meta = b.checkpoints.restore(ck, read_only=True)
        assert meta["checkpoint_step"] == 2
    finally:
        b.close()
    assert (ck / "3.orbax-checkpoint-tmp").is_dir()


def test_failed_commit_is_one_line_naming_step_and_dir(tmp_path, monkeypatch):
    d = tmp_path / "checkpoints"
    w = Checkpointer(d, async_save=True)
    w.save(7, state=_state(7), metadata={"version": 7})

    def gone():  # what Orbax raises when the save's tmp dir was removed under it
        raise FileNotFoundError(f"[Errno 2] No such file or directory: '{d}/7.orbax-checkpoint-tmp/metadata"
                                ".orbax-checkpoint-tmp/commit_success.txt'")

    real = w._mgr.wait_until_finished
    monkeypatch.setattr(w._mgr, "wait_until_finished", gone)
    with pytest.raises(CheckpointCommitError) as e:
        w.wait()
    msg = str(e.value)
    assert "\n" not in msg and "step 7" in msg and str(d / "7") in msg
    monkeypatch.setattr(w._mgr, "wait_until_finished", real)
    w.close()


def test_cli_failed_commit_exit_1(capsys):
    from jax_rl import cli

    class Args:
        @staticmethod
        def func(_):
            raise CheckpointCommitError("checkpoint step 7 did not commit in /x/checkpoints/7 (gone)")

    assert cli._dispatch(Args()) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["jax-rl: error: checkpoint step 7 did not commit in /x/checkpoints/7 (gone)"]
