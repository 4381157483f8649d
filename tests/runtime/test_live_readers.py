"""A live run its readers cannot hurt (issue 63 item 1): ``train`` saving a checkpoint every step while
``jax-rl eval`` and ``jax-rl export`` of its run dir loop against it, on a host loaded on purpose (busy
processes beside it). The run ends 0, every reader ends 0 with no traceback, and every committed step is still
there (none deleted by a reader's cleanup, no save in flight lost). Real processes, no mocks. Before the fix
a reader's Orbax manager removed the live save's ``<step>.orbax-checkpoint-tmp`` dir and the run died."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from jax_rl.config import CONFIG_DIR

ROOT = Path(__file__).resolve().parents[2]
TINY_CFG = str(CONFIG_DIR / "tiny_cpu.yaml")
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
STEPS = 14

pytestmark = pytest.mark.slow

BUSY = "import time\nt = time.time()\nwhile time.time() - t < 900: pass\n"


def _cli(*args, cwd=None, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jax_rl.cli", *args], cwd=cwd or ROOT, env=ENV,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.timeout(1500)
def test_eval_and_export_loop_against_a_live_run_saving_every_step(tmp_path):
    d = tmp_path / "run"
    train = subprocess.Popen(
        [sys.executable, "-m", "jax_rl.cli", "train", TINY_CFG, f"run.dir={d}", f"run.steps={STEPS}", "sft.steps=2",
         "checkpoint.every=1", "checkpoint.max_to_keep=100", "checkpoint.async_save=true", "eval.every=0",
         "optim.batch_size=16", "algo.group_size=4"],
        cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    busy = [subprocess.Popen([sys.executable, "-c", BUSY]) for _ in range(2)]  # load the host on purpose
    readers: list[tuple[str, subprocess.CompletedProcess]] = []
    try:
        t0 = time.time()
        while not (d / "checkpoints" / "1").is_dir():
            assert train.poll() is None, train.communicate()[1][-3000:]
            assert time.time() - t0 < 600, "no first checkpoint"
            time.sleep(0.5)

        def loop(kind: str) -> None:
            i = 0
            while train.poll() is None:
                if kind == "eval":
                    r = _cli("eval", str(d), TINY_CFG, "eval.num_tasks=2", "eval.k=1")
                else:
                    r = _cli("export", str(d), str(tmp_path / f"export{i}"))
                readers.append((kind, r))
                i += 1

        threads = [threading.Thread(target=loop, args=(k,)) for k in ("eval", "export")]
        for t in threads:
            t.start()
        out, err = train.communicate(timeout=1200)
        for t in threads:
            t.join(timeout=400)
    finally:
        for p in busy:
            p.kill()
            p.wait()
        if train.poll() is None:
            train.kill()
            train.wait()
    assert train.returncode == 0, err[-4000:]
    assert "Traceback" not in err, err[-4000:]
    assert readers and {k for k, _ in readers} == {"eval", "export"}, readers
    for kind, r in readers:
        assert r.returncode == 0, (kind, r.stderr[-3000:])
        assert "Traceback" not in r.stderr and "raised an exception" not in r.stderr, (kind, r.stderr[-3000:])
    names = sorted(p.name for p in (d / "checkpoints").iterdir())
    assert sorted(int(n) for n in names if n.isdigit()) == list(range(1, STEPS + 1)), names
    assert not [n for n in names if "tmp" in n], names
    print(f"{len(readers)} readers ({sum(k == 'eval' for k, _ in readers)} evals) against a {STEPS}-step run")
