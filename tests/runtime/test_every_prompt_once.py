"""Every prompt trained once across ``kill -9`` and ``--resume`` (issue 63 item 5), on the embedded and the Ray
runtime: an asynchronous run (K = async.max_staleness = 2, partial rollouts continued across weight swaps,
``rollout.slots / algo.group_size + 1`` groups in flight per engine and finished groups waiting in the buffer)
killed with SIGKILL at several steps and resumed each time, against the same run uninterrupted.

From the trained records (``metrics.jsonl``'s ``group_ids`` of every step, each step once) and the final
checkpoint (its in-flight groups to re-issue and its buffered groups): no group trained twice; every group
started is trained, in flight or in the buffer, nothing lost (the conservation a non-atomic checkpoint breaks:
NeMo-RL #3599 lost 675 of 736 skipped prompts, biased toward long rollouts); the prompts trained are the
uninterrupted run's (up to the groups still in flight at the end), and the trained episodes' lengths are not
shifted against it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from jax_rl.metrics import read_jsonl

from .test_resume_faults import ROOT, _train

STEPS = 9
KILLS = (2, 4, 6)  # metrics rows at which the run is killed (after each resume)

pytestmark = pytest.mark.slow


def _env(runtime: str) -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1", JAX_PLATFORMS="cpu", RAY_AUTH_MODE="disabled")
    if runtime == "ray":
        env.pop("XLA_FLAGS", None)
    return env


def _ray_leftovers(d: Path) -> None:
    """kill -9 of a Ray driver can leave its daemons: end the ones of this run (their command lines name its
    temp dir), as a preempted VM would have."""
    import psutil

    roots = {str(p.resolve()) for p in (d / "ray_tmp", d / "ray") if p.exists()}
    for p in psutil.process_iter(["cmdline"]):
        try:
            if any(r in " ".join(p.info["cmdline"] or []) for r in roots):
                p.kill()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass


def _newest_checkpoint(d: Path) -> tuple[int, int]:
    """``(groups in flight, groups buffered)`` in the newest committed checkpoint of ``d`` ((0, 0) if none)."""
    ck = d / "checkpoints"
    steps = [int(p.name) for p in ck.iterdir() if p.name.isdigit()] if ck.is_dir() else []
    if not steps:
        return 0, 0
    m = json.loads((ck / str(max(steps)) / "metadata" / "metadata").read_text())["runtime"]
    return len(m["producer"]["reissue"]), len(m["buffer"]["pending"])


def _kill_at(args, d: Path, env: dict, rows: int, timeout=900) -> str:
    p = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        t0 = time.time()
        def ready():  # step `rows` trained, and the newest committed checkpoint (saves are async: it may lag a step
            # or two) holds groups in flight and finished groups in the buffer: what the resume must re-issue / restore
            if len(read_jsonl(d / "metrics.jsonl")) < rows:
                return False
            fly, buf = _newest_checkpoint(d)
            return fly > 0 and buf > 0

        while not ready():
            if p.poll() is not None:
                pytest.fail(f"train exited ({p.returncode}) before step {rows}:\n" + p.stdout.read()[-3000:])
            if time.time() - t0 > timeout:
                pytest.fail(f"no step {rows} within {timeout} s")
            time.sleep(0.2)
        p.send_signal(signal.SIGKILL)
        out, _ = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == -signal.SIGKILL, out[-3000:]
    return out


def _records(d: Path) -> dict:
    rows = read_jsonl(d / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1)), [r["step"] for r in rows]  # each step once
    ids = [g for r in rows for g in r["group_ids"]]
    meta = json.loads((d / "checkpoints" / str(STEPS) / "metadata" / "metadata").read_text())["runtime"]
    summary = json.loads((d / "summary.json").read_text())
    return {"ids": ids, "reissue": {int(g) for g, _ in meta["producer"]["reissue"]},
            "buffered": {int(g[0]["group_id"]) for g in meta["buffer"]["pending"]},
            "next_group": int(meta["producer"]["next_group"]), "summary": summary,
            "lens": np.asarray([r["episode_len_mean"] for r in rows], float)}


def _conserved(rec: dict) -> None:
    ids, fly, buf = rec["ids"], rec["reissue"], rec["buffered"]
    assert len(ids) == len(set(ids)) == STEPS * 2, sorted(ids)  # none trained twice (2 groups a step)
    trained = set(ids)
    assert not (trained & fly) and not (trained & buf) and not (fly & buf), (trained & fly, trained & buf, fly & buf)
    s = rec["summary"]
    dropped = s.get("buffer_dropped_stale", 0) + s.get("buffer_failed", 0) + s.get("episode_errors", 0)
    assert dropped == 0, s  # (a dropped group would be a lost prompt too: none here)
    assert trained | fly | buf == set(range(rec["next_group"])), sorted(set(range(rec["next_group"])) - trained - fly - buf)


@pytest.mark.timeout(3000)
@pytest.mark.parametrize("runtime", ["embedded", pytest.param("ray", marks=pytest.mark.ray)])
def test_kill9_and_resume_trains_every_prompt_once(tmp_path, runtime):
    extra = [f"run.steps={STEPS}", "async.max_staleness=2", "rollout.partial=continue", "logging.tensorboard=false"]
    if runtime == "ray":
        extra += ["runtime=ray", "runtime.ray_workers=1"]
    env = _env(runtime)

    a = tmp_path / "uninterrupted"
    r = subprocess.run(_train(a, *extra), cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-3000:])
    if runtime == "ray":
        _ray_leftovers(a)

    b = tmp_path / "killed"
    args = _train(b, *extra)
    at_kills = []  # (in flight, buffered) groups in the checkpoint each resume starts from
    for i, at in enumerate(KILLS):
        _kill_at(args + (["--resume"] if i else []), b, env, at)
        if runtime == "ray":
            _ray_leftovers(b)
        at_kills.append(_newest_checkpoint(b))
    # the kills fell with groups in flight (re-issued by the resume) and finished ones in the buffer (restored)
    assert sum(f for f, _ in at_kills) > 0 and sum(q for _, q in at_kills) > 0, at_kills
    r = subprocess.run(args + ["--resume"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-3000:])
    if runtime == "ray":
        _ray_leftovers(b)

    ra, rb = _records(a), _records(b)
    _conserved(ra)
    _conserved(rb)
    # the prompts trained are the uninterrupted run's: every group below the first one either run still holds
    # (in flight or buffered at the end) is trained by both
    m = min(ra["reissue"] | ra["buffered"] | rb["reissue"] | rb["buffered"] | {ra["next_group"], rb["next_group"]})
    assert {g for g in ra["ids"] if g < m} == {g for g in rb["ids"] if g < m} == set(range(m)), m
    assert m >= STEPS * 2 - 6, m  # at most a few groups still in flight at the end
    # the trained episodes' lengths: not shifted by the kills (re-issued groups are the long, unfinished ones)
    la, lb = ra["lens"].mean(), rb["lens"].mean()
    print(f"{runtime}: groups 0..{m - 1} trained by both; (in flight, buffered) at the kills {at_kills}; mean episode "
          f"length {la:.1f} uninterrupted, {lb:.1f} killed {len(KILLS)}x")
    assert abs(la - lb) <= 0.15 * la, (ra["lens"], rb["lens"])
