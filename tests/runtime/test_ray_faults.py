"""``runtime=ray`` under signals and faults (issue 39), as embedded ``jax-rl train``:

* SIGTERM to the driver (a preempted TPU VM): the step finishes, the end checkpoint and
  ``summary.json`` are written, exit 143, and no Ray process of the run is left.
* ``kill -9`` of the raylet: one line naming it, a ``summary.json`` (``ray_failed``), exit 1, the last
  checkpoint intact.
* an address or bind host that does not answer: one line, exit 2, in bounded time, no run dir.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jax_rl.config import CONFIG_DIR
from tests.runtime.test_train import TINY

ROOT = Path(__file__).resolve().parents[2]


def _ray_procs(run_dir: Path) -> list:
    """Live processes of this run's Ray (their command line names its temp dir)."""
    import psutil

    roots = {str(p.resolve()) for p in (run_dir / "ray_tmp", run_dir / "ray") if p.exists()}
    out = []
    for p in psutil.process_iter(["cmdline", "status"]):
        try:
            cmd = " ".join(p.info["cmdline"] or [])
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if p.info.get("status") != psutil.STATUS_ZOMBIE and any(r in cmd for r in roots):
            out.append(p)
    return out


def _start(d: Path, *extra: str) -> subprocess.Popen:
    env = dict(os.environ, RAY_AUTH_MODE="disabled", PYTHONUNBUFFERED="1")
    env.pop("XLA_FLAGS", None)
    args = [sys.executable, "-m", "jax_rl.cli", "train", str(CONFIG_DIR / "tiny_cpu.yaml"), *TINY, "runtime=ray",
            "runtime.ray_workers=1", "run.steps=200", "checkpoint.every=0", f"run.dir={d}", *extra]
    return subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_rows(p: subprocess.Popen, d: Path, n: int, timeout: float = 700, name: str = "metrics.jsonl") -> None:
    t = time.monotonic()
    while time.monotonic() - t < timeout:
        m = d / name
        if m.exists() and len(m.read_text().splitlines()) >= n:
            return
        if p.poll() is not None:
            out, err = p.communicate()
            pytest.fail(f"the run ended early ({p.returncode}): {out[-2000:]} {err[-2000:]}")
        time.sleep(0.5)
    p.kill()
    pytest.fail("no metrics row in time")


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_sigterm_under_ray_checkpoints_and_exits_143(tmp_path):
    """SIGTERM once SFT's eval is written (checkpoint.every=0: before this fix SFT and every RL step
    were lost): the RL step in progress finishes, the end checkpoint holds SFT (and that step).

    The signal lands while the rollout workers build (compile) their engines: the driver stops
    without waiting for them (``RayProducer.stop_event``), so the exit is bounded by the checkpoint
    and Ray's shutdown, not by the engines' compile time on a loaded host (the cause of this test's
    earlier timeouts). One deadline bounds the whole test below its pytest timeout."""
    deadline = time.monotonic() + 1100
    d = tmp_path / "r"
    p = _start(d, "eval.num_tasks=1", "eval.k=1")
    _wait_rows(p, d, 1, name="eval.jsonl", timeout=deadline - time.monotonic() - 300)  # the after-SFT eval row
    p.send_signal(signal.SIGTERM)
    t_sig = time.monotonic()
    out, err = p.communicate(timeout=max(60.0, deadline - time.monotonic()))
    assert p.returncode == 143, (out[-3000:], err[-3000:])
    print(f"SIGTERM -> exit: {time.monotonic() - t_sig:.1f} s")
    assert "PC:" not in err and "SIGTERM received" not in err, err[-3000:]
    assert "loss.correction=ppo_ewma:" in out  # the correction mode's cost line, printed under Ray too
    s = json.loads((d / "summary.json").read_text())
    assert s["interrupted"] is True and s["runtime"] == "ray" and s["rl_steps"] < 200
    assert (d / "checkpoints" / str(s["rl_steps"])).is_dir()  # the end checkpoint (checkpoint.every=0)
    time.sleep(2)
    assert _ray_procs(d) == [], [q.info["cmdline"][:3] for q in _ray_procs(d)]


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_raylet_death_is_one_line_with_a_summary(tmp_path):
    d = tmp_path / "r"
    p = _start(d, "checkpoint.every=1")
    _wait_rows(p, d, 2)
    raylets = [q for q in _ray_procs(d) if "raylet" in " ".join(q.info["cmdline"][:1])]
    assert raylets, "no raylet found"
    raylets[0].kill()
    out, err = p.communicate(timeout=120)
    assert p.returncode == 1, (out[-3000:], err[-3000:])
    lines = [ln for ln in err.splitlines() if ln.startswith("jax-rl:")]
    assert lines and "raylet" in lines[-1] and f"pid {raylets[0].pid}" in lines[-1], err[-3000:]
    s = json.loads((d / "summary.json").read_text())
    assert "raylet" in s["ray_failed"] and s["last_checkpoint"]
    assert Path(s["last_checkpoint"]).is_dir()
    time.sleep(3)
    assert _ray_procs(d) == []


