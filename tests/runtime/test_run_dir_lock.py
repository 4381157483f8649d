"""One writer per run dir (issue 48, item 1): ``train`` and ``sft`` hold ``<run.dir>/.lock`` (an OS file
lock) for their whole life; a second ``--resume`` / ``--overwrite`` on a held dir is refused in one line
naming the holder's PID and host (exit 2) and touches nothing; a ``kill -9``'d holder leaves the dir
lockable; readers (``eval``, ``plot``) work on a held dir. Two real processes, no mocks."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jax_rl.config import CONFIG_DIR
from jax_rl.runtime.run_dir import LOCK_FILE, lock_holder, lock_run_dir, probe_run_dir, unlock_run_dir

ROOT = Path(__file__).resolve().parents[2]
TINY_CFG = str(CONFIG_DIR / "tiny_cpu.yaml")
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}

HOLDER = """
import sys, time
from pathlib import Path
from jax_rl.runtime.run_dir import lock_run_dir
lock_run_dir(Path(sys.argv[1]), command="train")
print("held", flush=True)
time.sleep(600)
"""


def _hold(run_dir: Path) -> subprocess.Popen:
    """A second real process that takes the run dir's lock through the project's own function and sleeps."""
    p = subprocess.Popen([sys.executable, "-c", HOLDER, str(run_dir)], cwd=ROOT, env=ENV, stdout=subprocess.PIPE,
                         text=True)
    assert p.stdout.readline().strip() == "held"
    return p


def _snapshot(d: Path) -> dict:
    """Every file under ``d`` (the lock file aside) -> (size, mtime_ns, sha1)."""
    return {str(p.relative_to(d)): (p.stat().st_size, p.stat().st_mtime_ns, hashlib.sha1(p.read_bytes()).hexdigest())
            for p in sorted(d.rglob("*")) if p.is_file() and p.name != LOCK_FILE}


def _fake_run(d: Path) -> None:
    (d / "checkpoints" / "2").mkdir(parents=True)
    (d / "checkpoints" / "2" / "state").write_text("x")
    (d / "config.yaml").write_text("run: {steps: 3}\n")
    (d / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward_mean": 0.5}) + "\n")


def _cli(*args, timeout=180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jax_rl.cli", *args], cwd=ROOT, env=ENV, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.timeout(600)
def test_second_writer_on_a_held_run_dir_is_one_line_exit_2_and_touches_nothing(tmp_path):
    d = tmp_path / "run"
    _fake_run(d)
    before = _snapshot(d)
    holder = _hold(d)
    try:
        rec = lock_holder(d)
        assert rec["pid"] == holder.pid and rec["host"] == socket.gethostname()
        assert probe_run_dir(d)["pid"] == holder.pid
        for flag in ("--resume", "--overwrite", None):  # (no flag: refused for the holder, not "holds a run")
            r = _cli("train", TINY_CFG, f"run.dir={d}", *([flag] if flag else []))
            err = r.stderr.strip()
            assert r.returncode == 2, (flag, r.returncode, r.stderr[-2000:])
            assert "\n" not in err and err.startswith("jax-rl: error:") and "Traceback" not in err, err
            assert f"PID {holder.pid}" in err and socket.gethostname() in err and "held by" in err, err
            if flag:
                assert flag in err, err
            assert _snapshot(d) == before, flag  # nothing deleted, rewritten or added
            assert holder.poll() is None  # the holder lives on
        r = _cli("sft", TINY_CFG, f"run.dir={d}", "sft.steps=1", "--overwrite")
        assert r.returncode == 2 and f"PID {holder.pid}" in r.stderr and "\n" not in r.stderr.strip(), r.stderr
        assert _snapshot(d) == before
    finally:
        holder.kill()
        holder.wait()
    # kill -9 left the lock file but no lock: the dir is lockable at once, by this process
    assert (d / LOCK_FILE).is_file() and probe_run_dir(d) is None
    lock_run_dir(d, command="train")
    try:
        assert lock_holder(d)["pid"] == os.getpid()
    finally:
        unlock_run_dir(d)


def test_kill_9_of_a_holder_mid_run_leaves_no_stale_lock(tmp_path):
    d = tmp_path / "run"
    d.mkdir()
    holder = _hold(d)
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait()
    assert holder.returncode == -signal.SIGKILL
    assert lock_holder(d)["pid"] == holder.pid  # its record is still there ...
    assert probe_run_dir(d) is None  # ... and nobody holds the lock
    second = _hold(d)  # another process takes it
    try:
        assert lock_holder(d)["pid"] == second.pid
    finally:
        second.kill()
        second.wait()


def test_lock_is_idempotent_in_one_process_and_released(tmp_path):
    d = tmp_path / "run"
    d.mkdir()
    lock_run_dir(d, command="sft")
    lock_run_dir(d, command="sft")  # the same process again: no self-conflict
    assert probe_run_dir(d)["command"] == "sft"
    unlock_run_dir(d)
    unlock_run_dir(d)  # (a no-op)
    assert probe_run_dir(d) is None and not (d / LOCK_FILE).exists()  # a clean release leaves no lock file


@pytest.mark.slow  # ~50 s: a real tiny train run to read
@pytest.mark.timeout(900)
def test_eval_and_plot_read_a_held_run_dir_without_disturbing_it(tmp_path, capsys):
    """Readers never take the lock: ``eval`` and ``plot`` of a run dir another process holds work, and
    change nothing in it (``plot --out`` elsewhere); the holder keeps its lock."""
    from jax_rl.cli import main
    from jax_rl.runtime.train import run_train
    from tests.runtime.test_train import TINY, _cfg

    cfg = _cfg(tmp_path, "run.steps=1", "sft.steps=1")
    assert run_train(cfg) == 0
    d = Path(cfg.run.dir)
    assert probe_run_dir(d) is None  # released at the end of the run
    before = _snapshot(d)
    holder = _hold(d)
    try:
        capsys.readouterr()
        assert main(["eval", str(d), TINY_CFG, *TINY]) == 0
        assert '"version": 1' in capsys.readouterr().out
        assert main(["plot", str(d), "--out", str(tmp_path / "figs")]) == 0
        assert (tmp_path / "figs" / "training_dynamics.png").is_file()
        assert _snapshot(d) == before
        assert probe_run_dir(d)["pid"] == holder.pid and holder.poll() is None
    finally:
        holder.kill()
        holder.wait()


def test_multi_process_refusal_reaches_every_process(tmp_path):
    """``hold_run_dir_all`` (multi-process runs) with a foreign holder (a real second process): process 0's
    refusal is raised on every process (through the all-gather), and a non-zero process that finds a
    holder other than process 0 refuses too. The all-gathers are played by a recording stub."""
    from jax_rl.runtime.run_dir import RunDirHeldError, hold_run_dir_all

    d = tmp_path / "run"
    d.mkdir()
    holder = _hold(d)
    try:
        sent = []

        def gather_as_0(obj):  # process 0's view: process 1 hands in nothing of note
            sent.append(obj)
            return [obj, {"err": None, "holder": None} if isinstance(obj, dict) else None]

        with pytest.raises(RunDirHeldError, match=f"PID {holder.pid}"):
            hold_run_dir_all(d, command="train", what="--resume", process_index=0, gather=gather_as_0)
        assert f"PID {holder.pid}" in sent[0]["err"]  # handed to the others, so they stop too

        def gather_as_1(obj):  # process 1's view: process 0 (another host) holds its own copy of the dir
            return [{"err": None, "holder": {"pid": 1, "host": "elsewhere"}} if isinstance(obj, dict) else None, obj]

        with pytest.raises(RunDirHeldError, match=f"PID {holder.pid}"):
            hold_run_dir_all(d, command="train", what="--resume", process_index=1, gather=gather_as_1)

        def gather_from_1(obj):  # process 1 sent its refusal: process 0 raises it as well
            return [obj, {"err": "x is held by PID 7 on host h", "holder": None} if isinstance(obj, dict) else "held by PID 7"]

        holder.kill()
        holder.wait()
        with pytest.raises(RunDirHeldError, match="PID 7"):
            hold_run_dir_all(d, command="train", what="--resume", process_index=0, gather=gather_from_1)
        assert probe_run_dir(d) is None  # process 0 let its own lock go again
    finally:
        holder.kill()
        holder.wait()
