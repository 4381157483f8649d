"""Signals honoured in SFT (issue 63 item 4): SIGTERM / SIGINT during SFT stop after the current SFT step with a
checkpoint (RL step 0, SFT's progress in its metadata) that ``train --resume`` continues from; a stop before SFT's
eval skips it (the resume runs it). Tested like the RL phase's SIGTERM (tests/runtime/test_train.py): a real
process signalled mid-SFT, then resumed; and in process, that the resumed SFT trains on the batches the
uninterrupted one would have."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from jax_rl.config import CONFIG_DIR, load_config
from jax_rl.metrics import read_jsonl

from .test_train import TINY

ROOT = Path(__file__).resolve().parents[2]


def _ctx(tmp_path, name, steps):
    from jax_rl.runtime.context import RunContext

    cfg = load_config(CONFIG_DIR / "tiny_cpu.yaml", TINY + [f"run.dir={tmp_path / name}", f"sft.steps={steps}"])
    ctx = RunContext(cfg)
    seen: list = []
    real = ctx.learner.sft_step

    def spy(batch):
        seen.append(np.asarray(batch["tokens"]).copy())
        return real(batch)

    ctx.learner.sft_step = spy
    return ctx, seen


@pytest.mark.timeout(600)
def test_stop_in_sft_ends_after_the_current_step_and_resumes_on_the_same_batches(tmp_path):
    steps, at = 8, 3
    full, all_batches = _ctx(tmp_path, "full", steps)
    try:
        full.sft(progress=False)
    finally:
        full.learner.close()
    assert len(all_batches) == steps

    ctx, seen = _ctx(tmp_path, "cut", steps)
    stop = threading.Event()
    real = ctx.learner.sft_step

    def signalled(batch):  # the signal arrives during step `at` (0-based): that step finishes, no other
        out = real(batch)
        if len(seen) == at + 1:
            stop.set()
        return out

    ctx.learner.sft_step = signalled
    try:
        assert ctx.sft_and_eval(progress=False, stop=stop) is None  # no eval after a stopped SFT
        assert ctx.meta["sft_steps_done"] == at + 1 and not ctx.meta.get("sft_done")
        stop.clear()
        ev = ctx.sft_and_eval(progress=False, stop=stop)  # what a resume runs (the meta comes from the checkpoint)
        assert ev is not None and ctx.meta["sft_done"] and ctx.meta["sft_steps_done"] == steps
    finally:
        ctx.learner.close()
    assert len(seen) == steps
    for a, b in zip(seen, all_batches):  # every batch once, in the uninterrupted order
        np.testing.assert_array_equal(a, b)


def _wait_for(pred, p, what, timeout=300):
    t0 = time.time()
    while not pred():
        if p.poll() is not None:
            pytest.fail(f"train exited before {what}:\n" + p.stdout.read()[-3000:])
        if time.time() - t0 > timeout:
            pytest.fail(f"no {what} within {timeout} s")
        time.sleep(0.2)


@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("runtime,sig", [("embedded", signal.SIGTERM), ("embedded", signal.SIGINT),
                                         pytest.param("ray", signal.SIGTERM, marks=pytest.mark.ray)])
def test_signal_in_sft_checkpoints_and_resume_continues(tmp_path, runtime, sig):
    d = tmp_path / "run"
    steps = 800
    extra = ["runtime=ray", "runtime.ray_workers=1"] if runtime == "ray" else []
    args = [sys.executable, "-m", "jax_rl.cli", "train", str(CONFIG_DIR / "tiny_cpu.yaml"), *TINY,
            f"sft.steps={steps}", "run.steps=1", f"run.dir={d}", *extra]
    env = dict(os.environ, PYTHONUNBUFFERED="1", JAX_PLATFORMS="cpu", RAY_AUTH_MODE="disabled")
    if runtime == "ray":
        env.pop("XLA_FLAGS", None)
    p = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        def sft_started():
            f = d / "sft.jsonl"
            return f.exists() and any(r.get("step", 0) >= 11 for r in read_jsonl(f))

        _wait_for(sft_started, p, "SFT step 11")
        t = time.time()
        p.send_signal(sig)
        out, _ = p.communicate(timeout=300)
        stop_s = time.time() - t
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 128 + sig, out[-3000:]
    line = [ln for ln in out.splitlines() if ln.startswith("stopped by signal")]
    assert line and "during SFT at step " in line[0] and f"of {steps}" in line[0], out[-3000:]
    done = int(line[0].split("at step ")[1].split()[0])
    assert 11 <= done < steps, line
    assert str(d / "checkpoints" / "0") in line[0] and (d / "checkpoints" / "0").is_dir()
    assert not (d / "eval.jsonl").exists() or "after_sft" not in (d / "eval.jsonl").read_text()
    print(f"{runtime} {signal.Signals(sig).name} at SFT step {done}/{steps}: stopped {stop_s:.1f} s later")

    r = subprocess.run(args + ["--resume"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=800)
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
    rows = read_jsonl(d / "sft.jsonl")
    logged = [x["step"] for x in rows]
    assert logged.count(1) == 1 and logged[-1] == steps, logged[:5]  # SFT continued, not restarted
    assert logged == sorted(logged), logged  # every logged step once, in order
    s = json.loads((d / "summary.json").read_text())
    assert s["rl_steps"] == 1 and s["sft_success"] is not None