@pytest.mark.parametrize("override, words", [
    ("runtime.bind_host=not.a.host", ["runtime.bind_host=not.a.host", "cannot be resolved"]),
    ("runtime.bind_host=192.0.2.1", ["runtime.bind_host=192.0.2.1", "not an address of this machine"]),
    ("runtime.ray_address=127.0.0.1:1", ["runtime.ray_address=127.0.0.1:1", "nothing answers"]),
    ("runtime.ray_address=nonsense", ["runtime.ray_address=nonsense", "host:port"]),
])
def test_unreachable_ray_endpoints_are_one_line(tmp_path, capsys, override, words):
    """No Ray is started: the check runs before the run dir and Ray exist."""
    from jax_rl.cli import main

    d = tmp_path / "r"
    t = time.monotonic()
    capsys.readouterr()
    assert main(["train", str(CONFIG_DIR / "tiny_cpu.yaml"), *TINY, "runtime=ray", override, f"run.dir={d}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("jax-rl") and "\n" not in err and all(w in err for w in words), err
    assert time.monotonic() - t < 60 and not d.exists()


def test_a_ray_node_that_does_not_start_is_one_line_exit_1(tmp_path, capsys, monkeypatch):
    """Ray's startup wait running out on a loaded host (``ray.init`` raises the bare Exception Ray's
    node raises): one line naming it, exit 1 (a failed run), and the fresh run dir is not left behind.
    No Ray is started: ``ray.init`` is replaced by what Ray raises at its 30 s raylet wait."""
    import ray

    from jax_rl.cli import main

    calls = []

    def timed_out(**kw):
        calls.append(kw["_temp_dir"])
        raise Exception("The current node timed out during startup. This could happen because some of the "
                        "raylet failed to startup or the GCS has become overloaded.")

    monkeypatch.setattr(ray, "init", timed_out)
    d = tmp_path / "r"
    capsys.readouterr()
    assert main(["train", str(CONFIG_DIR / "tiny_cpu.yaml"), *TINY, "runtime=ray", f"run.dir={d}"]) == 1
    err = capsys.readouterr().err.strip()
    assert calls and err.startswith("jax-rl: error: runtime=ray: the local Ray node did not start"), err
    assert "\n" not in err and "timed out during startup" in err and "runtime=embedded" in err
    assert not d.exists() and not Path(calls[0]).exists()  # neither the run dir nor Ray's temp dir


@pytest.mark.parametrize("actor_id, who", [("learner-id", "the learner actor"), ("other-id", "a rollout-worker actor"),
                                           (None, "a Ray actor of the run")])
def test_an_actor_that_dies_is_one_line_exit_1(tmp_path, capsys, monkeypatch, actor_id, who):
    """An actor of the run dying (e.g. the learner killed or never started on a loaded host): one line
    naming which, exit 1, not Ray's traceback. No Ray is started: the actors and ``ray.get`` are fakes
    that raise what Ray raises (``ActorDiedError``) at the first call."""
    import ray

    from jax_rl.cli import main
    from jax_rl.runtime import ray_runtime as rr

    class Handle:
        _actor_id = type("Id", (), {"hex": lambda self: "learner-id"})()

        def __getattr__(self, name):
            return type("M", (), {"remote": lambda self, *a, **k: name})()

    class Learner:
        @staticmethod
        def remote(*a, **k):
            return Handle()

    def died(ref, **kw):
        e = ray.exceptions.ActorDiedError()
        e.actor_id = actor_id
        raise e

    class Watch:
        def __init__(self, *a, **k):
            pass

        def start(self):
            return self

        def dead(self):
            return None

        def stop(self):
            pass

    monkeypatch.setattr(rr, "init_ray", lambda *a, **k: ray)
    monkeypatch.setattr(rr, "actor_classes", lambda: (None, None, Learner))
    monkeypatch.setattr(rr, "RayDaemonWatch", Watch)
    monkeypatch.setattr(ray, "get", died)
    d = tmp_path / "r"
    capsys.readouterr()
    assert main(["train", str(CONFIG_DIR / "tiny_cpu.yaml"), *TINY, "runtime=ray", f"run.dir={d}"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"jax-rl: error: runtime=ray: {who} died or could not start (ActorDiedError"), err
    assert "\n" not in err and err.endswith("last checkpoint: none"), err
